"""The sleep/wake state machine of one model: idempotent, in a fixed order, truthful after failures."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from ._backend import MemoryBackend

logger = logging.getLogger(__name__)

Hook = Callable[[], None]


def _nothing() -> None:
    return None


class Lifecycle:
    """Puts one model's GPU memory away (`sleep`) and brings it back (`wake_up`), safely under retries.

    Sleep: clear caches → destroy process groups → pause memory. Wake: resume
    memory → clear caches → reload process groups. `sleep()` when asleep logs
    and returns; `wake_up()` when awake only reloads the process groups (a
    retried step may have died between a wake and a sleep, or after a failed
    sleep destroyed them). So the backend never sees `pause` twice or `resume`
    twice in a row for a tag.

    `asleep` tells the truth after a failure in any step: it follows the memory,
    and a backend's `pause`/`resume` either completes or leaves the memory as it
    was. With several `tags` each is paused on its own, and a sleep that failed
    half-way is finished by the next `sleep()` (or undone by `wake_up()`);
    `asleep` is True while any tag is paused. `sleep(tags)` / `wake_up(tags)` move
    only some tags (e.g. the weights back for a weight export while asleep).

    What a worker does around the memory (clear caches, destroy and reload
    process groups) is handed in as hooks; each defaults to doing nothing.
    `last_timings` says how long each step of the last `sleep` / `wake_up` took.

    Args:
        backend: the memory backend.
        tags: the tags to pause and resume, in order; None pauses and resumes
            every tag at once (`pause(None)`).
        clear_caches: e.g. `clear_torch_caches` (gc, then empty the CUDA cache).
        clear_caches_on_wake: the wake's clear step; None: `clear_caches`. A wake frees
            nothing on the device, so `clear_torch_caches(device=False)` (garbage only)
            does, and lets a backend's background resume run on (`PinnedHostBackend`'s
            `resume_in_background`), where a device synchronisation would wait for it.
        destroy_process_groups: e.g. `destroy_all` of the reloadable process groups.
        reload_process_groups: e.g. `reload_all`.
    """

    def __init__(
        self,
        backend: MemoryBackend,
        *,
        tags: Sequence[str] | None = None,
        clear_caches: Hook | None = None,
        clear_caches_on_wake: Hook | None = None,
        destroy_process_groups: Hook | None = None,
        reload_process_groups: Hook | None = None,
    ) -> None:
        if tags is not None:
            if isinstance(tags, str) or not list(tags):
                raise ValueError(f"tags={tags!r}: give a non-empty list of tag names, or None for all tags")
            tags = list(tags)
            if any(not isinstance(t, str) or not t for t in tags) or len(set(tags)) != len(tags):
                raise ValueError(f"tags={tags!r}: tag names must be distinct non-empty strings")
        self._backend = backend
        self._tags: list[str | None] = [None] if tags is None else list(tags)
        self._paused: set[str | None] = set()
        self._clear_caches = clear_caches or _nothing
        self._clear_caches_on_wake = clear_caches_on_wake or self._clear_caches
        self._destroy_process_groups = destroy_process_groups or _nothing
        self._reload_process_groups = reload_process_groups or _nothing
        self._lock = threading.RLock()
        self._timings: dict[str, float] = {}

    @property
    def last_timings(self) -> dict[str, float]:
        """Seconds each step of the last `sleep` / `wake_up` call took, in the order they ran.

        Keys: "clear_caches", "destroy_process_groups", "reload_process_groups",
        and "pause:<tag>" / "resume:<tag>" per tag ("pause" / "resume" for a
        lifecycle without tags), plus "total". A step that raised is absent.
        """
        return dict(self._timings)

    @contextmanager
    def _timed(self, step: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self._timings[step] = time.perf_counter() - start

    @property
    def asleep(self) -> bool:
        """Whether the model's memory (any of its tags) is put away right now."""
        return bool(self._paused)

    @property
    def paused_tags(self) -> frozenset[str | None]:
        """The tags put away right now (`{None}` for a lifecycle that moves every tag at once)."""
        return frozenset(self._paused)

    @property
    def backend(self) -> MemoryBackend:
        """The memory backend this lifecycle drives."""
        return self._backend

    def sleep(self, tags: Sequence[str] | None = None, *, process_groups: bool = True) -> None:
        """Clear caches, destroy process groups, pause memory. Returns at once when already asleep.

        `tags` (a subset of the lifecycle's tags) puts only those away, e.g. the
        optimizer state while the weights stay for a weight export; None means all.
        `process_groups=False` leaves the process groups as they are (e.g. they were
        never brought back for a weight export that needs no collective).
        """
        with self._lock:
            todo = [t for t in self._chosen(tags) if t not in self._paused]
            self._timings = {}
            if not todo:
                logger.info("sleep(): already asleep, nothing to do")
                return
            with self._timed("total"):
                with self._timed("clear_caches"):
                    self._clear_caches()
                if process_groups:
                    with self._timed("destroy_process_groups"):
                        self._destroy_process_groups()
                for tag in todo:
                    with self._timed(_step("pause", tag)):
                        self._backend.pause(tag)
                    self._paused.add(tag)

    def wake_up(self, tags: Sequence[str] | None = None, *, process_groups: bool = True) -> None:
        """Resume memory, clear caches, reload process groups. When awake, only reload process groups.

        `tags` (a subset of the lifecycle's tags) brings only those back, e.g. the
        weights for a weight export while asleep; None means all. `process_groups=False`
        brings the memory back and leaves the process groups torn down.
        """
        with self._lock:
            todo = [t for t in self._chosen(tags) if t in self._paused]
            self._timings = {}
            with self._timed("total"):
                if not todo:
                    if process_groups:
                        logger.info("wake_up(): already awake, reloading process groups only")
                        with self._timed("reload_process_groups"):
                            self._reload_process_groups()
                    return
                for tag in todo:
                    with self._timed(_step("resume", tag)):
                        self._backend.resume(tag)
                    self._paused.discard(tag)
                with self._timed("clear_caches"):
                    self._clear_caches_on_wake()
                if process_groups:
                    with self._timed("reload_process_groups"):
                        self._reload_process_groups()

    def _chosen(self, tags: Sequence[str] | None) -> list[str | None]:
        if tags is None:
            return self._tags
        if self._tags == [None]:
            raise ValueError(
                f"tags={tags!r}: this Lifecycle moves all memory at once; create it with tags=[...] "
                "to move tags separately"
            )
        unknown = [t for t in tags if t not in self._tags]
        if unknown or isinstance(tags, str):
            raise ValueError(f"tags={tags!r}: choose among this Lifecycle's tags {self._tags}")
        return [t for t in self._tags if t in tags]


def _step(verb: str, tag: str | None) -> str:
    return verb if tag is None else f"{verb}:{tag}"
