"""Weights into the embedded engine: `update_weights_from_tensors`, `weights_digest`, `weight_changes`.

`WeightUpdates` is a mixin of `EmbeddedEngine` (which sets the attributes it
declares). HF-named tensors, as CPU tensors or as an opened `IpcPayload`
(`_weights.as_named_tensors`), are copied in place into the model's parameters
and buffers, so the CUDA graphs captured over them stay valid. With
`EngineOptions.count_weight_changes` the copy counts the elements it changes
(`_weight_changes.ChangeCounter`), read once a sync by `weight_changes`.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from ._errors import EngineMemoryReleasedError
from ._weight_changes import ChangeCounter
from ._weights import as_named_tensors

if TYPE_CHECKING:
    from tandem.lifecycle import Lifecycle

_DIGEST_SLICE = 1 << 22
"""Elements summed at a time by `weights_digest` (a 32 MiB float64 copy at most)."""


class WeightUpdates:
    """Weight sync into the engine's model and its fingerprint; see the module docstring."""

    device: torch.device
    _lock: threading.RLock
    _lifecycle: Lifecycle
    _params_by_name: dict[str, torch.Tensor]
    _changes: ChangeCounter | None
    _weights_magnitudes: dict[str, Any]
    _update_seconds: float

    def update_weights_from_tensors(self, named_tensors: Any) -> None:
        """Copy HF-named full tensors (list of (name, tensor), a dict, or an `IpcPayload`) into the model."""
        start = time.perf_counter()
        with self._lock:
            if self._lifecycle.asleep:
                raise EngineMemoryReleasedError(
                    "update_weights_from_tensors: the engine's weights are released; "
                    "call resume_memory(['weights']) first (sync order: weights, sync, kv_cache)"
                )
            named, opened = as_named_tensors(named_tensors, self.device)
            try:
                self._copy_in(named)
            finally:
                # Drop every view of IPC-opened buffers before telling the sender they are free.
                named.clear()
                opened.clear()
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()
            self._update_seconds += time.perf_counter() - start

    def weight_changes(self) -> dict[str, float]:
        """What the weight updates since the last call did: `update_s`, the seconds spent in them, and
        with `EngineOptions.count_weight_changes` the elements `changed` in them, `changed_since_start`
        (ever, since the engine loaded its weights) and the weights' `elements` (`WeightChanges`)."""
        with self._lock:
            figures: dict[str, float] = {"update_s": self._update_seconds}
            self._update_seconds = 0.0
            if self._changes is not None:
                if self._lifecycle.asleep:
                    raise EngineMemoryReleasedError("weight_changes: the engine's weights are released")
                changes = self._changes.take()
                figures |= {
                    "changed": changes.changed,
                    "changed_since_start": changes.changed_since_start,
                    "elements": changes.elements,
                }
            return figures

    def weight_magnitudes(self) -> dict[str, Any]:
        """How large the loaded weights are, for their dtype's spacing (`_weight_changes.weight_magnitudes`)."""
        return self._weights_magnitudes

    def weights_digest(self) -> list[float]:
        """Two fingerprints of the weights now (sum and sum of squares, in float64).

        Equal on every engine once a weight sync reached them all; the driver logs them.
        """
        with self._lock, torch.no_grad():
            if self._lifecycle.asleep:
                raise EngineMemoryReleasedError("weights_digest: the engine's weights are released")
            total = torch.zeros(2, dtype=torch.float64, device=self.device)
            for tensor in self._params_by_name.values():
                # In slices: a float64 copy of a whole embedding would be GiBs on the engine's GPU.
                for part in tensor.detach().reshape(-1).split(_DIGEST_SLICE):
                    flat = part.double()
                    total[0] += flat.sum()
                    total[1] += flat.dot(flat)
            return [float(x) for x in total.cpu()]

    def _copy_in(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Each (name, tensor) over the model's tensor of that name: counted (`ChangeCounter.copy_in_many`,
        one kernel launch a dtype pair on CUDA) or not (one `torch._foreach_copy_` for the sources on the
        model's device), so that the sync's time with and without the count compares like with like."""
        # By target: tied names (an embedding and its head) are one tensor, copied once (the last one sent).
        by_target: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, tensor in named:
            target = self._params_by_name.get(name)
            if target is None:
                unknown = [n for n, _ in named if n not in self._params_by_name]
                raise ValueError(
                    f"update_weights_from_tensors: {len(unknown)} names are not in the model, e.g. {unknown[:5]}"
                )
            if target.shape != tensor.shape:
                raise ValueError(
                    f"update_weights_from_tensors: {name} has shape {tuple(tensor.shape)}, "
                    f"the model's is {tuple(target.shape)}"
                )
            by_target[id(target)] = (target, tensor)
        copies = list(by_target.values())
        with torch.no_grad():
            if self._changes is not None:
                self._changes.copy_in_many(copies)
            else:
                local = [(t, s) for t, s in copies if s.device == t.device]
                if local:
                    targets, sources = zip(*local, strict=True)
                    torch._foreach_copy_(targets, sources, non_blocking=True)
                for target, source in copies:
                    if source.device != target.device:
                        target.copy_(source, non_blocking=source.device.type == "cuda")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
