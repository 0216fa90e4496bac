"""The reward-model workers of a run, one Ray actor per rollout bundle; what the driver scores with.

`create_reward_model_group` starts one `RewardModelWorker` per bundle of the rollout
slot, beside the rollout engine of that bundle (a fractional GPU share of its own), and
waits until each has loaded its model. `RewardModelGroup.score` splits the samples
across the workers in contiguous chunks and returns the scores in input order; a worker
that dies, fails or does not answer in time is named by rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._options import RewardModelOptions


class RewardModelError(RuntimeError):
    """A reward-model worker died, timed out, or failed; the message names its rank."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"reward model rank {rank}: {message}")
        self.rank = rank


class RewardModelGroup:
    """The reward-model workers in rank order: `wake_up`, `score`, `sleep`, `shutdown`.

    Args:
        handles: Ray actor handles of `RewardModelWorker`s (rank order).
        timeout_s: seconds to wait for each worker's answer.
    """

    def __init__(self, handles: Sequence[Any], *, timeout_s: float) -> None:
        if not handles:
            raise ValueError("RewardModelGroup needs at least one worker handle")
        self.handles: list[Any] = list(handles)
        self.timeout_s = timeout_s

    def __len__(self) -> int:
        return len(self.handles)

    def score(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One score per token sequence, in input order; worker r scores the r-th contiguous chunk."""
        from tandem.ppo.engines import split_contiguous

        calls = []
        for rank, (lo, hi) in enumerate(split_contiguous(len(sequences), len(self.handles))):
            if hi > lo:
                chunk = [list(s) for s in sequences[lo:hi]]
                calls.append((rank, self.handles[rank].score.remote(chunk)))
        return [s for chunk in self._wait(calls, "score") for s in chunk]

    def wake_up(self) -> list[dict[str, float]]:
        """Every worker brings its weights back; each one's lifecycle timings."""
        return self._all("wake_up")

    def sleep(self) -> list[dict[str, float]]:
        """Every worker puts its weights on the host and frees its device memory; their timings."""
        return self._all("sleep")

    def run(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every worker (e.g. "gpu_memory", "memory_stats"); the answers in rank order."""
        return self._all(method, *args)

    def shutdown(self) -> None:
        """Stop every worker (its shutdown hook first, when it answers in time), then kill its actor."""
        import ray

        refs = []
        for h in self.handles:
            try:
                refs.append(h.shutdown.remote())
            except Exception:  # the actor is gone
                continue
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=min(self.timeout_s, 30.0))
        for h in self.handles:
            try:
                ray.kill(h)
            except Exception:  # already dead
                continue

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self._wait([(r, getattr(h, method).remote(*args)) for r, h in enumerate(self.handles)], method)

    def _wait(self, calls: list[tuple[int, Any]], what: str) -> list[Any]:
        """The results of `calls` ((rank, ref) pairs) in order; a `RewardModelError` naming the first failed rank."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        refs = [ref for _, ref in calls]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        ready_ids = set(ready)
        results: list[Any] = []
        late: list[int] = []
        for rank, ref in calls:
            if ref not in ready_ids:
                late.append(rank)
                continue
            try:
                results.append(ray.get(ref, timeout=self.timeout_s))
            except RayActorError as err:
                raise RewardModelError(rank, f"{what} failed: the worker's actor died ({err})") from err
            except RayTaskError as err:
                cause = err.cause if err.cause is not None else err
                raise RewardModelError(rank, f"{what} failed: {cause!r}") from err
            except GetTimeoutError as err:
                raise RewardModelError(rank, f"{what} did not answer within {self.timeout_s:g} s") from err
        if late:
            raise RewardModelError(
                late[0],
                f"{what} did not answer within {self.timeout_s:g} s (RewardModelOptions.request_timeout_s); "
                f"ranks not answering: {late}",
            )
        return results


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

    from ._worker import RewardModelWorker

    options = options or RewardModelOptions()
    if not bundle_indices:
        raise ValueError("create_reward_model_group: bundle_indices is empty; give one bundle per worker")
    remote_cls = ray.remote(RewardModelWorker)
    handles = []
    for bundle in bundle_indices:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle
        )
        handles.append(
            remote_cls.options(
                num_gpus=num_gpus_per_worker, num_cpus=num_cpus_per_worker, scheduling_strategy=strategy
            ).remote(folder, options)
        )
    group = RewardModelGroup(handles, timeout_s=options.startup_timeout_s)
    try:
        group._all("health")
    except BaseException:
        group.shutdown()
        raise
    group.timeout_s = options.request_timeout_s
    return group
