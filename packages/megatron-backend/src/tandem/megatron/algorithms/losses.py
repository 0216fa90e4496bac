"""PPO's clipped policy and value losses per token (their aggregation to one scalar: `aggregation`).

Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (eq. 7 for the
clipped surrogate, eq. 9 for the value term); dual clip from Ye et al. 2020,
"Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"
(eq. 5); asymmetric clip ranges (`eps_clip_high`) as in DAPO ("clip-higher").
Conventions in docs/design.md ("PPO math conventions").

Every function here works on padded `(batch, response_len)` tensors and returns
per-token tensors; `aggregate_loss` (`aggregation`, re-exported here) reduces a
per-token tensor (a loss or a metric) with the loss mask. Per-token metrics are 0/1 indicators or values,
detached, so that they aggregate with the same mask, mode and denominators as
the loss they describe (a clip fraction of the whole step is then exact under
micro-batching and data parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tandem.megatron.algorithms.advantages import masked_mean_var
from tandem.megatron.algorithms.aggregation import (
    LOSS_AGGREGATIONS,
    LossAggregation,
    aggregate_loss,
    loss_sum_and_count,
)

__all__ = [
    "LOG_RATIO_LIMIT",
    "LOSS_AGGREGATIONS",
    "LossAggregation",
    "aggregate_loss",
    "check_clip_ranges",
    "clipped_surrogate",
    "explained_variance",
    "loss_sum_and_count",
    "policy_loss",
    "value_loss",
    "value_loss_and_metrics",
]

LOG_RATIO_LIMIT = 20.0
"""`log π − log π_old` is clamped to ±this before `exp`, so the ratio stays finite
(e^20 ≈ 4.9e8) and a masked position's 0 advantage always gives a 0 loss."""


def _check_same_shape(fn: str, reference: str, tensors: dict[str, torch.Tensor]) -> None:
    shape = tensors[reference].shape
    for name, tensor in tensors.items():
        if tensor.shape != shape:
            raise ValueError(
                f"{fn}: `{name}` has shape {tuple(tensor.shape)} but `{reference}` has {tuple(shape)}; "
                "pad all per-token tensors to (batch, response_len)"
            )


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate loss per token (to be minimised), for the actor.

    `ratio = exp(clamp(log_probs − old_log_probs, ±LOG_RATIO_LIMIT))`,
    `pg_loss1 = −A · ratio`, `pg_loss2 = −A · clip(ratio, 1 − eps_clip, 1 + eps_clip_high)`,
    loss = `max(pg_loss1, pg_loss2)`. With dual clip, for `A < 0` the loss is
    further bounded by `pg_loss3 = −A · eps_clip_c`: `min(pg_loss3, max(pg_loss1, pg_loss2))`,
    so that a token whose ratio has exploded cannot dominate the batch.

    A masked position has advantage 0 (as `compute_gae` and `whiten_advantages`
    produce), hence loss 0 and gradient 0, whatever its log-probs hold.

    Args:
        log_probs: log π(token) under the policy being trained (with grad). Shape `(batch, response_len)`.
        old_log_probs: log π_old(token) under the policy that the step started from (detached). Same shape.
        advantages: per-token advantages (detached; whitened or not). Same shape.
        eps_clip: ε_low in (0, 1): the ratio's lower clip bound is `1 − eps_clip`.
        eps_clip_high: ε_high > 0: the upper bound is `1 + eps_clip_high`;
            None means `eps_clip` (symmetric clipping).
        eps_clip_c: the dual-clip constant c > 1 for negative advantages; None disables dual clip.

    Returns:
        `(per_token_loss, metrics)`: the loss, shape `(batch, response_len)`, and
        detached per-token metrics of the same shape and dtype (aggregate them
        with `aggregate_loss` and the loss mask):
        - `clip_frac`: 1 where the clipped term was chosen (`pg_loss2 > pg_loss1`;
          the token gives no gradient), else 0.
        - `dual_clip_frac`: 1 where dual clip bound the loss (`A < 0` and
          `pg_loss3 < max(pg_loss1, pg_loss2)`), else 0; all 0 without dual clip.
        - `approx_kl`: `(ratio − 1) − log ratio`, the k3 estimate of KL(π_old ‖ π)
          on tokens sampled from π_old (as in cleanrl's `approx_kl`).
    """
    eps_high = check_clip_ranges("policy_loss", eps_clip, eps_clip_high, eps_clip_c)
    _check_same_shape(
        "policy_loss",
        "log_probs",
        {"log_probs": log_probs, "old_log_probs": old_log_probs, "advantages": advantages},
    )

    log_ratio = torch.clamp(log_probs - old_log_probs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    loss, metrics = clipped_surrogate(ratio, advantages, eps_clip, eps_high, eps_clip_c)
    with torch.no_grad():
        metrics["approx_kl"] = ((ratio - 1.0) - log_ratio).detach()
    return loss, metrics


def check_clip_ranges(
    fn: str, eps_clip: float, eps_clip_high: float | None, eps_clip_c: float | None
) -> float:
    """ValueError unless the clip constants are in range; returns ε_high (`eps_clip` when None)."""
    if not 0.0 < eps_clip < 1.0:
        raise ValueError(
            f"{fn}: `eps_clip` must be in (0, 1), got {eps_clip}; "
            "it is ε_low of the ratio's clip range [1 − ε_low, 1 + ε_high] (e.g. 0.2)"
        )
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    if not eps_high > 0.0:
        raise ValueError(
            f"{fn}: `eps_clip_high` must be > 0 or None (= eps_clip), got {eps_clip_high}; "
            "it is ε_high of the ratio's clip range [1 − ε_low, 1 + ε_high] (e.g. 0.28)"
        )
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise ValueError(
            f"{fn}: `eps_clip_c` must be > 1 or None (no dual clip), got {eps_clip_c}; "
            "it bounds the loss of a negative-advantage token at c·|A| (e.g. 3.0)"
        )
    return eps_high


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate of a ratio per token, with dual clip: what `policy_loss` and GSPO's loss share.

    `pg_loss1 = −A · ratio`, `pg_loss2 = −A · clip(ratio, 1 − eps_clip, 1 + eps_clip_high)`,
    loss = `max(pg_loss1, pg_loss2)`, and for `A < 0` with dual clip `min(−A · eps_clip_c, that)`.
    Shapes: `ratio` and `advantages` `(batch, response_len)`. Returns the per-token
    loss and the detached per-token `clip_frac` and `dual_clip_frac` (see `policy_loss`).
    """
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    clipped_loss = torch.maximum(pg_loss1, pg_loss2)
    if eps_clip_c is None:
        loss = clipped_loss
    else:
        pg_loss3 = -advantages * eps_clip_c
        loss = torch.where(advantages < 0, torch.minimum(pg_loss3, clipped_loss), clipped_loss)

    with torch.no_grad():
        clip_frac = (pg_loss2 > pg_loss1).to(loss.dtype)
        if eps_clip_c is None:
            dual_clip_frac = torch.zeros_like(clip_frac)
        else:
            dual_clip_frac = ((advantages < 0) & (pg_loss3 < clipped_loss)).to(loss.dtype)
    return loss, {"clip_frac": clip_frac, "dual_clip_frac": dual_clip_frac}


def value_loss_and_metrics(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped value loss per token, with its clip fraction, for the critic.

    `v_loss_unclipped = (V − R)²`, `v_loss_clipped = (V_old + clip(V − V_old, ±value_clip) − R)²`,
    loss = `0.5 · max(v_loss_unclipped, v_loss_clipped)`.

    The factor 0.5 (as in cleanrl, OpenRLHF and verl; docs/design.md, "PPO math
    conventions") makes the gradient with respect to `V` equal to `V − R`
    where unclipped, so critic learning rates carry over from those codebases.

    Masked positions are 0 when `values`, `old_values` and `returns` are 0
    there; in any case `aggregate_loss` ignores them.

    Args:
        values: the critic's current values (with grad). Shape `(batch, response_len)`.
        old_values: the values the step started from (detached). Same shape.
        returns: GAE returns (detached). Same shape.
        value_clip: > 0: how far `V` may move from `V_old` before the clipped
            term takes over; None disables clipping (loss `0.5 · (V − R)²`).

    Returns:
        `(per_token_loss, metrics)`, each of shape `(batch, response_len)`;
        metrics (detached): `value_clip_frac`, 1 where the clipped term was
        chosen (`v_loss_clipped > v_loss_unclipped`; the token gives no gradient), else 0.
    """
    if value_clip is not None and not value_clip > 0.0:
        raise ValueError(
            f"value_loss: `value_clip` must be > 0 or None (no clipping), got {value_clip} (e.g. 0.2)"
        )
    _check_same_shape(
        "value_loss", "values", {"values": values, "old_values": old_values, "returns": returns}
    )
    v_loss_unclipped = (values - returns).square()
    if value_clip is None:
        loss = 0.5 * v_loss_unclipped
        with torch.no_grad():
            clip_frac = torch.zeros_like(loss)
        return loss, {"value_clip_frac": clip_frac}
    values_clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    v_loss_clipped = (values_clipped - returns).square()
    loss = 0.5 * torch.maximum(v_loss_unclipped, v_loss_clipped)
    with torch.no_grad():
        clip_frac = (v_loss_clipped > v_loss_unclipped).to(loss.dtype)
    return loss, {"value_clip_frac": clip_frac}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_clip: float | None,
) -> torch.Tensor:
    """The clipped value loss per token, for the critic: `value_loss_and_metrics` without the metrics."""
    return value_loss_and_metrics(values, old_values, returns, value_clip)[0]


@torch.no_grad()
def explained_variance(
    values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """How much of the returns' variance the critic's values explain, a diagnostic of the critic.

    `1 − Var[R − V] / Var[R]` over the trainable tokens (of every rank of
    `group`, as in `masked_mean_var`): 1 for a perfect critic, 0 for one that
    predicts the mean, negative for one worse than that; NaN when the returns
    have no variance. Computed under `no_grad`, returned detached.

    Args:
        values: the critic's values. Shape `(batch, response_len)`.
        returns: the GAE returns. Same shape.
        loss_mask: 1 (or True) for trainable tokens. Same shape.
        group: as in `masked_mean_var` (pass the data-parallel group, or rely on
            the default: world when torch.distributed is initialised, local otherwise).

    Returns:
        A float32 scalar tensor.
    """
    _check_same_shape(
        "explained_variance", "values", {"values": values, "returns": returns, "loss_mask": loss_mask}
    )
    _, var_returns, _ = masked_mean_var(returns, loss_mask, group=group, unbiased=False)
    _, var_residual, _ = masked_mean_var(returns - values, loss_mask, group=group, unbiased=False)
    ratio = torch.where(var_returns > 0, var_residual / var_returns, torch.nan)
    return (1.0 - ratio).to(torch.float32)
