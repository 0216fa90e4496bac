"""One host copy of a frozen tag for the processes of a machine that hold the same bytes (`SharedFrozen`).

Two models that start from one checkpoint hold the same frozen tensors: a LoRA actor's and its LoRA
critic's base. Each keeps a host copy of its frozen tag (`PinnedHostBackend.register(frozen=True)`);
with `share=SharedFrozen(folder, key)` they keep one between them:

- the first process to put the tag away (`pause` or `retain`) makes its host buffer a memfd (memory
  that goes back once the last process that maps it ends, a crash included: nothing is left behind
  on a disk or in /dev/shm), copies its bytes there as usual and publishes the buffer: its pid, the
  memfd's descriptor and where each storage's bytes lie, in `folder/<key>.json`;
- a later process with the same key maps that buffer instead of making a copy of its own: each of its
  storages takes the next place of its size there, in order (others may lie between), and where every
  such pair holds the same bytes (compared once, as the tag is put away for the first time) the process
  copies only the storages that found no place (the actor's output layer beside the critic's base);
  otherwise it makes its own copy, and says why in the log.

The bytes are only read once shared: a tag whose tensors change on purpose (`invalidate`, or another
set of storages) is copied again into a buffer of its own. Linux only (memfd, /proc/PID/fd).
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._host_buffers import HostBuffer, HostMemory, bytes_of

logger = logging.getLogger(__name__)

_COMPARE_BYTES = 256 << 20
"""The bytes of a storage compared with the shared copy at a time (a device chunk comes to the host)."""


@dataclass(frozen=True)
class SharedFrozen:
    """Where processes that may hold the same frozen bytes find each other's host copy: a folder on this
    machine that they all see (a run's own), and a key for the tag (the same for the same bytes: the
    checkpoint and the shard of it a rank holds)."""

    folder: str | os.PathLike[str]
    key: str

    @property
    def index(self) -> Path:
        """The published buffer's index file."""
        return Path(self.folder) / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', self.key)}.json"


class SharedBuffer(HostBuffer):
    """A host buffer in a memfd, mapped shared: this process's own (`create`) or another's (`open`)."""

    def __init__(self, nbytes: int, kind: HostMemory, path: str, fd: int | None) -> None:
        mapped = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        super().__init__(nbytes, kind, tensor=mapped, touch=fd is not None)
        self.fd = fd
        """The memfd of a buffer this process made (others open it through /proc/PID/fd); None for another's."""

    @classmethod
    def create(cls, nbytes: int, kind: HostMemory) -> SharedBuffer:
        fd = os.memfd_create("tandem-frozen", 0)
        os.ftruncate(fd, max(nbytes, 1))
        return cls(nbytes, kind, f"/proc/self/fd/{fd}", fd)

    def __del__(self) -> None:
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)  # type: ignore[arg-type]


def publish(share: SharedFrozen, buffer: SharedBuffer, places: list[tuple[int, int]]) -> bool:
    """Name `buffer` (its storages' (bytes, offset) in order) under `share`'s key, unless a living process
    did first; whether it is published."""
    index = share.index
    index.parent.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "fd": buffer.fd, "nbytes": buffer.nbytes, "places": places}
    tmp = index.with_name(f".{index.name}.{uuid.uuid4().hex}")
    tmp.write_text(json.dumps(record))
    try:
        try:
            os.link(tmp, index)
            return True
        except FileExistsError:
            if _alive(_read(index)):
                return False
            os.replace(tmp, index)  # a dead process's index: this buffer takes its place
            return True
    finally:
        tmp.unlink(missing_ok=True)


def adopt(
    share: SharedFrozen, sizes: list[int], storages: list[torch.UntypedStorage], kind: HostMemory
) -> tuple[SharedBuffer, list[int | None]] | None:
    """Another process's published buffer and, for each of `storages` (of `sizes` bytes), the offset of its
    equal bytes there, or None where the buffer has no storage of its size in order (the actor's output
    layer, which the critic lacks); None where nothing is published, no storage finds a place, or any
    storage's bytes differ from its place's (said in the log)."""
    record = _read(share.index)
    if record is None or record.get("pid") == os.getpid() or not _alive(record):
        return None
    path = f"/proc/{record['pid']}/fd/{record['fd']}"
    try:
        if os.stat(path).st_size < int(record["nbytes"]):
            return None
        buffer = SharedBuffer(int(record["nbytes"]), kind, path, None)
    except OSError as err:
        logger.info(
            "key %r: the published host copy cannot be opened (%s): a copy of this process's", share.key, err
        )
        return None
    places = [(int(n), int(off)) for n, off in record["places"]]
    offsets: list[int | None] = []
    j = 0
    for n in sizes:  # in order: the next place of the same size, else none (the copy lacks this storage)
        k = next((k for k in range(j, len(places)) if places[k][0] == n), None)
        offsets.append(None if k is None else places[k][1])
        j = j if k is None else k + 1
    if all(off is None for off in offsets):
        return None
    for storage, n, offset in zip(storages, sizes, offsets, strict=True):
        if offset is not None and not _same_bytes(bytes_of(storage), buffer.tensor[offset : offset + n]):
            logger.warning(
                "key %r: the published host copy holds other bytes than this process's frozen tensors (another "
                "checkpoint or shard under the same key?): a copy of this process's",
                share.key,
            )
            return None
    return buffer, offsets


def _same_bytes(device: torch.Tensor, host: torch.Tensor) -> bool:
    for start in range(0, device.numel(), _COMPARE_BYTES):
        end = min(start + _COMPARE_BYTES, device.numel())
        if not torch.equal(device[start:end].cpu(), host[start:end]):
            return False
    return True


def _read(index: Path) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = json.loads(index.read_text())
        return record
    except (OSError, ValueError):
        return None


def _alive(record: dict[str, Any] | None) -> bool:
    if not record:
        return False
    try:
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
