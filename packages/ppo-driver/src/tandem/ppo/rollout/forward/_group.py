"""A forward-only role's workers, one Ray actor per rollout bundle: starting them, and the calls they share.

`start_forward_group` starts one worker per bundle of the rollout slot, beside the
rollout engine of that bundle (a fractional GPU share of its own), and waits until
each has loaded its model; a failing worker is named by rank and all are killed.
`ForwardGroup` wakes them, puts them to sleep and spreads a batch of samples over
them in contiguous chunks (`chunks`), each subclass adding its own forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from tandem.megatron.group.actors import ActorGroup, split_contiguous

from ._options import ForwardOptions

if TYPE_CHECKING:
    from ray.actor import ActorHandle


class EventRecorder(Protocol):
    """Where a role's steps are recorded: the run's `EventLog`."""

    def record(self, event: str, **fields: Any) -> None: ...


class ForwardGroup(ActorGroup):
    """The workers of a forward-only role in rank order: `wake_up`, `sleep`, `run`, `shutdown`.

    Args:
        handles: Ray actor handles of the role's workers (rank order).
        timeout_s: seconds to wait for each worker's answer.
    """

    KIND = "worker"

    def wake_up(self) -> list[dict[str, float]]:
        """Every worker brings its weights back; each one's lifecycle timings."""
        return self.all("wake_up")

    def sleep(self) -> list[dict[str, float]]:
        """Every worker puts its weights on the host and frees its device memory; their timings."""
        return self.all("sleep")

    def run(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every worker (e.g. "gpu_memory", "memory_stats"); the answers in rank order."""
        return self.all(method, *args)

    def chunks(self, n: int) -> list[tuple[int, int, int]]:
        """`(rank, lo, hi)` for each worker given samples `lo:hi` of `n` (contiguous, in rank order; none empty)."""
        return [
            (rank, lo, hi) for rank, (lo, hi) in enumerate(split_contiguous(n, len(self.handles))) if hi > lo
        ]


def start_forward_group[G: ForwardGroup](
    group_class: type[G],
    worker_class: type,
    folder: str,
    placement_group: Any,
    bundle_indices: Sequence[int],
    *,
    num_gpus_per_worker: float,
    num_cpus_per_worker: float,
    options: ForwardOptions,
) -> G:
    """Start one `worker_class(folder, options)` per bundle of `placement_group` (rank r on `bundle_indices[r]`).

    `num_gpus_per_worker` is the worker's share of its bundle's GPU (scheduling, not memory).
    Waits until every worker has loaded its model (`options.startup_timeout_s`); a failing
    worker is named by rank and all are killed.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not bundle_indices:
        raise ValueError(f"{group_class.__name__}: bundle_indices is empty; give one bundle per worker")
    remote_cls: Any = ray.remote(worker_class)
    handles: list[ActorHandle] = []
    for bundle in bundle_indices:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle
        )
        handle = remote_cls.options(
            num_gpus=num_gpus_per_worker, num_cpus=num_cpus_per_worker, scheduling_strategy=strategy
        ).remote(folder, options)
        handles.append(cast("ActorHandle", handle))  # Ray types an actor's start as handle | class
    group = group_class(handles, timeout_s=options.startup_timeout_s)
    try:
        group.all("health")
    except BaseException:
        group.shutdown()
        raise
    group.timeout_s = options.request_timeout_s
    return group
