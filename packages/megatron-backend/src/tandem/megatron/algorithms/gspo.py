"""GSPO's policy loss: PPO's clipped surrogate on a sequence-level importance ratio (`loss_type="gspo"`).

Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071):
the ratio of a response is the geometric mean of its tokens' ratios,

    s_i = exp( (1/|y_i|) Σ_t (log π(y_t) − log π_old(y_t)) )     (eq. 7, over trainable tokens)

and it is clipped per sequence, not per token. We use the paper's GSPO-token
form (eq. 13): token `t` of response `i` gets the ratio

    s_{i,t} = sg[s_i] · π(y_t) / sg[π(y_t)]

whose value is `s_i` (so the clip decision is the sequence's) and whose
gradient is `s_i ∇ log π(y_t)`. With one advantage per response (GRPO, RLOO)
it equals GSPO's sequence loss in value and gradient; with per-token
advantages each token keeps its own. The objective is a mean over sequences:
aggregate with `sample_mean` (`WorkerConfig` refuses `token_mean` with GSPO).
The paper's clip ranges are far smaller than PPO's (ε_low = 3e-4, ε_high = 4e-4),
since a sequence's ratio averages its tokens' log-ratios.

The log of `s_{i,t}` is clamped to ±`LOG_RATIO_LIMIT` = ±20 before `exp`, as PPO's
ratio is. The peers differ there: verl (b178a3c, `verl/trainer/ppo/core_algos.py`
`compute_policy_loss_gspo`) clamps the same quantity from above only, at 10, and
OpenRLHF (3c3be62, `openrlhf/models/loss.py` `PolicyLoss`) not at all. All three agree
while a sequence's mean log-ratio lies in [−10, 10] (ratios from 4.5e-5 to 2.2e4); above
10 a positive advantage is clipped at `1 + ε_high` either way, and only a negative
advantage's loss (without dual clip: `−A · s`) and its gradient are e^10 in verl and
`min(s, e^20)` here, a sequence far outside any trust region.
"""

from __future__ import annotations

import torch

from tandem.megatron.algorithms.losses import LOG_RATIO_LIMIT, check_clip_ranges, clipped_surrogate

__all__ = ["gspo_policy_loss", "sequence_log_ratio"]


def sequence_log_ratio(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """`(1/|y_i|) Σ_t (log π − log π_old)` over each response's trainable tokens, differentiable.

    Shapes: inputs `(batch, response_len)`; returns `(batch,)`. A row with no trainable token gives 0.
    """
    mask = loss_mask.detach().to(log_probs.device) != 0
    # `where`, not multiplication: whatever a masked position holds must not leak.
    diff = torch.where(mask, log_probs - old_log_probs, 0.0)
    return diff.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(diff.dtype)


def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token's clipped surrogate loss per token (to be minimised), for the actor.

    Args:
        log_probs: log π(token) under the policy being trained (with grad). Shape `(batch, response_len)`.
        old_log_probs: log π_old(token) (detached). Same shape.
        advantages: per-token advantages (detached). Same shape.
        loss_mask: 1 (or True) for trainable tokens, the ones the sequence ratio averages. Same shape.
        eps_clip, eps_clip_high, eps_clip_c: as in `losses.policy_loss`, applied to the sequence ratio.

    Returns:
        `(per_token_loss, metrics)` as `losses.policy_loss` returns them; `clip_frac` and
        `dual_clip_frac` mark the tokens of clipped sequences, `approx_kl` is the tokens'
        own `(r − 1) − log r` of `r = π / π_old` (how far the policy moved).
    """
    eps_high = check_clip_ranges("gspo_policy_loss", eps_clip, eps_clip_high, eps_clip_c)
    shapes = {tuple(t.shape) for t in (log_probs, old_log_probs, advantages, loss_mask)}
    if len(shapes) != 1 or log_probs.dim() != 2:
        raise ValueError(
            "gspo_policy_loss: `log_probs`, `old_log_probs`, `advantages` and `loss_mask` must share one "
            f"shape (batch, response_len); got {sorted(shapes)}"
        )
    sequence = sequence_log_ratio(log_probs, old_log_probs, loss_mask)
    log_ratio = sequence.detach()[:, None] + log_probs - log_probs.detach()
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    loss, metrics = clipped_surrogate(ratio, advantages, eps_clip, eps_high, eps_clip_c)
    with torch.no_grad():
        token_log_ratio = torch.clamp(log_probs - old_log_probs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        metrics["approx_kl"] = (torch.expm1(token_log_ratio) - token_log_ratio).detach()
    return loss, metrics
