"""Ray actors of one kind, one per rank: a generic host for a worker class, and a group that calls them.

`ActorHost` is the Ray actor of a worker whose class the driver's process must not
import (the train worker's module imports Megatron, 30 s on a small CPU machine):
it builds `module:Class` in its own process, and `call(method, ...)` runs any public
method of it, so that nothing forwards the worker's methods one by one.

`ActorGroup` calls the actors of a group (the rollout engines, the reward-model
workers) by rank and waits at most `timeout_s` for each answer. An actor that
failed or did not answer in time is an error naming its rank, of the group's own
kind (`error`); one whose process died is reported apart (`gather`), so that a
group that can start it again (the engines') does. `shutdown` stops them all.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.exceptions import RayActorError

__all__ = ["ActorGroup", "ActorHost", "Calls", "split_contiguous"]

type Calls = Sequence[tuple[int, ObjectRef[Any]]]
"""(rank, the pending answer of that rank's actor) pairs, in the order the results are wanted."""


def split_contiguous(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous `(lo, hi)` slices of `range(n)`, sizes differing by at most one, larger first."""
    base, extra = divmod(n, parts)
    slices, lo = [], 0
    for r in range(parts):
        hi = lo + base + (1 if r < extra else 0)
        slices.append((lo, hi))
        lo = hi
    return slices


class ActorHost:
    """The Ray actor of one worker: builds `target` (`"package.module:Class"`) with `args` in its own process.

    `call(method, *args, **kwargs)` runs one of the worker's public methods and returns its
    result; the driver's process never imports the worker's module.
    """

    def __init__(self, target: str, *args: Any, **kwargs: Any) -> None:
        module, _, name = target.partition(":")
        self._worker = getattr(importlib.import_module(module), name)(*args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The worker's `method(*args, **kwargs)`; AttributeError for a private or missing method."""
        if method.startswith("_"):
            raise AttributeError(f"{method!r}: only a worker's public methods are called through its host")
        return getattr(self._worker, method)(*args, **kwargs)


class ActorGroup:
    """The actors of a group in rank order, each call waited for at most `timeout_s`, failures named by rank.

    A subclass says what its errors are (`error`, and `died` for an actor whose process is
    gone) and which option sets `timeout_s` (`TIMEOUT_OPTION`, named when actors do not answer).

    Args:
        handles: the Ray actor handles, rank `r` at index `r`.
        timeout_s: seconds to wait for each actor's answer.
    """

    TIMEOUT_OPTION: ClassVar[str] = "timeout_s"
    KIND: ClassVar[str] = "actor"
    """What the group's actors are, in messages (`EngineGroup needs at least one engine handle`)."""

    def __init__(self, handles: Sequence[ActorHandle], *, timeout_s: float) -> None:
        if not handles:
            raise ValueError(f"{type(self).__name__} needs at least one {self.KIND} handle")
        self.handles: list[ActorHandle] = list(handles)
        self.timeout_s = timeout_s

    def __len__(self) -> int:
        return len(self.handles)

    # --- what a subclass says -------------------------------------------------------------------
    def error(self, rank: int, message: str) -> Exception:
        """The group's error for rank `rank`."""
        return RuntimeError(f"{self.KIND} rank {rank}: {message}")

    def died(self, rank: int, what: str, err: RayActorError) -> Exception:
        """The group's error for rank `rank`, whose actor died during `what`."""
        return self.error(rank, f"{what} failed: the {self.KIND}'s actor died ({err})")

    # --- calls ---------------------------------------------------------------------------------
    def calls(self, method: str, *args: Any) -> list[tuple[int, ObjectRef[Any]]]:
        """`method(*args)` started on every actor: (rank, pending answer) in rank order."""
        return [(rank, getattr(h, method).remote(*args)) for rank, h in enumerate(self.handles)]

    def all(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every actor; the answers in rank order (`wait`)."""
        return self.wait(self.calls(method, *args), method)

    def wait(self, calls: Calls, what: str) -> list[Any]:
        """The results of `calls` in their order; the group's error naming the first rank that failed or died."""
        done, died = self.gather(calls, what)
        if died:
            raise next(iter(died.values()))
        return [done[rank] for rank, _ in calls]

    def gather(self, calls: Calls, what: str) -> tuple[dict[int, Any], dict[int, Exception]]:
        """The results of `calls` by rank, and the errors (`died`) of the ranks whose actor died.

        Any other failure (an error inside the actor, no answer in time) raises the group's
        error naming the first such rank.
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        refs = [ref for _, ref in calls]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        ready_ids = set(ready)
        # An error from a finished actor says more than a timeout of another: report those first.
        done: dict[int, Any] = {}
        died: dict[int, Exception] = {}
        late: list[int] = []
        for rank, ref in calls:
            if ref not in ready_ids:
                late.append(rank)
                continue
            try:
                done[rank] = ray.get(ref, timeout=self.timeout_s)
            except RayActorError as err:
                died[rank] = self.died(rank, what, err)
                died[rank].__cause__ = err
            except RayTaskError as err:
                cause = err.cause if err.cause is not None else err
                raise self.error(rank, f"{what} failed: {cause!r}") from err
            except GetTimeoutError as err:
                raise self.error(rank, f"{what} did not answer within {self.timeout_s:g} s") from err
        if late:
            raise self.error(
                late[0],
                f"{what} did not answer within {self.timeout_s:g} s ({self.TIMEOUT_OPTION}); "
                f"ranks not answering: {late}",
            )
        return done, died

    def shutdown(self) -> None:
        """Stop every actor (its shutdown hook first, when it answers in time), then kill it."""
        import ray

        refs: list[ObjectRef[Any]] = []
        for h in self.handles:
            try:
                refs.append(h.shutdown.remote())
            except Exception:  # the handle's class has no shutdown, or the actor is gone
                continue
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=min(self.timeout_s, 30.0))
        for h in self.handles:
            try:
                ray.kill(h)
            except Exception:  # already dead
                continue
