"""The memory-backend protocol, the backend that does nothing, and the factory behind `offload_backend`."""

from __future__ import annotations

import contextlib
import gc
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol, get_args, runtime_checkable

from ._cuda import require_cuda

BackendName = Literal["torch_memory_saver", "pinned_host", "none"]
BACKEND_NAMES: tuple[str, ...] = get_args(BackendName)


@runtime_checkable
class MemoryBackend(Protocol):
    """How a model's GPU memory is put away and brought back; `Lifecycle` decides when.

    `pause` and `resume` are all-or-nothing: when one raises, the memory it was
    asked to move is left where it was, so the caller can tell the truth about
    its state and simply retry. `Lifecycle` never calls `pause` twice or
    `resume` twice in a row for the same tag (torch_memory_saver kills the
    process if that happens).
    """

    def region(self, tag: str) -> AbstractContextManager[None]:
        """Allocations made inside belong to `tag` (torch_memory_saver needs this; a no-op elsewhere)."""
        ...

    def pause(self, tag: str | None = None) -> None:
        """Hand the GPU memory of `tag` (every tag when None) back, keeping its contents on the host."""
        ...

    def resume(self, tag: str | None = None) -> None:
        """Re-create the GPU memory of `tag` (every tag when None) with the contents it had at `pause`."""
        ...


class NoopBackend:
    """The backend for runs that keep their models resident: nothing moves."""

    def region(self, tag: str) -> AbstractContextManager[None]:
        """A context that does nothing."""
        return contextlib.nullcontext()

    def pause(self, tag: str | None = None) -> None:
        """Nothing to hand back."""

    def resume(self, tag: str | None = None) -> None:
        """Nothing to bring back."""


def make_backend(name: BackendName, **kwargs: Any) -> MemoryBackend:
    """Build the memory backend that `offload_backend=name` asks for.

    `kwargs` go to the backend's constructor (`device=` for pinned_host,
    `enable_cpu_backup=` / `hook_mode=` for torch_memory_saver).
    """
    if name == "none":
        if kwargs:
            raise ValueError(f"offload_backend='none' takes no options, got {sorted(kwargs)}")
        return NoopBackend()
    if name == "pinned_host":
        from ._pinned_host import PinnedHostBackend

        return PinnedHostBackend(**kwargs)
    if name == "torch_memory_saver":
        require_cuda("offload_backend='torch_memory_saver'")
        from ._memory_saver import TorchMemorySaverBackend

        return TorchMemorySaverBackend(**kwargs)
    raise ValueError(f"offload_backend={name!r} is not a memory backend; choose one of {list(BACKEND_NAMES)}")


def clear_torch_caches(*, freeze_survivors: bool = False, device: bool = True) -> None:
    """A ready-made `clear_caches` hook for `Lifecycle`: collect garbage, then empty the CUDA cache.

    `device=False` collects garbage only: no device synchronisation and no `empty_cache()`
    (which frees with cudaFree, itself a synchronisation), for a wake's clear step.

    A full `gc.collect()` walks every object the process holds: 0.33 s in a train
    worker that has imported torch, Megatron and Ray (docs/benchmarks.md).
    `freeze_survivors=True` then moves what survived to the permanent generation
    (`gc.freeze()`), so the next call walks only the objects made since. Use it in
    long-lived workers (`functools.partial(clear_torch_caches, freeze_survivors=True)`);
    objects frozen that later form a reference cycle are not collected.
    """
    import torch

    gc.collect()
    if freeze_survivors:
        gc.freeze()
    if device and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
