"""Host memory for the pinned-host backend: buffers allocated once and page-locked, and byte views."""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, overload

import torch

HostMemory = Literal["registered", "pinned", "pageable"]
HOST_MEMORY: tuple[str, ...] = ("registered", "pinned", "pageable")

# Each storage starts on its own page of the host buffer: aligned copies run at full speed.
_ALIGN = 4096


class HostBuffer:
    """A tag's host buffer, allocated once and reused by every pause of that tag.

    "registered" allocates exactly `nbytes` of ordinary memory, touches every page
    from several threads, and page-locks it with cudaHostRegister (registering
    untouched memory makes the kernel fault its pages in one by one, several times
    slower: see the first sleep in docs/benchmarks.md); "pinned" uses PyTorch's pinned
    allocator (which may round the size up to a power of two); "pageable" is plain
    memory (the only kind on CPU).
    """

    def __init__(
        self, nbytes: int, kind: HostMemory, *, tensor: torch.Tensor | None = None, touch: bool = False
    ) -> None:
        self.nbytes = nbytes
        if tensor is not None:
            # Memory mapped from elsewhere (`SharedBuffer`): page-locked in place where CUDA copies use it;
            # touched first (`touch`) only where it is new: its bytes may be another process's.
            self.tensor = tensor
            if kind != "pageable" and nbytes > 0:
                self._register(touch=touch)
            return
        if kind == "pinned":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        if kind == "registered" and nbytes > 0:
            self._register(touch=True)

    def _register(self, *, touch: bool) -> None:
        """Page-lock the buffer with cudaHostRegister (`touch`: fault its pages in from several threads first)."""
        if touch:
            prefault(self.tensor)
        cudart = torch.cuda.cudart()
        ptr, nbytes = self.tensor.data_ptr(), self.nbytes
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(
                f"cudaHostRegister of a {nbytes / 2**30:.2f} GiB host buffer failed: "
                f"{cudart.cudaGetErrorString(err)}; pass host_memory='pinned' to PinnedHostBackend"
            )
        # Unregister before the memory goes back to the allocator: the finalizer holds the tensor.
        weakref.finalize(self, _unregister_host, ptr, self.tensor)


class HostCopies(Sequence[torch.Tensor]):
    """Host copies of tensors, all in one host buffer of exactly their bytes (each copy page-aligned).

    For tensors that stay on the host for a whole run and are copied to the GPU again
    and again, such as an actor's reference weights. One PyTorch pinned tensor each
    would round every copy up to a power of two (a 90 MB weight takes 128 MB, about
    40 % more over a 3B model's shapes), and PyTorch's pinned allocator keeps what it
    rounded; here the host holds their bytes and a page of alignment each.

    Args:
        tensors: what to copy, on any device; the copies keep their dtypes and shapes.
        host_memory: as `PinnedHostBackend`'s: "registered" (exact-size memory
            page-locked with cudaHostRegister, the default), "pinned" or "pageable".
            Without CUDA, or when no tensor is on a CUDA device, "pageable".
    """

    def __init__(self, tensors: Iterable[torch.Tensor], *, host_memory: HostMemory = "registered") -> None:
        if host_memory not in HOST_MEMORY:
            raise ValueError(f"host_memory={host_memory!r}: choose one of {list(HOST_MEMORY)}")
        sources = list(tensors)
        sizes = [t.numel() * t.element_size() for t in sources]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total = aligned(total + n)
        kind = host_memory if any(t.is_cuda for t in sources) else "pageable"
        self.buffer = HostBuffer(total, kind)
        """The one host buffer (its `nbytes`: the copies' bytes, each rounded up to a page)."""
        self._copies: list[torch.Tensor] = []
        with torch.no_grad():
            for t, n, offset in zip(sources, sizes, offsets, strict=True):
                copy = self.buffer.tensor[offset : offset + n].view(t.dtype).view(t.shape)
                copy.copy_(t)
                self._copies.append(copy)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...
    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        return self._copies[index]

    def __len__(self) -> int:
        return len(self._copies)


def prefault(tensor: torch.Tensor, threads: int | None = None) -> None:
    """Zero a fresh host tensor from `threads` threads at once, so that its pages exist before page-locking.

    A process's page faults on separate pages run in parallel, and torch's fill
    releases the GIL; the thread count does not depend on torch's own (a Ray
    actor often gets one). `threads` defaults to the CPUs this process may use, at most 16.
    """
    flat = tensor.view(-1)
    if threads is None:
        threads = min(16, len(os.sched_getaffinity(0)))
    threads = max(1, min(threads, flat.numel()))
    step = -(-flat.numel() // threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda start: flat[start : start + step].zero_(), range(0, flat.numel(), step)))


def _unregister_host(ptr: int, tensor: torch.Tensor) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit CUDA may already be gone
        torch.cuda.cudart().cudaHostUnregister(ptr)
    del tensor


def bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN
