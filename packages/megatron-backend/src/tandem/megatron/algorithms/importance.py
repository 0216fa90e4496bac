"""Truncated importance sampling: weights that correct for the engine having sampled from its own policy.

The rollout engine sampled the tokens from its own policy (another kernel stack, a
stale step in the async loop), not from π_old; the clipped surrogate assumes π_old.
Multiplying each token's policy loss by `w_t = π_old(y_t) / π_rollout(y_t)` corrects
the off-policy gap (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"); truncating it bounds the variance at the price of a small
bias (Ionides 2008, "Truncated Importance Sampling"). Two variants (`TisMode`):

- `token`: `w_t = clip(π_old / π_rollout, low, cap)` per token (`tis_weights`).
- `seq_mask`: the same per-token weights, times 0 for every token of a sequence whose
  geometric-mean ratio `exp(mean_t log(π_old / π_rollout))` over its trainable tokens
  lies outside `[low, cap]` (`tis_sequence_mask`): a sequence the engine sampled far
  from π_old is left out as a whole rather than down-weighted token by token.

Against the peers: OpenRLHF (3c3be62, `openrlhf/models/loss.py` `PolicyLoss`) has
`tis` (its thresholds `[low, high]`, default `[0.5, 5.0]`) and `seq-mask-tis`, whose
comment says the token weights keep TIS's clamp while its code leaves them unclamped
(`exp` of the log-ratio); ours keep the clamp. slime's `--tis-clip-low` / `--tis-clip`
are our `tis_cap_low` / `tis_cap` (defaults 0 and 2). verl's token-level
`rollout_is` (b178a3c, `verl/trainer/ppo/rollout_corr_helper.py`) has only the upper
bound, our `tis_cap_low = 0`.

The weights are constants of the loss (detached): they scale each token's gradient and
nothing flows into them. Log-ratios are clamped to ±`LOG_RATIO_LIMIT` before `exp`.
"""

from __future__ import annotations

import math

import torch

from tandem.megatron.algorithms.losses import LOG_RATIO_LIMIT
from tandem.megatron.choices import TIS_MODES, TisMode

__all__ = ["TIS_MODES", "TisMode", "tis_sequence_mask", "tis_weights"]


def _check(
    fn: str, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, cap: float, low: float
) -> None:
    if not cap > 0:
        raise ValueError(f"{fn}: `cap` must be > 0 (e.g. 2.0), got {cap}")
    if not (math.isfinite(low) and 0 <= low <= cap):
        raise ValueError(f"{fn}: `low` must lie in [0, cap = {cap}] (0: no lower bound), got {low}")
    if old_log_probs.shape != rollout_log_probs.shape:
        raise ValueError(
            f"{fn}: `rollout_log_probs` has shape {tuple(rollout_log_probs.shape)} but `old_log_probs` has "
            f"{tuple(old_log_probs.shape)}; pad all per-token tensors to (batch, response_len)"
        )


@torch.no_grad()
def tis_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, cap: float, *, low: float = 0.0
) -> torch.Tensor:
    """Truncated importance weights per token, `clip(exp(old_log_probs − rollout_log_probs), low, cap)`, detached.

    Args:
        old_log_probs: log π_old(token), the trainer's. Shape `(batch, response_len)`.
        rollout_log_probs: log π_rollout(token), the engine's. Same shape.
        cap: the upper truncation, > 0 (WorkerConfig asks for >= 1).
        low: the lower truncation in `[0, cap]`; 0: none (WorkerConfig asks for <= 1).

    Returns:
        The weights, same shape, in `old_log_probs`' dtype (not masked: aggregate with the loss mask).
    """
    _check("tis_weights", old_log_probs, rollout_log_probs, cap, low)
    log_ratio = torch.clamp(old_log_probs - rollout_log_probs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(log_ratio).clamp(min=low, max=cap).detach()


@torch.no_grad()
def tis_sequence_mask(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    cap: float,
    *,
    low: float = 0.0,
) -> torch.Tensor:
    """1 on every token of a sequence whose geometric-mean ratio lies in `[low, cap]`, else 0; detached.

    The geometric mean is `exp((1/|y_i|) Σ_t (log π_old − log π_rollout))` over sample
    `i`'s trainable tokens (a row without one has ratio 1).

    Args:
        old_log_probs: log π_old(token). Shape `(batch, response_len)`.
        rollout_log_probs: log π_rollout(token). Same shape.
        loss_mask: 1 (or True) for trainable tokens. Same shape.
        cap, low: the bounds, as in `tis_weights`.

    Returns:
        Shape `(batch, response_len)`, 0 or 1, in `old_log_probs`' dtype.
    """
    _check("tis_sequence_mask", old_log_probs, rollout_log_probs, cap, low)
    mask = loss_mask.detach().to(old_log_probs.device) != 0
    if mask.shape != old_log_probs.shape:
        raise ValueError(
            f"tis_sequence_mask: `loss_mask` has shape {tuple(mask.shape)} but `old_log_probs` has "
            f"{tuple(old_log_probs.shape)}"
        )
    diff = torch.where(mask, old_log_probs - rollout_log_probs, 0.0)
    mean = diff.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(diff.dtype)
    ratio = torch.exp(mean.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    keep = (ratio >= low) & (ratio <= cap)
    return keep[:, None].expand_as(old_log_probs).to(old_log_probs.dtype)
