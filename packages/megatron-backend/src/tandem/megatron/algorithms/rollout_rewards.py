"""The whole rollout's rewards on every data-parallel rank, for the baselines that compare a sample with its group.

GRPO, RLOO and REINFORCE++-baseline (`estimators`) compare each sample with the
other samples of its prompt, but a data-parallel rank holds only its share of the
rollout, and nothing forces a share to hold whole groups. So the ranks pool their
scalar rewards by sample index (`RolloutBatch.sample_indices`, the sample's
position in the rollout): two `all_reduce`s over the data-parallel group (the
rollout's size, then the rewards and a count per sample), a few floats per sample.
Each rank then computes every group's baseline from the same numbers and keeps
its own samples'. Sample `i` belongs to group `i // n_samples_per_prompt`; a group
that only some of its samples reached, or a sample that two ranks hold, is a
ValueError on every rank alike (every rank sees the same pooled counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.megatron.algorithms.estimators import sample_signal, tied_groups
from tandem.megatron.choices import GROUP_ESTIMATORS, AdvantageEstimator

__all__ = ["RolloutRewards", "estimator_rewards", "gather_rollout_rewards", "group_signal"]


@dataclass(frozen=True)
class RolloutRewards:
    """The rollout's scalar rewards by sample index, pooled over the data-parallel group.

    Attributes:
        rewards: float64, shape `(N,)` with `N` = 1 + the largest sample index; 0 where no rank holds a sample.
        present: bool, same shape: whether some rank holds that sample.
    """

    rewards: torch.Tensor
    present: torch.Tensor


def _device() -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


@torch.no_grad()
def gather_rollout_rewards(
    rewards: torch.Tensor, sample_indices: Sequence[int], group: dist.ProcessGroup | None = None
) -> RolloutRewards:
    """Every rank's rewards by sample index, on every rank of `group` (each must call).

    Args:
        rewards: this rank's scalar rewards, shape `(n,)`.
        sample_indices: each of those samples' index in the rollout (`n` distinct ints >= 0).
        group: the data-parallel group (whose ranks hold disjoint shares). None:
            the world group when torch.distributed is initialised, else this rank alone.

    Returns:
        The pooled `RolloutRewards` (on the host).
    """
    indices = [int(i) for i in sample_indices]
    if len(indices) != rewards.numel():
        raise ValueError(
            f"gather_rollout_rewards: {rewards.numel()} rewards but {len(indices)} sample indices"
        )
    if any(i < 0 for i in indices):
        raise ValueError(f"gather_rollout_rewards: sample indices must be >= 0, got {min(indices)}")
    distributed = group is not None or (dist.is_available() and dist.is_initialized())
    device = _device() if distributed else None
    size = torch.tensor([float(max(indices, default=-1) + 1)], dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    n = int(size.item())
    table = torch.zeros(2, n, dtype=torch.float64)
    position = torch.tensor(indices, dtype=torch.long)
    table[0].index_add_(0, position, rewards.detach().double().cpu().reshape(-1))
    table[1].index_add_(0, position, torch.ones(len(indices), dtype=torch.float64))
    if distributed:
        table = table.to(device)
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
        table = table.cpu()
    counts = table[1]
    if bool((counts > 1).any()):
        twice = torch.nonzero(counts > 1).flatten()[:8].tolist()
        raise ValueError(
            f"gather_rollout_rewards: samples {twice} are held by more than one data-parallel rank; each "
            "rank's batch must hold its own samples (pass the data-parallel group, not the world)"
        )
    return RolloutRewards(rewards=table[0], present=counts > 0)


@torch.no_grad()
def group_signal(
    estimator: AdvantageEstimator,
    rollout: RolloutRewards,
    sample_indices: Sequence[int],
    group_size: int,
    *,
    std_normalization: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's samples' `estimators.sample_signal` computed over their whole groups, and the rollout's figures.

    Args:
        estimator: a group estimator (`grpo`, `rloo`, `reinforce_plus_plus_baseline`).
        rollout: what `gather_rollout_rewards` returned.
        sample_indices: this rank's samples, in its batch's order (`n` of them).
        group_size: `n_samples_per_prompt`.
        std_normalization: GRPO's std normalisation (False: Dr.GRPO).

    Returns:
        `(signal, figures)`: float32 `(n,)` in the order of `sample_indices`, and
        `{"tied_groups": the fraction of the rollout's groups whose rewards are all equal}`
        (a float64 scalar, the same on every rank).
    """
    n = rollout.rewards.numel()
    padded = -(-n // group_size) * group_size
    rewards = torch.zeros(padded, dtype=torch.float64)
    present = torch.zeros(padded, dtype=torch.bool)
    rewards[:n], present[:n] = rollout.rewards, rollout.present
    per_group = present.view(-1, group_size).sum(dim=1)
    partial = torch.nonzero((per_group > 0) & (per_group < group_size)).flatten()
    if partial.numel():
        g = int(partial[0])
        raise ValueError(
            f"n_samples_per_prompt: {estimator} compares each sample with the other samples of its prompt, "
            f"but group {g} (samples {g * group_size}..{(g + 1) * group_size - 1}) has only "
            f"{int(per_group[g])} of its {group_size} samples in the rollout; a rollout must hold each "
            "prompt's n_samples_per_prompt samples at consecutive sample indices"
        )
    signal = sample_signal(estimator, rewards, group_size, std_normalization=std_normalization)
    whole = per_group == group_size
    tied = tied_groups(rewards, group_size)[whole]
    figures = {"tied_groups": tied.double().mean() if tied.numel() else torch.zeros((), dtype=torch.float64)}
    own = signal[torch.tensor([int(i) for i in sample_indices], dtype=torch.long)]
    return own.to(torch.float32), figures


@torch.no_grad()
def estimator_rewards(
    estimator: AdvantageEstimator,
    rewards: torch.Tensor,
    sample_indices: Sequence[int],
    *,
    n_samples_per_prompt: int,
    std_normalization: bool = True,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's per-sample rewards as the estimator takes them, and its rollout figures.

    Group estimators (`grpo`, `rloo`, `reinforce_plus_plus_baseline`): `group_signal` over the
    rewards pooled from every rank of `group` (each must call). Others: `rewards` as they are,
    no figures, no communication. Shapes: `rewards` `(n,)`; returns `(n,)` on `rewards`' device.
    """
    if estimator not in GROUP_ESTIMATORS:
        return rewards, {}
    pooled = gather_rollout_rewards(rewards, sample_indices, group)
    signal, figures = group_signal(
        estimator, pooled, sample_indices, n_samples_per_prompt, std_normalization=std_normalization
    )
    return signal.to(rewards.device), figures
