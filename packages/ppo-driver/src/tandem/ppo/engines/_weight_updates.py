"""Weights into the embedded engine: `update_weights_from_tensors` and `weights_digest`.

`WeightUpdates` is a mixin of `EmbeddedEngine` (which sets the attributes it
declares). HF-named tensors, as CPU tensors or as an opened `IpcPayload`
(`_weights.as_named_tensors`), are copied in place into the model's parameters
and buffers, so the CUDA graphs captured over them stay valid.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from ._errors import EngineMemoryReleasedError
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

    def update_weights_from_tensors(self, named_tensors: Any) -> None:
        """Copy HF-named full tensors (list of (name, tensor), a dict, or an `IpcPayload`) into the model."""
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
        unknown = [n for n, _ in named if n not in self._params_by_name]
        if unknown:
            raise ValueError(
                f"update_weights_from_tensors: {len(unknown)} names are not in the model, e.g. {unknown[:5]}"
            )
        with torch.no_grad():
            for name, tensor in named:
                target = self._params_by_name[name]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"update_weights_from_tensors: {name} has shape {tuple(tensor.shape)}, "
                        f"the model's is {tuple(target.shape)}"
                    )
                target.copy_(tensor, non_blocking=tensor.device.type == "cuda")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
