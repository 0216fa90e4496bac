"""Frozen tags of the pinned-host backend: tensors that never change, copied to the host once.

`FrozenTags` is a mixin of `PinnedHostBackend` (which sets the attributes it
declares): whether a frozen tag's kept host copy, made by its first pause or
by `retain`, covers its tensors, what can be done with it while the tag is
awake (`refresh`, `invalidate`), and a first copy shared between processes
(`SharedFrozen`: mapped from another's, or made in a memfd and published).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ._host_buffers import HostBuffer, HostMemory, bytes_of
from ._shared_frozen import SharedBuffer, SharedFrozen, adopt, publish

if TYPE_CHECKING:
    from ._side_copies import SideStreamCopies

logger = logging.getLogger(__name__)


@dataclass
class Stored:
    """One storage put away: where its bytes live in the tag's host buffer (or in `buffer`, where a frozen
    tag's shared copy lacks them: `SharedFrozen`)."""

    storage: torch.UntypedStorage
    nbytes: int
    offset: int
    buffer: HostBuffer | None = None


class FrozenTags:
    """What the pinned-host backend does with frozen tags while they are awake; see the module docstring."""

    _lock: threading.RLock
    _frozen: set[str]
    _kept: dict[str, dict[int, Stored]]
    _to_host: dict[str, int]
    _paused: dict[str, list[Stored]]
    _buffers: dict[str, HostBuffer]

    _device: torch.device | None
    _host_memory: HostMemory
    _copier: SideStreamCopies
    _layout: Callable[[list[torch.UntypedStorage]], list[Stored]]

    def refresh(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        """Copy the kept host bytes of `tensors` (contiguous tensors of awake frozen `tag`) back into them.

        Undoes what was written into them since the host copy was made (e.g. an engine's
        weight that held a LoRA merge gets its base back), on the current stream.
        """
        with self._lock:
            self._check_frozen(tag, "refresh")
            kept = self._kept.get(tag)
            if kept is None:
                raise RuntimeError(
                    f"refresh({tag!r}): the tag has no host copy yet; call retain({tag!r}) first"
                )
            buffer = self._buffers[tag]
            for t in tensors:
                place = kept.get(int(t.untyped_storage()._cdata))
                if place is None or not t.is_contiguous():
                    raise ValueError(f"refresh({tag!r}): a tensor that is not a contiguous tensor of the tag")
                start = t.storage_offset() * t.element_size()
                n = t.numel() * t.element_size()
                host = (place.buffer if place.buffer is not None else buffer).tensor[
                    place.offset + start : place.offset + start + n
                ]
                bytes_of(place.storage)[start : start + n].copy_(host, non_blocking=self._is_cuda())

    def invalidate(self, tag: str) -> None:
        """Forget frozen `tag`'s host copy: its tensors changed on purpose, and the next pause copies them."""
        with self._lock:
            self._check_frozen(tag, "invalidate")
            self._kept.pop(tag, None)

    def _check_frozen(self, tag: str, what: str) -> None:
        if tag not in self._frozen:
            raise ValueError(f"{what}({tag!r}): not a frozen tag; register it with frozen=True")
        if tag in self._paused:
            raise RuntimeError(f"{what}({tag!r}): the tag is paused; resume it first")

    def _holds_copy(self, tag: str, stored: list[Stored]) -> bool:
        """Whether frozen `tag` has a host copy of exactly these storages, of these sizes (each where the copy
        has it: in this process's layout, or where a shared copy has equal bytes)."""
        kept = self._kept.get(tag)
        if kept is None or len(kept) != len(stored):
            return False
        return all(
            (k := kept.get(int(s.storage._cdata))) is not None and k.nbytes == s.nbytes for s in stored
        )

    def _is_cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

    def _share_copy(self, tag: str, share: SharedFrozen, stored: list[Stored]) -> HostBuffer | None:
        """The first host copy of frozen `tag` shared (`SharedFrozen`): another process's equal bytes mapped
        (nothing copied), or this process's copy made in a memfd and published; None where neither can be
        (the copy is then made as any other)."""
        kind: HostMemory = self._host_memory if self._is_cuda() else "pageable"
        if self._is_cuda():
            torch.cuda.synchronize(self._device)  # the bytes compared are the ones the queued kernels leave
        try:
            found = adopt(share, [s.nbytes for s in stored], [s.storage for s in stored], kind)
        except (OSError, KeyError, TypeError, ValueError) as err:  # an index that is not one of ours
            logger.info(
                "tag %r: the index under %r is unreadable (%r); a copy of this process's", tag, share.key, err
            )
            found = None
        if found is not None:
            buffer, offsets = found
            # What the shared copy lacks (the actor's output layer beside the critic's base) gets a copy here.
            extra = self._layout([s.storage for s, off in zip(stored, offsets, strict=True) if off is None])
            own = HostBuffer(extra[-1].offset + extra[-1].nbytes, kind) if extra else None
            if own is not None:
                extra = [Stored(e.storage, e.nbytes, e.offset, own) for e in extra]
                with self._copier.session(self._device, wait_for_device=True) as copy:
                    for e in extra:
                        copy(e, own, True)
                self._to_host[tag] = self._to_host.get(tag, 0) + sum(e.nbytes for e in extra)
            places = iter(extra)
            kept = [
                Stored(s.storage, s.nbytes, off) if off is not None else next(places)
                for s, off in zip(stored, offsets, strict=True)
            ]
            self._buffers[tag] = buffer
            self._kept[tag] = {int(k.storage._cdata): k for k in kept}
            logger.info(
                "tag %r: maps the host copy published under %r (%.3f GiB), %.3f GiB of its own beside it",
                tag,
                share.key,
                buffer.nbytes / 2**30,
                sum(e.nbytes for e in extra) / 2**30,
            )
            return buffer
        try:
            buffer = SharedBuffer.create(stored[-1].offset + stored[-1].nbytes, kind)
        except OSError as err:
            logger.info("tag %r: no shared host copy (%s); a copy of this process's", tag, err)
            return None
        self._buffers[tag] = buffer
        with self._copier.session(self._device, wait_for_device=True) as copy:
            for s in stored:
                copy(s, buffer, True)
        self._to_host[tag] = self._to_host.get(tag, 0) + sum(s.nbytes for s in stored)
        self._kept[tag] = {int(s.storage._cdata): s for s in stored}
        try:
            publish(share, buffer, [(s.nbytes, s.offset) for s in stored])
        except OSError as err:  # the copy stands; only the other process cannot find it
            logger.info("tag %r: its host copy could not be published under %r (%s)", tag, share.key, err)
        return buffer
