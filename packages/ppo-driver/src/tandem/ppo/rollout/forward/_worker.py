"""The forward-only worker's base: one Hugging Face model on one device, frozen, whose weights sleep on the host.

A subclass says how its folder loads (`load_model`) and adds its forward pass (the
reward model's `score`, the teacher's `log_probs`), calling `awake_for` first. The
base owns the rest: the device and dtype, the model's lifecycle (sleep and wake move
the weights to retained host buffers and back through tandem.lifecycle's
`PinnedHostBackend`, as the embedded engine does; asleep, the process keeps its CUDA
context and nothing else of the model on the device), and its memory figures.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

import torch

from tandem.lifecycle import Lifecycle, NoopBackend, PinnedHostBackend
from tandem.megatron.runtime.gpu_memory import (
    PhasePeaks,
    device_used_bytes,
    empty_device_cache,
    process_gpu_bytes,
)

from ._options import ForwardOptions

logger = logging.getLogger(__name__)

WEIGHTS = "weights"
"""The lifecycle tag of the model's weights (its only GPU state between calls)."""


class ForwardWorker:
    """One frozen model on one device (CPU or a CUDA GPU): `sleep`, `wake_up` and memory figures; see the module docstring.

    Args:
        folder: the model's Hugging Face folder (`load_model` reads it).
        options: worker options; None: the defaults.
        memory_backend: where the sleeping weights go; None: built from `options.offload_backend`.
    """

    asleep_error: type[Exception] = RuntimeError
    """What a forward pass asked of a sleeping worker raises (`awake_for`)."""

    def __init__(
        self, folder: str, options: ForwardOptions | None = None, *, memory_backend: Any = None
    ) -> None:
        self.options = options = options or ForwardOptions()
        self.device = _pick_device(options)
        self.dtype = _pick_dtype(options.dtype, self.device)
        self._gpu_start = _gpu_baseline(self.device)
        self.model: Any = self.load_model(folder, self.dtype).to(self.device).eval().requires_grad_(False)
        _own_storages(self.model)
        if memory_backend is None:
            none = options.offload_backend == "none"
            memory_backend = NoopBackend() if none else PinnedHostBackend(self.device)
        if hasattr(memory_backend, "register"):
            memory_backend.register(WEIGHTS, lambda: [*self.model.parameters(), *self.model.buffers()])
        self._lifecycle = Lifecycle(memory_backend, tags=[WEIGHTS])
        self._lock = threading.RLock()
        self._peaks = PhasePeaks()

    def load_model(self, folder: str, dtype: torch.dtype) -> Any:
        """The model of `folder` in `dtype`, on the CPU (the base moves it); a subclass's own."""
        raise NotImplementedError

    # -- facts ---------------------------------------------------------------------------------------

    def asleep(self) -> bool:
        """Whether the weights are put away right now."""
        return self._lifecycle.asleep

    def health(self) -> bool:
        """True: the worker is alive (and can compute once awake)."""
        return True

    def weight_bytes(self) -> int:
        """Bytes of the model's weights and buffers (what a sleep moves off the device)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def gpu_memory(self) -> dict[str, int | None]:
        """This worker's GPU memory now and at start-up, in bytes, as nvidia-smi reports it.

        The keys of the train worker's `gpu_memory`: `process` (now, CUDA context included),
        `process_baseline` (once the context existed, before the model), `device_used`,
        `device_before_context`, `context`; None where nvidia-smi cannot tell; all 0 on CPU; and `pid`.
        """
        if self.device.type != "cuda":
            zeros: dict[str, int | None] = dict.fromkeys(
                ("process", "process_baseline", "device_used", "device_before_context", "context"), 0
            )
            return {**zeros, "pid": os.getpid()}
        current = {"process": process_gpu_bytes(), "device_used": device_used_bytes(), "pid": os.getpid()}
        return {**current, **self._gpu_start}

    def phase_peak(self) -> int | None:
        """The largest allocator peak of a forward call so far, above what was allocated as it began (the
        memory plan's transient of this role's turn); None on a CPU or before a call."""
        return self._peaks.as_dict().get("forward")

    def measured(self) -> contextlib.AbstractContextManager[None]:
        """Keep the block's allocator peak as `phase_peak` where it is the largest so far (`PhasePeaks`)."""
        return self._peaks.measure("forward")

    def memory_stats(self) -> dict[str, float]:
        """GiB held on the device by this process's torch allocator (CUDA only)."""
        if self.device.type != "cuda":
            return {}
        return {
            "allocated_gib": torch.cuda.memory_allocated(self.device) / 2**30,
            "reserved_gib": torch.cuda.memory_reserved(self.device) / 2**30,
        }

    # -- the lifecycle ----------------------------------------------------------------------------

    def sleep(self) -> dict[str, float]:
        """Put the weights on the host and hand the device memory back; the lifecycle's timings. Idempotent."""
        with self._lock:
            self._lifecycle.sleep()
            timings = self._lifecycle.last_timings
            self._empty_device_cache()
            return timings

    def wake_up(self) -> dict[str, float]:
        """Bring the weights back, as they were; the lifecycle's timings. Idempotent."""
        with self._lock:
            self._lifecycle.wake_up()
            return self._lifecycle.last_timings

    def awake_for(self, what: str) -> None:
        """Raise `asleep_error` when asked for `what` (a forward pass) while asleep; the caller holds `_lock`."""
        if self._lifecycle.asleep:
            raise self.asleep_error(f"{what}: the model is asleep; call wake_up() first")

    # -- shutdown and device memory -----------------------------------------------------------------

    def shutdown(self) -> None:
        """Free the device's cached memory before the actor goes away."""
        self._empty_device_cache()

    def _empty_device_cache(self) -> None:
        empty_device_cache(self.device)


def right_padded(rows: list[list[int]], fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows right-padded with `fill` into `(ids, attention_mask)`, each `(len(rows), longest)`, int64.

    Right padding under a causal mask leaves each real token's hidden state as it is alone, so a
    forward pass's result for a sample does not depend on which samples share its batch.
    """
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), fill, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def checked_rows(sequences: Any, vocab_size: int, what: str) -> list[list[int]]:
    """The sequences as lists of ints; ValueError naming the sample for an empty one or an id outside
    `[0, vocab_size)` (`what`: the model's name in the message, e.g. "the reward model")."""
    rows = []
    for i, sequence in enumerate(sequences):
        row = [int(t) for t in sequence]
        if not row:
            raise ValueError(f"sample {i} has no tokens; every sample needs at least one")
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"sample {i} has token ids outside {what}'s vocabulary [0, {vocab_size}): {bad[:5]}"
            )
        rows.append(row)
    return rows


def _gpu_baseline(device: torch.device) -> dict[str, int | None]:
    """The GPU memory before this process's CUDA context, that context's size, and the process's then."""
    if device.type != "cuda":
        return {}
    before = device_used_bytes()
    torch.zeros(1, device=device)  # the CUDA context exists from here on
    after = device_used_bytes()
    return {
        "process_baseline": process_gpu_bytes(),
        "device_before_context": before,
        "context": None if after is None or before is None else after - before,
    }


def _own_storages(model: torch.nn.Module) -> None:
    """Give every weight a storage of its own that can be freed (CPU weights may map the checkpoint file)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not tensor.untyped_storage().resizable():
                tensor.data = tensor.data.clone()


def _pick_device(options: ForwardOptions) -> torch.device:
    if options.device == "cpu":
        return torch.device("cpu")
    if options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError(
                f"{type(options).__name__}.device='cuda' but no CUDA device is visible; use 'auto' or 'cpu'"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
