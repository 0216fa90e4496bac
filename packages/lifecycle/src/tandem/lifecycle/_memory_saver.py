"""The torch_memory_saver backend (GPU only) and the environment its LD_PRELOAD hook needs.

torch_memory_saver is imported only inside these functions, and only after a CUDA
check: on a machine without CUDA it must never be imported nor preloaded (a process
started with its hook there dies before Python starts).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch

from ._backend import require_cuda

HookMode = Literal["preload", "torch"]
HOOK_MODES: tuple[str, ...] = ("preload", "torch")
# The hook library's name stem inside the torch_memory_saver wheel (one build per CUDA major).
_PRELOAD_HOOK_STEM = "torch_memory_saver_hook_mode_preload"
_INSTALL = "pip install 'tandem-lifecycle[torch-memory-saver]'"


def _import_saver() -> Any:
    try:
        import torch_memory_saver
    except ImportError as err:
        raise ImportError(
            f"offload_backend='torch_memory_saver' needs torch_memory_saver: {_INSTALL}"
        ) from err
    return torch_memory_saver


def _hook_preloaded() -> bool:
    return any("torch_memory_saver" in p for p in os.environ.get("LD_PRELOAD", "").split(":"))


def torch_memory_saver_env() -> dict[str, str]:
    """Environment variables that a worker process using torch_memory_saver must start with.

    Pass them to the process that will create the backend, e.g. a Ray actor's
    `runtime_env={"env_vars": torch_memory_saver_env()}`: the hook is an LD_PRELOAD
    library, so setting it in a process that is already running does nothing. Any
    other LD_PRELOAD entries of this process are kept after the hook.
    Raises ValueError on a machine without CUDA.
    """
    require_cuda("torch_memory_saver_env()")
    _import_saver()
    from torch_memory_saver.utils import get_binary_path_from_package

    hook = str(get_binary_path_from_package(_PRELOAD_HOOK_STEM))
    others = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and "torch_memory_saver" not in p]
    return {"LD_PRELOAD": ":".join([hook, *others])}


class TorchMemorySaverBackend:
    """Memory backend on torch_memory_saver: allocations made in `region(tag)` are unmapped on pause.

    With `enable_cpu_backup` their contents are copied to host memory and back;
    without it they come back uninitialised (fine for caches, wrong for weights).
    `hook_mode="preload"` (the default) needs the process started with
    `torch_memory_saver_env()`; `hook_mode="torch"` uses a PyTorch pluggable
    allocator instead and needs no preload.

    torch_memory_saver kills the process when a paused allocation is paused again,
    so this class refuses (RuntimeError) a pause of what is paused and a resume of
    what is not.
    """

    def __init__(self, *, enable_cpu_backup: bool = True, hook_mode: HookMode = "preload") -> None:
        require_cuda("offload_backend='torch_memory_saver'")
        if hook_mode not in HOOK_MODES:
            raise ValueError(f"hook_mode={hook_mode!r}: choose one of {list(HOOK_MODES)}")
        if hook_mode == "preload" and not _hook_preloaded():
            raise ValueError(
                "offload_backend='torch_memory_saver' with hook_mode='preload': this process was not "
                "started with the hook; start it with the environment of torch_memory_saver_env() "
                "(Ray: runtime_env={'env_vars': torch_memory_saver_env()}), or pass hook_mode='torch'"
            )
        saver = _import_saver().torch_memory_saver
        if hook_mode == "torch" and saver._impl is None:
            saver.hook_mode = "torch"
        self._saver = saver
        self._enable_cpu_backup = enable_cpu_backup
        self._all_paused = False
        self._paused_tags: set[str] = set()

    def region(self, tag: str) -> AbstractContextManager[None]:
        """Allocations made inside belong to `tag` and are paused with it."""
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"region: tag={tag!r} must be a non-empty string")
        cm: AbstractContextManager[None] = self._saver.region(
            tag=tag, enable_cpu_backup=self._enable_cpu_backup
        )
        return cm

    def pause(self, tag: str | None = None) -> None:
        """Unmap the memory of `tag` (every tag when None), copying it to the host first with CPU backup."""
        if self._all_paused or (tag is None and self._paused_tags) or tag in self._paused_tags:
            raise RuntimeError(f"torch_memory_saver: tag {tag!r} is already paused")
        # Kernels still queued may write the memory that is about to be unmapped.
        torch.cuda.synchronize()
        self._saver.pause(tag)
        if tag is None:
            self._all_paused = True
        else:
            self._paused_tags.add(tag)

    def resume(self, tag: str | None = None) -> None:
        """Map the memory of `tag` (every tag when None) again and copy its contents back."""
        if (tag is None and not self._all_paused) or (tag is not None and tag not in self._paused_tags):
            raise RuntimeError(
                f"torch_memory_saver: tag {tag!r} is not paused (or was paused under another tag)"
            )
        self._saver.resume(tag)
        torch.cuda.synchronize()
        if tag is None:
            self._all_paused = False
        else:
            self._paused_tags.discard(tag)
