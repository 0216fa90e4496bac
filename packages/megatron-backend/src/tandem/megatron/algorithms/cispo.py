"""CISPO's policy loss: the clipped importance weight as a constant of a REINFORCE-style loss (`loss_type="cispo"`).

MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
Attention" (arXiv:2506.13585), its "CISPO" objective: PPO's clip drops the gradient of
every token whose ratio left the trust region, and with it the rare, low-probability
tokens that long reasoning forks at. CISPO clips the importance weight
instead and keeps every token's gradient:

    r_t = π(y_t) / π_old(y_t),   r̂_t = clip(r_t, 1 − ε_low, 1 + ε_high)
    loss_t = −sg[r̂_t] · A_t · log π(y_t)

so a token's gradient is `−r̂_t A_t ∇log π(y_t)`: the ratio only weighs it, never
switches it off. The paper tunes ε_high and sets no lower bound in practice (a large
ε_low); here the bounds are `eps_clip` and `eps_clip_high`, as verl's `cispo`
(b178a3c, `verl/trainer/ppo/core_algos.py` `compute_policy_loss_cispo`) takes its
`clip_ratio_low` / `clip_ratio_high`; `eps_clip` close to 1 leaves the weight almost
unbounded below. The loss's value is verl's and the paper's, `−r̂ A log π`, so it is
not comparable with PPO's surrogate (its gradient is).

Dual clip (`eps_clip_c`) bounds PPO's loss of negative advantages at `c·|A|`; CISPO's
loss has no such term to bound, so `WorkerConfig` refuses the two together.
"""

from __future__ import annotations

import torch

from tandem.megatron.algorithms.losses import LOG_RATIO_LIMIT, check_clip_ranges

__all__ = ["cispo_policy_loss"]


def cispo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO's loss per token (to be minimised), for the actor: `−sg[clip(r, 1 − ε_low, 1 + ε_high)] · A · log π`.

    Args:
        log_probs: log π(token) under the policy being trained (with grad). Shape `(batch, response_len)`.
        old_log_probs: log π_old(token) (detached). Same shape.
        advantages: per-token advantages (detached). Same shape.
        eps_clip: ε_low in (0, 1): the weight's lower bound is `1 − eps_clip`.
        eps_clip_high: ε_high > 0, the upper bound `1 + eps_clip_high`; None: `eps_clip`.

    Returns:
        `(per_token_loss, metrics)` as `losses.policy_loss` returns them: `clip_frac` marks
        the tokens whose weight was clipped (they still give a gradient, unlike PPO's),
        `dual_clip_frac` is all 0, `approx_kl` is `(r − 1) − log r`.
    """
    eps_high = check_clip_ranges("cispo_policy_loss", eps_clip, eps_clip_high, None)
    shapes = {tuple(t.shape) for t in (log_probs, old_log_probs, advantages)}
    if len(shapes) != 1:
        raise ValueError(
            "cispo_policy_loss: `log_probs`, `old_log_probs` and `advantages` must share one shape "
            f"(batch, response_len); got {sorted(shapes)}"
        )
    with torch.no_grad():
        log_ratio = torch.clamp(log_probs.detach() - old_log_probs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    loss = -weight * advantages * log_probs
    with torch.no_grad():
        clip_frac = (weight != ratio).to(loss.dtype)
        metrics = {
            "clip_frac": clip_frac,
            "dual_clip_frac": torch.zeros_like(clip_frac),
            "approx_kl": ((ratio - 1.0) - log_ratio).to(loss.dtype),
        }
    return loss, metrics
