"""Advantage whitening over the trainable tokens of the whole data-parallel group.

Each data-parallel rank holds only its share of the rollout, so per-rank
statistics would whiten each shard differently (and a rank with few tokens
noisily). The mean and variance are therefore taken over the trainable tokens
of all ranks of `group`: one `all_reduce` (SUM) of the sum, the sum of squares
and the count, accumulated in float64 so that `E[x²] − E[x]²` does not lose
the variance to cancellation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["masked_mean_var", "whiten_advantages"]


def _check_mask(name: str, x: torch.Tensor, loss_mask: torch.Tensor) -> None:
    if loss_mask.shape != x.shape:
        raise ValueError(
            f"{name}: `loss_mask` has shape {tuple(loss_mask.shape)} but the data has "
            f"{tuple(x.shape)}; pad both to (batch, response_len)"
        )


def _use_distributed(group: dist.ProcessGroup | None) -> bool:
    return group is not None or (dist.is_available() and dist.is_initialized())


@torch.no_grad()
def masked_mean_var(
    x: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    unbiased: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, variance and count of `x` over the trainable tokens of every rank of `group`.

    Statistics for whitening and for diagnostics such as explained variance;
    computed under `no_grad`, in float64.

    Args:
        x: the data. Shape `(batch, response_len)` (any shape works).
        loss_mask: 1 (or True) where `x` counts. Same shape as `x`. Masked entries may hold anything finite or not.
        group: the process group whose ranks' tokens are pooled. When None and
            torch.distributed is initialised, the default (world) group; when None
            and it is not, this rank's tokens only. Every rank of the group must call.
        unbiased: divide the sum of squared deviations by `count − 1` (Bessel's
            correction) instead of `count`.

    Returns:
        `(mean, var, count)`, float64 scalars on `x`'s device. With no trainable
        token anywhere, mean and var are 0; with one, var is 0.
    """
    _check_mask("masked_mean_var", x, loss_mask)
    mask = loss_mask.detach().to(x.device) != 0
    values = torch.where(mask, x.detach().double(), 0.0)
    stats = torch.stack([values.sum(), values.square().sum(), mask.sum().double()])
    if _use_distributed(group):
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    total, total_sq, count = stats.unbind()
    mean = total / count.clamp(min=1.0)
    squared_deviation = (total_sq - total * mean).clamp(min=0.0)
    dof = count - 1.0 if unbiased else count
    var = squared_deviation / dof.clamp(min=1.0)
    return mean, var, count


@torch.no_grad()
def whiten_advantages(
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    eps: float = 1e-8,
    *,
    shift_mean: bool = True,
) -> torch.Tensor:
    """Normalise advantages to mean 0 and variance 1 over the trainable tokens of the data-parallel group.

    `(A − mean) / sqrt(var + eps)`, with the (unbiased) mean and variance of
    `masked_mean_var` over every rank of `group`. Runs under `no_grad`:
    advantages are targets.

    Args:
        advantages: from `compute_gae`. Shape `(batch, response_len)`.
        loss_mask: 1 (or True) for trainable tokens. Same shape.
        group: the data-parallel process group; every rank of it must call. When
            None and torch.distributed is initialised, the world group is used;
            under Megatron pass `parallel_state.get_data_parallel_group()`, since
            the world also holds the TP/PP replicas of each shard (the mean is the
            same with them, the unbiased variance very slightly not). When None and
            torch.distributed is not initialised: this rank's tokens only.
        eps: > 0, added to the variance before the square root, so a constant batch gives 0, not NaN.
        shift_mean: subtract the mean (the usual whitening). When False, only the
            scale is normalised and the mean is kept: `(A − mean) / std + mean`
            (the `shift_mean` of TRL / OpenRLHF), so the sign balance of the
            advantages is left as GAE produced it.

    Returns:
        Whitened advantages in `advantages`' dtype, shape `(batch, response_len)`, 0 at masked positions.
    """
    if not eps > 0:
        raise ValueError(f"whiten_advantages: `eps` must be > 0 (e.g. 1e-8), got {eps}")
    mean, var, _ = masked_mean_var(advantages, loss_mask, group=group, unbiased=True)
    whitened = (advantages.detach().double() - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    mask = loss_mask.detach().to(advantages.device) != 0
    return torch.where(mask, whitened, 0.0).to(advantages.dtype)
