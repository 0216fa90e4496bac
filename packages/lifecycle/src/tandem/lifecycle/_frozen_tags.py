"""Frozen tags of the pinned-host backend: tensors that never change, copied to the host once.

`FrozenTags` is a mixin of `PinnedHostBackend` (which sets the attributes it
declares): whether a frozen tag's kept host copy, made by its first pause or
by `retain`, covers its tensors, and what can be done with it while the tag is
awake (`refresh`, `invalidate`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ._host_buffers import HostBuffer, bytes_of


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
