"""Process groups whose communicators are torn down while a model sleeps and built again when it wakes.

A `ReloadableProcessGroup` is a `torch.distributed.ProcessGroup` that stands in for
a real one (the *inner* group) and forwards every call to it. `destroy_all()`
destroys the inner groups (on GPU this frees the NCCL communicators and their
buffers); `reload_all()` creates them again with the same `new_group` arguments,
so code that holds the wrapper (Megatron's parallel state, modules that cached a
group) keeps working after a wake.

The wrapper takes the inner group's place in torch.distributed's own tables
(ranks, backend, name), so `dist.get_rank(group)`, `dist.all_reduce(t, group=group)`
and the other functions accept it as they are, without patching them.

`new_group` is collective: every rank creates groups in the same order, members
or not. The registry therefore records every `new_group` call it wraps on this
rank, including those this rank is not a member of, and `reload_all()` replays
them in the original order on every rank.

Tearing a communicator down is mostly waiting (NCCL finalises, the group's
watchdog thread winds down), so `destroy_all()` shuts the inner groups down on
one thread per group, then unregisters them from torch.distributed's tables in
order on the calling thread; `concurrent=False` does it one group at a time.
`keep_single_rank=True` leaves groups of one rank alive: faster, but their
communicators keep their device memory while the model sleeps
(bench/process_group_bench.py measures all three).

Groups of one rank need no communicator at all: a reduction over one rank is
that rank's tensor, a gather of one is a copy. With `local_single_rank=True`
(the default of `reloadable_new_group` and `reloadable_groups`) their
collectives are answered in the process (`_one_rank.py`), so NCCL,
which builds a communicator on a group's first collective, never builds one
for them: nothing to hold (about 95 MiB a group on an H200; a Megatron worker
alone on its GPU has some 20 such groups), nothing to tear down at a sleep and
nothing to build at a wake. Everything else (ranks, names, the backend's name)
still comes from the real group `new_group` made.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ._one_rank import COLLECTIVES as _ONE_RANK_COLLECTIVES
from ._one_rank import OneRankCollectives

logger = logging.getLogger(__name__)

# torch.distributed's tables keyed by process group (those missing in a torch version are skipped).
_TABLES = (
    "pg_map",
    "pg_names",
    "pg_group_ranks",
    "pg_backend_config",
    "pg_to_tag",
    "pg_flight_recorder_hooks",
)
# Names the wrapper answers itself; everything else goes to the inner group.
_OWN = frozenset(
    {
        "_rpg_inner",
        "_rpg_local",
        "_rpg_name",
        "_rpg_desc",
        "_attach",
        "_teardown",
        "alive",
        "inner",
        "local",
        "rank",
        "size",
        "shutdown",
        "abort",
    }
)
# Names that still answer while the inner group is torn down (torch needs them to unregister).
_KEPT_WHILE_DOWN = {"group_name": "_rpg_name", "group_desc": "_rpg_desc"}


class ProcessGroupTornDownError(RuntimeError):
    """A collective (or a backend query) on a reloadable group whose communicator is torn down."""


def _take_entries(pg: object) -> dict[str, Any]:
    """Remove `pg` from torch.distributed's tables and return what was there."""
    world = c10d._world
    taken: dict[str, Any] = {}
    for name in _TABLES:
        table = getattr(world, name, None)
        if isinstance(table, dict) and pg in table:
            taken[name] = table.pop(pg)
    tags = []
    for tag, pgs in world.tags_to_pg.items():
        if any(p is pg for p in pgs):
            pgs[:] = [p for p in pgs if p is not pg]
            tags.append(tag)
    taken["tags_to_pg"] = tags
    return taken


def _put_entries(pg: dist.ProcessGroup, entries: dict[str, Any]) -> None:
    world = c10d._world
    for name, value in entries.items():
        if name == "tags_to_pg":
            for tag in value:
                world.tags_to_pg.setdefault(tag, []).append(pg)
        else:
            getattr(world, name)[pg] = value


class ReloadableProcessGroup(dist.ProcessGroup):
    """A process group whose communicator can be torn down and built again with the same ranks.

    Made by `reloadable_new_group` (or by `dist.new_group` inside `reloadable_groups()`).
    While torn down, rank and size queries still answer; collectives raise
    `ProcessGroupTornDownError`. `local=True` (one rank only): collectives are
    answered in this process (`_one_rank.py`), so the inner group never
    builds a communicator.
    """

    _rpg_inner: dist.ProcessGroup | None
    _rpg_local: OneRankCollectives | None
    _rpg_name: str
    _rpg_desc: str

    def __init__(self, inner: dist.ProcessGroup, *, local: bool = False) -> None:
        # torch's stub lists only the (store, rank, size) overload; (rank, size) exists at runtime too.
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]
        if local and inner.size() != 1:
            raise ValueError(
                f"ReloadableProcessGroup: local=True needs a group of one rank, not {inner.size()}"
            )
        object.__setattr__(self, "_rpg_inner", None)
        object.__setattr__(self, "_rpg_local", OneRankCollectives(lambda: self.inner) if local else None)
        self._attach(inner)

    def __getattribute__(self, name: str) -> Any:
        if name in _OWN or name.startswith("__"):
            return object.__getattribute__(self, name)
        local = object.__getattribute__(self, "_rpg_local")
        if local is not None and name in _ONE_RANK_COLLECTIVES:
            return getattr(local, name)
        inner = object.__getattribute__(self, "_rpg_inner")
        if inner is not None:
            return getattr(inner, name)
        if name in _KEPT_WHILE_DOWN:
            return object.__getattribute__(self, _KEPT_WHILE_DOWN[name])
        if name == "_device_types":
            return []  # no backend, no device: what torch's destroy_process_group asks of a dead group
        raise ProcessGroupTornDownError(
            f"process group {object.__getattribute__(self, '_rpg_name')!r} is torn down (its model is "
            f"asleep) and cannot answer {name!r}; call reload_all() (Lifecycle.wake_up) first"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def __repr__(self) -> str:
        state = ("alive" if self.alive else "torn down") + (", local" if self.local else "")
        return f"ReloadableProcessGroup(name={self._rpg_name!r}, rank={self.rank()}, size={self.size()}, {state})"

    @property
    def local(self) -> bool:
        """Whether collectives are answered in this process (a group of one rank, no communicator)."""
        return self._rpg_local is not None

    @property
    def alive(self) -> bool:
        """Whether the inner group (the communicator) exists right now."""
        return self._rpg_inner is not None

    @property
    def inner(self) -> dist.ProcessGroup:
        """The live inner group; raises `ProcessGroupTornDownError` while torn down."""
        inner = self._rpg_inner
        if inner is None:
            raise ProcessGroupTornDownError(
                f"process group {self._rpg_name!r} is torn down; call reload_all()"
            )
        return inner

    def rank(self) -> int:
        """This process's rank in the group (kept while torn down)."""
        return int(dist.ProcessGroup.rank(self))

    def size(self) -> int:
        """The number of ranks in the group (kept while torn down)."""
        return int(dist.ProcessGroup.size(self))

    def shutdown(self) -> None:
        """Called by `dist.destroy_process_group`: tear the inner group down (a later reload_all revives it)."""
        self._teardown()

    def abort(self) -> None:
        """Abort the inner group's communicator and drop it."""
        inner = self._rpg_inner
        if inner is not None:
            object.__setattr__(self, "_rpg_inner", None)
            inner.abort()

    def _attach(self, inner: dist.ProcessGroup) -> None:
        """Make `inner` the live group: it leaves torch.distributed's tables and the wrapper takes its place."""
        if (inner.rank(), inner.size()) != (self.rank(), self.size()):
            raise RuntimeError(
                f"reloaded group has rank/size {(inner.rank(), inner.size())}, expected {(self.rank(), self.size())}"
            )
        entries = _take_entries(inner)
        _take_entries(self)
        _put_entries(self, entries)
        object.__setattr__(self, "_rpg_inner", inner)
        object.__setattr__(self, "_rpg_name", inner.group_name)
        object.__setattr__(self, "_rpg_desc", inner.group_desc)

    def _teardown(self) -> None:
        """Destroy the inner group through torch.distributed; the wrapper stays in its tables."""
        inner = self._rpg_inner
        if inner is None:
            return
        entries = _take_entries(self)
        _put_entries(inner, entries)
        try:
            dist.destroy_process_group(inner)
        finally:
            _take_entries(inner)  # whatever a failed destroy left behind
            _put_entries(self, entries)
            object.__setattr__(self, "_rpg_inner", None)


@dataclass
class _Call:
    """One recorded `new_group` call on this rank."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    group: ReloadableProcessGroup | None  # None: this rank is not a member
    local: bool = False  # one rank, collectives in the process: never torn down
    member_alive: bool = True

    @property
    def alive(self) -> bool:
        return self.member_alive if self.group is None else self.group.alive

    @property
    def single_rank(self) -> bool:
        """The group has one rank (known on every rank from the call's arguments)."""
        ranks = self.kwargs.get("ranks", self.args[0] if self.args else None)
        return ranks is not None and len(ranks) == 1


@dataclass
class _Registry:
    calls: list[_Call] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock)
    patch_depth: int = 0


_registry = _Registry()


def reloadable_new_group(*args: Any, local_single_rank: bool = True, **kwargs: Any) -> Any:
    """`torch.distributed.new_group` with the same arguments, returning a `ReloadableProcessGroup`.

    Returns `GroupMember.NON_GROUP_MEMBER` on ranks outside the group, as
    `new_group` does; the call is recorded there too, so that `reload_all()`
    repeats the same collective calls on every rank. `local_single_rank`: a
    group of one rank answers its collectives in the process and is never torn
    down (it has no communicator); False gives it a communicator like any other.
    """
    with _registry.lock:
        inner = c10d.new_group(*args, **kwargs)
        call = _Call(args, dict(kwargs), None)
        call.local = local_single_rank and call.single_rank  # alike on every rank, from the arguments
        if not isinstance(inner, dist.ProcessGroup):  # GroupMember.NON_GROUP_MEMBER
            _registry.calls.append(call)
            return inner
        call.group = ReloadableProcessGroup(inner, local=call.local)
        _registry.calls.append(call)
        return call.group


def _explicit_backend(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
    return None if backend is None else str(backend).lower()


@contextlib.contextmanager
def reloadable_groups(
    *, skip_backends: Collection[str] = ("gloo",), local_single_rank: bool = True
) -> Iterator[None]:
    """Make the groups that `torch.distributed.new_group` creates inside this block reloadable.

    Wrap Megatron's `parallel_state.initialize_model_parallel(...)` in it. Groups
    created with an explicit backend in `skip_backends` stay plain: Megatron asks
    for gloo groups explicitly for CPU-side work, and they hold no GPU memory.
    Groups on the default backend (gloo on CPU, NCCL on GPU) are wrapped;
    `local_single_rank` as in `reloadable_new_group`.
    """
    skip = {b.lower() for b in skip_backends}
    plain_new_group = c10d.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        if _explicit_backend(args, kwargs) in skip:
            return plain_new_group(*args, **kwargs)
        return reloadable_new_group(*args, local_single_rank=local_single_rank, **kwargs)

    with _registry.lock:
        previous = dist.new_group
        dist.new_group = new_group
        _registry.patch_depth += 1
    try:
        yield
    finally:
        with _registry.lock:
            dist.new_group = previous
            _registry.patch_depth -= 1


_TEARDOWN_THREADS = 64


def _shut_down_concurrently(groups: list[ReloadableProcessGroup]) -> None:
    """Shut the groups' inner groups down on one thread each (the slow, waiting part).

    torch releases the GIL in `ProcessGroup.shutdown`, so the waits overlap; a
    second `shutdown` (from `destroy_process_group` afterwards) finds nothing left to do.
    """
    inners = [g._rpg_inner for g in groups if g._rpg_inner is not None]
    if len(inners) < 2:
        return
    with ThreadPoolExecutor(min(_TEARDOWN_THREADS, len(inners)), thread_name_prefix="pg-teardown") as pool:
        for future in [pool.submit(inner.shutdown) for inner in inners]:
            future.result()


def destroy_all(*, concurrent: bool = True, keep_single_rank: bool = False) -> None:
    """Tear down every reloadable group of this process, newest first (idempotent).

    Every rank must call it (NCCL tears communicators down collectively in some
    versions). `concurrent`: shut the communicators down on several threads at
    once before unregistering each group (False: one group after the other).
    `keep_single_rank`: leave groups of one rank alive (every rank decides alike,
    from the recorded `ranks`, so `reload_all` replays the same calls everywhere):
    tearing a one-rank communicator down and building it again costs as much as
    any other, but a live one keeps its device memory (about 0.25 GiB a
    Megatron worker at DP 2 on two H200s), hence off by default. Local groups
    (`local_single_rank`) have no communicator and always stay.
    """
    with _registry.lock:
        calls = [
            c
            for c in reversed(_registry.calls)
            if c.alive and not c.local and not (keep_single_rank and c.single_rank)
        ]
        members = [c.group for c in calls if c.group is not None]
        if concurrent:
            _shut_down_concurrently(members)
        for call in calls:
            if call.group is None:
                call.member_alive = False
            else:
                call.group._teardown()
        if calls:
            logger.info("tore down %d reloadable process groups", len(calls))


def reload_all() -> None:
    """Create again, in their original order, the reloadable groups that are torn down (idempotent).

    Every rank must call it, as with `new_group`.
    """
    with _registry.lock:
        calls = [c for c in _registry.calls if not c.alive]
        if not calls:
            return
        if not dist.is_initialized():
            raise RuntimeError(
                "reload_all: torch.distributed is not initialised (the default group was destroyed); "
                "call forget_all() after tearing the whole job down"
            )
        for call in calls:
            inner = c10d.new_group(*call.args, **call.kwargs)
            if call.group is None:
                call.member_alive = True
            elif isinstance(inner, dist.ProcessGroup):
                call.group._attach(inner)
            else:
                raise RuntimeError(f"reload_all: new_group{call.args} no longer includes this rank")
        logger.info("reloaded %d reloadable process groups", len(calls))


def forget_all() -> None:
    """Drop the record of every reloadable group without touching them (after the job's teardown)."""
    with _registry.lock:
        _registry.calls.clear()


def reloadable_process_groups() -> tuple[ReloadableProcessGroup, ...]:
    """The reloadable groups this rank is a member of, in creation order."""
    with _registry.lock:
        return tuple(c.group for c in _registry.calls if c.group is not None)
