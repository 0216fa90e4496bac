"""Advantage whitening over the trainable tokens of the whole data-parallel group.

Each data-parallel rank holds only its share of the rollout, so per-rank
statistics would whiten each shard differently (and a rank with few tokens
noisily). The mean and variance are therefore taken over the trainable tokens
of all ranks of `group`: each rank reduces its own tokens to `(count, mean, M2)`
(M2 the sum of squared deviations from its own mean, two passes in float64), one
`all_gather` brings every rank's triple to every rank, and each merges them in rank
order with Chan, Golub & LeVeque's pairwise update ("Updating Formulae and a Pairwise
Algorithm for Computing Sample Variances", 1979; `merge_moments`). No step subtracts
two large numbers to get a small one: the one-pass `E[x²] − E[x]²` it replaces lost
about 1 % of the variance at |mean| / std = 1e7 and all of it at 1e8, even in float64.

Against the peers (docs/design.md, "Defaults, against the peers"): verl's
`masked_whiten` (`verl/utils/torch_functional.py` at b178a3c) divides by the unbiased
variance + 1e-8 inside the square root, as here; OpenRLHF (`experience_maker.py`
`compute_advantages_and_returns` at 3c3be62) by the biased variance clamped to at
least 1e-8. The two differ by a factor `sqrt(n / (n − 1))` over n trainable tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["masked_mean_var", "merge_moments", "whiten_advantages"]


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
    # `where`, not indexing: no host wait for the count, and nothing of a masked entry leaks.
    values = torch.where(mask, x.detach().double(), 0.0)
    count = mask.sum().double()
    mean = values.sum() / count.clamp(min=1.0)
    m2 = torch.where(mask, values - mean, 0.0).square().sum()
    moments = torch.stack([count, mean, m2])
    if _use_distributed(group):
        gathered = [torch.empty_like(moments) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, moments, group=group)
        moments = torch.stack(gathered)
    count, mean, m2 = merge_moments(moments.view(-1, 3))
    dof = count - 1.0 if unbiased else count
    var = m2 / dof.clamp(min=1.0)
    return mean, var, count


def merge_moments(moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge parts' `(count, mean, M2)` into the whole's, in order (Chan, Golub & LeVeque 1979).

    Two parts `a`, `b` give `n = n_a + n_b`, `mean = mean_a + δ · n_b / n` and
    `M2 = M2_a + M2_b + δ² · n_a · n_b / n` with `δ = mean_b − mean_a`: only
    differences of means, never of large sums, so the result keeps the precision
    of the parts' own two-pass figures whatever the mean is against the spread.
    Parts with count 0 change nothing.

    Args:
        moments: one row `(count, mean, M2)` per part. Shape `(parts, 3)`, float64.

    Returns:
        `(count, mean, M2)` of the union, float64 scalars; `(0, 0, 0)` when every part is empty.
    """
    count, mean, m2 = moments[0].unbind()
    for part_count, part_mean, part_m2 in moments[1:]:
        total = count + part_count
        share = part_count / total.clamp(min=1.0)
        delta = part_mean - mean
        mean = mean + delta * share
        m2 = m2 + part_m2 + delta.square() * count * share
        count = total
    return count, mean, m2


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
            (the `shift_mean` of TRL's and verl's `masked_whiten`; OpenRLHF at 3c3be62
            has no such option: its `--algo.advantage.no_std_norm` is the other half,
            the mean taken out and the scale kept), so the sign balance of the
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
