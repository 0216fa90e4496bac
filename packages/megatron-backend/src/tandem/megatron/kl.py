"""Per-token estimators of KL(π ‖ π_ref) from log-probs of tokens sampled from π.

With `r = ref_log_probs − log_probs` = log(π_ref / π) at a sampled token
(J. Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html):

- `k1 = −r`: unbiased, high variance, can be negative.
- `k2 = r² / 2`: biased, low variance, ≥ 0.
- `k3 = exp(r) − 1 − r`: unbiased, low variance, ≥ 0 (computed as `expm1(r) − r`,
  which keeps its precision for small `r` where it is ≈ r²/2).
- `low_var_kl`: `k3` clamped to [−10, 10] (only the upper bound can bind, since k3 ≥ 0).

Used for the KL penalty in the policy loss (`kl_loss_coef`, `use_kl_loss`).
Masked positions, where both inputs are 0, give 0 for every kind.
"""

from __future__ import annotations

import torch

from tandem.megatron.choices import KL_KINDS
from tandem.megatron.choices import KlKind as KLKind

__all__ = ["KL_KINDS", "KLKind", "approx_kl"]

LOW_VAR_KL_BOUND = 10.0
"""`low_var_kl` is clamped to ±this."""

_LOW_VAR_KL_LOG_RATIO_LIMIT = 20.0
"""`low_var_kl` clamps `r` to ±this before `exp`. Where it binds, k3 > 19 > LOW_VAR_KL_BOUND, so the
value is unchanged; it only keeps `exp` finite, so that the zero gradient of the clamp does not meet
an infinite one (0 · inf = NaN) in backward."""


def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token KL estimate of the current policy against the reference, for the KL loss.

    Gradients flow into both arguments as autograd allows; pass `ref_log_probs`
    detached (it comes from a frozen model). Computed in the inputs' dtype.

    Args:
        log_probs: log π(token) under the policy being trained. Shape `(batch, response_len)` (any shape works).
        ref_log_probs: log π_ref(token) under the reference policy. Same shape.
        kind: one of `KL_KINDS`: "k1", "k2", "k3", "low_var_kl".

    Returns:
        The estimate per token, same shape as the inputs (not masked, not aggregated:
        use `aggregate_loss` with the loss mask).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"approx_kl: unknown `kind` {kind!r}; choose one of {', '.join(KL_KINDS)}")
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"approx_kl: `ref_log_probs` has shape {tuple(ref_log_probs.shape)} but `log_probs` has "
            f"{tuple(log_probs.shape)}; both must be padded alike"
        )
    log_ratio = ref_log_probs - log_probs
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.expm1(log_ratio) - log_ratio
    log_ratio = log_ratio.clamp(-_LOW_VAR_KL_LOG_RATIO_LIMIT, _LOW_VAR_KL_LOG_RATIO_LIMIT)
    return (torch.expm1(log_ratio) - log_ratio).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
