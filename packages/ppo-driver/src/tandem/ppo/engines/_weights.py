"""Weights into an engine: HF-named tensors, as CPU tensors or as CUDA IPC handles (`ipc_payload`).

When an actor rank and an engine share a GPU, the actor sends handles instead of
bytes: `ipc_payload(named_tensors)` packs each dtype's tensors into one flat
device buffer (one IPC handle per dtype, as slime's flattened buckets do) and
serializes it with `torch.multiprocessing.reductions.reduce_tensor`; the engine
opens the handle on its own device and copies into its parameters. The sender
must keep the payload object alive until the engine's call has returned (it
holds the flat buffers; only the handles travel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

NamedTensors = Sequence[tuple[str, torch.Tensor]]


@dataclass
class _FlatBucket:
    """One dtype's tensors as views of one flat buffer: (name, shape, element offset) each."""

    rebuild: Callable[..., torch.Tensor]
    args: tuple[Any, ...]
    entries: list[tuple[str, tuple[int, ...], int]]


@dataclass
class IpcPayload:
    """HF-named tensors as serialized CUDA IPC handles (or, on CPU, shared storages); see `ipc_payload`."""

    buckets: list[_FlatBucket]
    _keepalive: list[torch.Tensor] = field(default_factory=list, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        # Only the handles travel; the sender keeps the buffers they point to.
        return {"buckets": self.buckets, "_keepalive": []}

    def names(self) -> list[str]:
        """The tensor names, in payload order."""
        return [name for bucket in self.buckets for name, _, _ in bucket.entries]


def ipc_payload(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> IpcPayload:
    """Pack HF-named tensors for `update_weights_from_tensors` as IPC handles (sender side).

    Each dtype's tensors are copied into one flat buffer on their device, so one
    handle per dtype crosses the process boundary. Keep the returned object alive
    until the receiving engine's `update_weights_from_tensors` has returned.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    by_dtype: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"ipc_payload: {name!r} is a {type(tensor).__name__}, not a tensor")
        by_dtype.setdefault((tensor.dtype, tensor.device), []).append((name, tensor))
    buckets, keepalive = [], []
    for (dtype, device), items in by_dtype.items():
        total = sum(t.numel() for _, t in items)
        flat = torch.empty(total, dtype=dtype, device=device)
        entries, offset = [], 0
        for name, tensor in items:
            n = tensor.numel()
            flat[offset : offset + n].copy_(tensor.reshape(-1))
            entries.append((name, tuple(tensor.shape), offset))
            offset += n
        rebuild, args = reduce_tensor(flat)
        buckets.append(_FlatBucket(rebuild, tuple(args), entries))
        keepalive.append(flat)
    return IpcPayload(buckets, keepalive)


def open_payload(
    payload: IpcPayload, device: torch.device
) -> tuple[list[tuple[str, torch.Tensor]], list[Any]]:
    """Receiver side: the payload's tensors (views of the opened flat buffers) and the buffers to drop after use."""
    named: list[tuple[str, torch.Tensor]] = []
    opened: list[Any] = []
    for bucket in payload.buckets:
        args = list(bucket.args)
        if device.type == "cuda" and len(args) > 6 and isinstance(args[6], int):
            # The sender's device index: under Ray both processes usually see their shared GPU as
            # cuda:0, but map it to this process's device in any case (as slime and verl do).
            args[6] = device.index if device.index is not None else torch.cuda.current_device()
        flat = bucket.rebuild(*args)
        opened.append(flat)
        for name, shape, offset in bucket.entries:
            n = 1
            for s in shape:
                n *= s
            named.append((name, flat[offset : offset + n].view(shape)))
    return named, opened


def as_named_tensors(
    named_tensors: Any, device: torch.device
) -> tuple[list[tuple[str, torch.Tensor]], list[Any]]:
    """Normalize what `update_weights_from_tensors` accepts: a list of (name, tensor), a dict, or an `IpcPayload`."""
    if isinstance(named_tensors, IpcPayload):
        return open_payload(named_tensors, device)
    if isinstance(named_tensors, dict):
        named_tensors = list(named_tensors.items())
    items = list(named_tensors)
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise ValueError(
                "update_weights_from_tensors: expected a list of (hf_name, tensor) pairs or an IpcPayload "
                f"(ipc_payload(...)), got an item of type {type(item).__name__}"
            )
    return [(str(n), t) for n, t in items], []
