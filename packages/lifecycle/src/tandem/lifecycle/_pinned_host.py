"""The pinned-host memory backend: registered storages copied to retained host buffers and freed on the GPU."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import torch

from ._frozen_tags import FrozenTags, Stored
from ._host_buffers import HOST_MEMORY, HostBuffer, HostMemory, aligned, bytes_of
from ._shared_frozen import SharedBuffer, SharedFrozen
from ._side_copies import SideStreamCopies

logger = logging.getLogger(__name__)

TensorSource = Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]]
DEFAULT_CHUNK_BYTES = 1 << 30


class PinnedHostBackend(FrozenTags):
    """Puts registered GPU tensors away in host buffers that are allocated once and reused.

    Tensors are registered per tag (`register`). `pause(tag)` copies each distinct
    storage behind them (many views of one flat buffer are copied once) to the
    tag's host buffer on a side CUDA stream, then frees the GPU storage by
    resizing it to 0 bytes and empties the CUDA cache. `resume(tag)` re-creates
    each storage at its old size and copies the bytes back, so every tensor and
    view made before the pause sees its data again. On CPU tensors the same steps
    run with plain memory, which is how the logic is tested without a GPU.

    A tag registered `frozen` (tensors that never change, such as a LoRA model's
    base) is copied to the host once: later pauses only free its GPU memory, and
    every resume copies the kept host copy back. Its host copy serves while awake
    too: `retain` makes it without a pause, `refresh` copies some of its tensors
    back over what was written into them since, `invalidate` makes the next pause
    (or `retain`) copy again.

    Args:
        device: the device whose tensors are put away; None takes the device of the
            registered tensors (they must all share one).
        host_memory: "registered" (exact-size host memory page-locked with
            cudaHostRegister), "pinned" (PyTorch's pinned allocator) or "pageable";
            ignored for CPU tensors, which always use pageable memory.
        chunk_bytes: the largest single copy; bigger storages are copied in pieces.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        host_memory: HostMemory = "registered",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if host_memory not in HOST_MEMORY:
            raise ValueError(f"host_memory={host_memory!r}: choose one of {list(HOST_MEMORY)}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes={chunk_bytes}: must be a positive number of bytes")
        self._device = None if device is None else torch.device(device)
        self._host_memory: HostMemory = host_memory
        self._copier = SideStreamCopies(chunk_bytes)
        self._sources: dict[str, list[TensorSource]] = {}
        self._buffers: dict[str, HostBuffer] = {}
        self._paused: dict[str, list[Stored]] = {}
        self._owner: dict[int, str] = {}  # storage identity -> the paused tag holding it
        self._scratch: set[str] = set()  # tags registered with keep=False
        self._background: set[str] = set()  # tags registered with resume_in_background=True
        self._in_flight: dict[str, torch.cuda.Event] = {}  # background resumes not joined yet
        self._frozen: set[str] = set()  # tags registered with frozen=True
        self._kept: dict[str, dict[int, Stored]] = {}  # frozen tag -> its host copy's layout, by storage
        self._share: dict[str, SharedFrozen] = {}  # frozen tags whose first host copy is shared (`share`)
        self._to_host: dict[str, int] = {}  # bytes copied to the host, per tag
        self._lock = threading.RLock()

    # -- registration -------------------------------------------------------------------------

    def register(
        self,
        tag: str,
        tensors: TensorSource,
        *,
        keep: bool = True,
        resume_in_background: bool = False,
        frozen: bool = False,
        share: SharedFrozen | None = None,
    ) -> None:
        """Put `tensors` under `tag`: an iterable of tensors, or a zero-argument callable
        returning one (called at every pause, so state created later is included).

        `keep=False` makes `tag` scratch memory whose bytes are not worth moving: `pause`
        frees it without copying it to the host, and `resume` re-creates it filled with
        zeros (gradient buffers that are zeroed before every use, say). A tag is kept or
        scratch once and for all.

        `resume_in_background=True` (CUDA): `resume` of `tag` re-creates its storages and
        returns once their copies are queued on the side stream, without waiting for them,
        so that the copies overlap whatever the compute stream does next that does not read
        these tensors (an optimizer state that is first read at the optimizer step). The
        owner calls `join(tag)` before it reads them; `pause` joins first by itself. On the
        CPU a resume is complete when it returns.

        `frozen=True`: the owner promises that the tensors of `tag` do not change while
        awake (a LoRA model's base), so the host copy made by the first `pause` (or
        `retain`) stays valid: every later `pause` frees the GPU memory without a
        device-to-host copy, and `resume` copies the kept bytes back. What is written into
        them while awake is lost at the next pause (or undone by `refresh`). A changed set
        of storages (another storage, another size) is copied again; so is everything
        after `invalidate`. A tag is frozen or not once and for all, and never scratch.

        `share` (a frozen tag's): one host copy for the processes of this machine that register the same
        bytes under the same key (`SharedFrozen`: a LoRA actor's and critic's base from one checkpoint);
        the first to put the tag away publishes its copy, a later one maps it where its bytes are equal.
        """
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"register: tag={tag!r} must be a non-empty string")
        if frozen and not keep:
            raise ValueError(
                f"register({tag!r}, keep=False, frozen=True): a frozen tag's bytes are kept on the host; "
                "a scratch tag keeps none"
            )
        if share is not None and not frozen:
            raise ValueError(f"register({tag!r}, share=...): only a frozen tag's host copy can be shared")
        if tag in self._sources and (tag in self._frozen) != frozen:
            raise ValueError(
                f"register({tag!r}, frozen={frozen}): the tag was registered with frozen={not frozen}; "
                "a tag is frozen or not, for all of its tensors"
            )
        if tag in self._sources and (tag in self._scratch) == keep:
            raise ValueError(
                f"register({tag!r}, keep={keep}): the tag was registered with keep={not keep}; "
                "a tag's bytes are kept or not, for all of its tensors"
            )
        if callable(tensors):
            source: TensorSource = tensors
        else:
            source = list(tensors)
            for t in source:
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"register({tag!r}): expected tensors, got {type(t).__name__}")
        with self._lock:
            self._sources.setdefault(tag, []).append(source)
            if not keep:
                self._scratch.add(tag)
            if resume_in_background:
                self._background.add(tag)
            if frozen:
                self._frozen.add(tag)
            if share is not None:
                self._share[tag] = share
            self._kept.pop(tag, None)  # more tensors: the host copy no longer covers the tag

    @property
    def tags(self) -> tuple[str, ...]:
        """The registered tags, in registration order."""
        return tuple(self._sources)

    @property
    def paused_tags(self) -> frozenset[str]:
        """The tags whose memory is on the host right now."""
        return frozenset(self._paused)

    def host_nbytes(self) -> int:
        """Bytes held in host buffers (kept between cycles, also while awake); a shared copy (`SharedFrozen`)
        counts whole in each process that maps it."""
        extra = {
            id(k.buffer): k.buffer.nbytes for kept in self._kept.values() for k in kept.values() if k.buffer
        }
        return sum(b.nbytes for b in self._buffers.values()) + sum(extra.values())

    def copied_to_host(self, tag: str) -> int:
        """Bytes of `tag` copied from its tensors to the host so far (a frozen tag's: once, at its first pause)."""
        return self._to_host.get(tag, 0)

    def retain(self, tag: str) -> None:
        """Make the host copy of awake frozen `tag` now, without freeing anything (nothing when it has one)."""
        with self._lock:
            self._check_frozen(tag, "retain")
            stored = self._layout(self._collect(tag))
            if not self._holds_copy(tag, stored):
                self._copy_to_host(tag, stored)

    def region(self, tag: str) -> AbstractContextManager[None]:
        """A context that does nothing: this backend finds memory through `register`."""
        return contextlib.nullcontext()

    # -- pause / resume -------------------------------------------------------------------------

    def pause(self, tag: str | None = None) -> None:
        """Copy the storages of `tag` (every registered tag when None) to the host and free them."""
        with self._lock:
            done: list[str] = []
            try:
                for t in self._select(tag, paused=False):
                    self._pause_tag(t)
                    done.append(t)
            except BaseException as err:
                _undo(err, [functools.partial(self._resume_tag, t) for t in reversed(done)])
                raise
            finally:
                if self._is_cuda():
                    torch.cuda.empty_cache()

    def resume(self, tag: str | None = None) -> None:
        """Re-create the storages of `tag` (every registered tag when None) and copy their bytes back."""
        with self._lock:
            done: list[tuple[str, list[Stored]]] = []
            try:
                for t in self._select(tag, paused=True):
                    done.append((t, self._paused[t]))
                    self._resume_tag(t)
            except BaseException as err:
                # The tag that failed has already freed itself again (`_restore`); undo the ones before it.
                _undo(err, [functools.partial(self._unresume, t, s) for t, s in reversed(done[:-1])])
                if self._is_cuda():
                    torch.cuda.empty_cache()
                raise

    def join(self, tag: str | None = None) -> None:
        """Make the compute stream wait for `tag`'s background resume (every tag's when None).

        A GPU-side wait: the host does not block, and kernels queued after this call see
        the tensors' bytes. Does nothing for a tag whose resume was complete already.
        """
        with self._lock:
            for t in [tag] if tag is not None else list(self._in_flight):
                event = self._in_flight.pop(t, None)
                if event is not None:
                    torch.cuda.current_stream(self._device).wait_event(event)

    def _select(self, tag: str | None, *, paused: bool) -> list[str]:
        if tag is not None and tag not in self._sources:
            raise ValueError(f"tag {tag!r} is not registered; registered tags: {list(self._sources)}")
        tags = list(self._sources) if tag is None else [tag]
        wrong = [t for t in tags if (t in self._paused) != paused]
        if wrong:
            state = "awake" if paused else "paused"
            raise RuntimeError(f"PinnedHostBackend: tags {wrong} are already {state}")
        return tags

    def _pause_tag(self, tag: str) -> None:
        self.join(tag)
        stored = self._layout(self._collect(tag))
        buffer = self._put_away(tag, stored)
        kept = self._kept.get(tag)
        if kept is not None:  # a frozen tag's bytes lie where its host copy has them (a shared copy's places)
            stored = [kept[int(s.storage._cdata)] for s in stored]
        freed: list[Stored] = []
        try:
            for s in stored:
                s.storage.resize_(0)
                freed.append(s)
        except BaseException:
            self._restore(freed, buffer)
            raise
        self._paused[tag] = stored
        for s in stored:
            self._owner[int(s.storage._cdata)] = tag

    def _put_away(self, tag: str, stored: list[Stored]) -> HostBuffer | None:
        """The host buffer that holds `stored`'s bytes once this returns (None for a scratch tag): copied
        there now, or a frozen tag's kept copy. Either way no queued kernel still uses the storages."""
        if tag in self._scratch:
            buffer = None
        elif tag in self._frozen and self._holds_copy(tag, stored):
            buffer = self._buffers[tag]
        else:
            return self._copy_to_host(tag, stored)  # waits for the copies
        if self._is_cuda():
            torch.cuda.synchronize(self._device)  # no queued kernel may still use memory freed now
        return buffer

    def _copy_to_host(self, tag: str, stored: list[Stored]) -> HostBuffer:
        """Copy `stored` to `tag`'s host buffer (a frozen tag remembers what its copy is of); once this
        returns the copies are complete."""
        share = self._share.pop(tag, None)  # shared at the first copy only: a later one is of changed bytes
        if isinstance(self._buffers.get(tag), SharedBuffer):
            del self._buffers[tag]  # others may read the shared bytes: a changed tag gets a buffer of its own
        if share is not None and stored:
            shared = self._share_copy(tag, share, stored)
            if shared is not None:
                return shared
        buffer = self._buffer(tag, stored[-1].offset + stored[-1].nbytes if stored else 0)
        with self._copier.session(self._device, wait_for_device=True) as copy:
            for s in stored:
                copy(s, buffer, True)
        self._to_host[tag] = self._to_host.get(tag, 0) + sum(s.nbytes for s in stored)
        if tag in self._frozen:
            self._kept[tag] = {int(s.storage._cdata): s for s in stored}
        return buffer

    def _resume_tag(self, tag: str) -> None:
        stored = self._paused[tag]
        background = tag in self._background and tag not in self._scratch and self._is_cuda()
        self._restore(stored, None if tag in self._scratch else self._buffers.get(tag), background=background)
        if background:
            event = torch.cuda.Event()
            event.record(self._copier.stream(self._device))
            self._in_flight[tag] = event
        del self._paused[tag]
        for s in stored:
            self._owner.pop(int(s.storage._cdata), None)

    def _unresume(self, tag: str, stored: list[Stored]) -> None:
        """Free a tag that was just resumed: its host buffer still holds the same bytes."""
        if self._in_flight.pop(tag, None) is not None:
            self._copier.synchronize()  # its background copies must not write memory freed now
        for s in stored:
            s.storage.resize_(0)
        self._paused[tag] = stored
        for s in stored:
            self._owner[int(s.storage._cdata)] = tag

    def _restore(self, stored: list[Stored], buffer: HostBuffer | None, *, background: bool = False) -> None:
        """Re-create `stored` and copy their bytes back (zeros without a `buffer`: a scratch tag); on
        failure free them again (all-or-nothing). `background`: return with the copies queued."""
        allocated: list[Stored] = []
        try:
            with self._copier.session(self._device, background=background) as copy:
                for s in stored:
                    # Allocate the next storage while the previous copies run.
                    s.storage.resize_(s.nbytes)
                    allocated.append(s)
                    if buffer is None:  # a scratch tag: zeros, on the compute stream like any new memory
                        bytes_of(s.storage).zero_()
                    else:
                        copy(s, buffer, False)
        except BaseException:
            self._copier.synchronize()  # no copy may still write memory that goes back to the cache
            for s in allocated:
                s.storage.resize_(0)
            raise

    # -- helpers ----------------------------------------------------------------------------------

    def _collect(self, tag: str) -> list[torch.UntypedStorage]:
        """The distinct, non-empty storages behind the tensors of `tag`, in first-seen order."""
        seen: dict[int, torch.UntypedStorage] = {}
        for source in self._sources[tag]:
            tensors = source() if callable(source) else source
            for t in tensors:
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"tag {tag!r}: its tensor source yielded a {type(t).__name__}")
                storage = t.untyped_storage()
                key = int(storage._cdata)
                if key in seen:
                    continue
                owner = self._owner.get(key)
                if owner is not None:
                    raise ValueError(
                        f"tags {owner!r} and {tag!r} share a storage; register each buffer under one tag"
                    )
                if storage.nbytes() == 0:
                    continue  # nothing to keep (already freed by its owner, or empty)
                self._check_device(storage, tag)
                if not storage.resizable():
                    raise ValueError(
                        f"tag {tag!r}: a tensor's storage cannot be resized (it wraps external memory); "
                        "register tensors allocated by PyTorch"
                    )
                seen[key] = storage
        return list(seen.values())

    def _check_device(self, storage: torch.UntypedStorage, tag: str) -> None:
        device = storage.device
        if self._device is None:
            self._device = device
            return
        expected = self._device
        same = device.type == expected.type and (
            device.type != "cuda"
            or (expected.index if expected.index is not None else torch.cuda.current_device()) == device.index
        )
        if not same:
            raise ValueError(
                f"tag {tag!r}: a tensor lives on {device}, this backend moves tensors of {expected}"
            )

    @staticmethod
    def _layout(storages: list[torch.UntypedStorage]) -> list[Stored]:
        stored, offset = [], 0
        for storage in storages:
            n = storage.nbytes()
            stored.append(Stored(storage, n, offset))
            offset = aligned(offset + n)
        return stored

    def _buffer(self, tag: str, nbytes: int) -> HostBuffer:
        buffer = self._buffers.get(tag)
        if buffer is not None and buffer.nbytes >= nbytes:
            return buffer
        self._buffers.pop(tag, None)  # drop the small one first: host memory peaks lower
        kind: HostMemory = self._host_memory if self._is_cuda() else "pageable"
        if buffer is not None:
            logger.info("tag %r: host buffer grows to %.3f GiB", tag, nbytes / 2**30)
        buffer = HostBuffer(nbytes, kind)
        self._buffers[tag] = buffer
        return buffer


def _undo(err: BaseException, steps: list[Callable[[], None]]) -> None:
    """Run rollback steps after `err`; a step that fails too is noted on `err`, not raised."""
    for step in steps:
        try:
            step()
        except Exception as undo_err:
            err.add_note(f"rolling back also failed: {undo_err!r}; memory state is now mixed")
