"""Where one `train()` of a role spends its seconds: its forward passes of their own, its update's passes, its
optimizer steps, and the rest.

The driver's `time/<role>_train` is the whole turn as the driver waits for it (the call, the data, the
train); inside it, `TrainClock` times this rank's train in parts, on the host's clock, with the
compute stream waited for at each part's ends (on CUDA the host runs ahead of the GPU, so a part's
seconds are its kernels' as well as its launches'). The parts:

- `old_log_probs`: the actor's old log-probs, a forward pass of their own (none where the update's own
  forward gives them, `reuse_old_log_probs`, or where given);
- `reference_log_probs`: the reference model's log-probs, its weights swapped in and out;
- `old_values`: the critic's old values, a forward pass of their own (none with `reuse_old_values`);
- `passes`: the update's forward and backward passes, with their loss, over every optimizer step;
- `optimizer_step`: the optimizer steps (with the wait for state a wake brings back in the background,
  and a plan's step wakes);
- `other`: the rest of the train (the rollout's targets, advantages and metrics, their reductions).

Their sum is the train's wall clock on this rank (`total`), exactly: `other` is what the named parts
leave. Each sync costs the host a wait where the GPU was still busy; a train has two a part.

Beside them, not a part, `TrainWorker.train` reports `call` (`CALL`): its whole method on the rank, `total`
and what comes around the train (the batch from the object store, the wakes a train makes, the allocator's
and the memory's figures). The driver's phase less `call` is the call's way to the workers and back (its
arguments and its result serialized) and the driver's own routing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["CALL", "TRAIN_TIME_PARTS", "TrainClock", "timed_part"]

TRAIN_TIME_PARTS: tuple[str, ...] = (
    "old_log_probs",
    "reference_log_probs",
    "old_values",
    "passes",
    "optimizer_step",
)
"""The named parts of a train's seconds; `other` and `total` come beside them."""

CALL = "call"
"""The key of `TrainResult.train_time` for the worker's whole `train` method (not a part: it holds `total`)."""


class TrainClock:
    """One train's seconds by part on this rank (`part`), read by `figures` once it ended (`stop`)."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._seconds: dict[str, float] = {}
        self._open: str | None = None
        self._wait()
        self._start = time.perf_counter()
        self._total: float | None = None

    def _wait(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the block as part `name` (one of `TRAIN_TIME_PARTS`; its seconds add up over calls).
        Parts do not nest: ValueError for one opened inside another, or for an unknown name."""
        if name not in TRAIN_TIME_PARTS:
            raise ValueError(f"TrainClock.part: {name!r} is not one of {TRAIN_TIME_PARTS}")
        if self._open is not None:
            raise ValueError(f"TrainClock.part: {name!r} opened inside {self._open!r}; parts do not nest")
        self._open = name
        self._wait()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._wait()
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start
            self._open = None

    def stop(self) -> None:
        """End the train's clock (its total), the compute stream waited for."""
        self._wait()
        self._total = time.perf_counter() - self._start

    def figures(self) -> dict[str, float]:
        """The seconds of each part that ran, `other` (the rest) and `total`; after `stop`."""
        if self._total is None:
            raise RuntimeError("TrainClock.figures: call stop() first")
        named = sum(self._seconds.values())
        return {**self._seconds, "other": max(0.0, self._total - named), "total": self._total}


@contextmanager
def timed_part(clock: TrainClock | None, name: str) -> Iterator[None]:
    """`clock.part(name)`, or nothing where there is no clock (a train called outside a worker)."""
    if clock is None:
        yield
        return
    with clock.part(name):
        yield
