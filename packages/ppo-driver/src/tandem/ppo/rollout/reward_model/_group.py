"""The reward-model workers of a run, one Ray actor per rollout bundle; what the driver scores with.

`create_reward_model_group` starts one `RewardModelWorker` per bundle of the rollout
slot, beside the rollout engine of that bundle (`forward.start_forward_group`).
`RewardModelGroup.score` splits the samples across the workers in contiguous chunks
and returns the scores in input order; a worker that dies, fails or does not answer
in time is named by rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.ppo.rollout.forward import ForwardGroup, start_forward_group

from ._options import RewardModelOptions


class RewardModelError(RuntimeError):
    """A reward-model worker died, timed out, or failed; the message names its rank."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"reward model rank {rank}: {message}")
        self.rank = rank


class RewardModelGroup(ForwardGroup):
    """The reward-model workers in rank order: `wake_up`, `score`, `sleep`, `shutdown`.

    Args:
        handles: Ray actor handles of `RewardModelWorker`s (rank order).
        timeout_s: seconds to wait for each worker's answer.
    """

    TIMEOUT_OPTION = "RewardModelOptions.request_timeout_s"

    def error(self, rank: int, message: str) -> RewardModelError:
        """A `RewardModelError` naming rank `rank`."""
        return RewardModelError(rank, message)

    def score(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One score per token sequence, in input order; worker r scores the r-th contiguous chunk."""
        calls = [
            (rank, self.handles[rank].score.remote([list(s) for s in sequences[lo:hi]]))
            for rank, lo, hi in self.chunks(len(sequences))
        ]
        return [s for chunk in self.wait(calls, "score") for s in chunk]


def create_reward_model_group(
    folder: str,
    placement_group: Any,
    bundle_indices: Sequence[int],
    *,
    num_gpus_per_worker: float,
    num_cpus_per_worker: float = 0.1,
    options: RewardModelOptions | None = None,
) -> RewardModelGroup:
    """Start one reward-model worker per bundle of `placement_group` (rank r on `bundle_indices[r]`).

    `num_gpus_per_worker` is the worker's share of its bundle's GPU (scheduling, not memory).
    Waits until every worker has loaded its model (`options.startup_timeout_s`); a failing
    worker is named by rank and all are killed.
    """
    from ._worker import RewardModelWorker  # torch and transformers: the package itself loads neither

    return start_forward_group(
        RewardModelGroup,
        RewardModelWorker,
        folder,
        placement_group,
        bundle_indices,
        num_gpus_per_worker=num_gpus_per_worker,
        num_cpus_per_worker=num_cpus_per_worker,
        options=options or RewardModelOptions(),
    )
