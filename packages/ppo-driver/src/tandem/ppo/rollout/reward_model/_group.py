"""The reward-model workers of a run, one Ray actor per rollout bundle; what the driver scores with.

`create_reward_model_group` starts one `RewardModelWorker` per bundle of the rollout
slot, beside the rollout engine of that bundle (a fractional GPU share of its own), and
waits until each has loaded its model. `RewardModelGroup.score` splits the samples
across the workers in contiguous chunks and returns the scores in input order; a worker
that dies, fails or does not answer in time is named by rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

from tandem.megatron.group.actors import ActorGroup, split_contiguous

from ._options import RewardModelOptions

if TYPE_CHECKING:
    from ray.actor import ActorHandle


class RewardModelError(RuntimeError):
    """A reward-model worker died, timed out, or failed; the message names its rank."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"reward model rank {rank}: {message}")
        self.rank = rank


class RewardModelGroup(ActorGroup):
    """The reward-model workers in rank order: `wake_up`, `score`, `sleep`, `shutdown`.

    Args:
        handles: Ray actor handles of `RewardModelWorker`s (rank order).
        timeout_s: seconds to wait for each worker's answer.
    """

    TIMEOUT_OPTION = "RewardModelOptions.request_timeout_s"
    KIND: ClassVar[str] = "worker"

    def error(self, rank: int, message: str) -> RewardModelError:
        """A `RewardModelError` naming rank `rank`."""
        return RewardModelError(rank, message)

    def score(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One score per token sequence, in input order; worker r scores the r-th contiguous chunk."""
        calls = []
        for rank, (lo, hi) in enumerate(split_contiguous(len(sequences), len(self.handles))):
            if hi > lo:
                chunk = [list(s) for s in sequences[lo:hi]]
                calls.append((rank, self.handles[rank].score.remote(chunk)))
        return [s for chunk in self.wait(calls, "score") for s in chunk]

    def wake_up(self) -> list[dict[str, float]]:
        """Every worker brings its weights back; each one's lifecycle timings."""
        return self.all("wake_up")

    def sleep(self) -> list[dict[str, float]]:
        """Every worker puts its weights on the host and frees its device memory; their timings."""
        return self.all("sleep")

    def run(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every worker (e.g. "gpu_memory", "memory_stats"); the answers in rank order."""
        return self.all(method, *args)


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
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ._worker import RewardModelWorker  # torch and transformers: the package itself loads neither

    options = options or RewardModelOptions()
    if not bundle_indices:
        raise ValueError("create_reward_model_group: bundle_indices is empty; give one bundle per worker")
    remote_cls = ray.remote(RewardModelWorker)
    handles: list[ActorHandle] = []
    for bundle in bundle_indices:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle
        )
        handle = remote_cls.options(
            num_gpus=num_gpus_per_worker, num_cpus=num_cpus_per_worker, scheduling_strategy=strategy
        ).remote(folder, options)
        handles.append(cast("ActorHandle", handle))  # Ray types an actor's start as handle | class
    group = RewardModelGroup(handles, timeout_s=options.startup_timeout_s)
    try:
        group.all("health")
    except BaseException:
        group.shutdown()
        raise
    group.timeout_s = options.request_timeout_s
    return group
