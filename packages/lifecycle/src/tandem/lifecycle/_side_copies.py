"""The pinned-host backend's copies between GPU storages and host buffers: on a side CUDA stream, in chunks."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from ._frozen_tags import Stored
from ._host_buffers import HostBuffer, bytes_of

CopyFn = Callable[[Stored, HostBuffer, bool], None]
"""`copy(stored, buffer, to_host)`: one storage's bytes to (`to_host`) or from its place in `buffer`."""


class SideStreamCopies:
    """Copies of storages to and from host buffers, in pieces of at most `chunk_bytes`.

    On CUDA they run on one side stream of the backend's device, made at first use, so that
    they overlap the compute stream's work; on the CPU they are plain copies.
    """

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._stream: torch.cuda.Stream | None = None

    def stream(self, device: torch.device | None) -> torch.cuda.Stream:
        """The side stream (made on `device` at first use)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def synchronize(self) -> None:
        """Wait on the host for every copy queued on the side stream (none before its first use)."""
        if self._stream is not None:
            self._stream.synchronize()

    @contextlib.contextmanager
    def session(
        self, device: torch.device | None, *, wait_for_device: bool = False, background: bool = False
    ) -> Iterator[CopyFn]:
        """A session of copies between storages and a host buffer; on exit they are complete.

        `device`: the backend's device; copies of CPU storages (`device` None or not CUDA) are
        plain and complete as they return. On CUDA the copies run on the side stream, in chunks,
        without blocking the host until the end. Storages are allocated (resume) outside the side
        stream, so that their memory stays with the compute stream in the caching allocator.
        `wait_for_device` first waits for every stream (pause: a communication stream may still
        write gradients); otherwise the side stream waits for the compute stream. `background`: on
        exit the copies are only queued; neither the host nor the compute stream waits for them
        (the caller records an event on `stream` for its join).
        """
        if device is None or device.type != "cuda":
            yield functools.partial(self.copy, non_blocking=False)
            return
        if wait_for_device:
            torch.cuda.synchronize(device)
        current = torch.cuda.current_stream(device)
        side = self.stream(device)
        # The side stream starts after the work already queued on the compute stream: that work
        # may still write these tensors (pause), or used the memory handed out again (resume).
        side.wait_stream(current)

        def on_side_stream(s: Stored, buffer: HostBuffer, to_host: bool) -> None:
            with torch.cuda.stream(side):
                self.copy(s, buffer, to_host, non_blocking=True)

        yield on_side_stream
        if background:
            return
        # Later compute waits for the copies; the host waits too, so that storages are freed only
        # after their bytes left, and the host buffer is complete before a pause returns.
        current.wait_stream(side)
        side.synchronize()

    def copy(self, s: Stored, buffer: HostBuffer, to_host: bool, *, non_blocking: bool) -> None:
        """One storage's bytes to (`to_host`) or from its place in `buffer` (or in `s.buffer`), in chunks."""
        device_bytes = bytes_of(s.storage)
        host_bytes = (s.buffer if s.buffer is not None else buffer).tensor[s.offset : s.offset + s.nbytes]
        for start in range(0, s.nbytes, self.chunk_bytes):
            end = min(start + self.chunk_bytes, s.nbytes)
            if to_host:
                host_bytes[start:end].copy_(device_bytes[start:end], non_blocking=non_blocking)
            else:
                device_bytes[start:end].copy_(host_bytes[start:end], non_blocking=non_blocking)
