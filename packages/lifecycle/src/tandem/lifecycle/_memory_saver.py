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

from ._cuda import require_cuda

HookMode = Literal["preload"]
HOOK_MODES: tuple[str, ...] = ("preload",)
# torch_memory_saver's "torch" hook mode (a pluggable allocator) is not offered: with 0.0.10 on an
# H200 the process aborted at exit ("only support interesting region" in tms_torch_free) once
# memory allocated outside a region was freed, which every training process does.
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


def _hook_in_ld_preload() -> bool:
    return any("torch_memory_saver" in p for p in os.environ.get("LD_PRELOAD", "").split(":"))


def _mapped_libraries() -> set[str] | None:
    """Paths of the shared libraries mapped into this process (None where /proc is not there)."""
    try:
        with open("/proc/self/maps") as maps:
            return {
                line.split(maxsplit=5)[5].strip() for line in maps if line.count(" ") >= 5 and ".so" in line
            }
    except (OSError, IndexError):
        return None


def _cuda_runtime_dirs() -> list[str]:
    """Folders of the CUDA runtime this process loaded (torch wheels ship it outside the loader's path)."""
    libraries = _mapped_libraries() or set()
    return sorted({os.path.dirname(p) for p in libraries if os.path.basename(p).startswith("libcudart.so")})


def torch_memory_saver_env() -> dict[str, str]:
    """Environment variables that a worker process using torch_memory_saver must start with.

    Pass them to the process that will create the backend, e.g. a Ray actor's
    `runtime_env={"env_vars": torch_memory_saver_env()}`: the hook is an LD_PRELOAD
    library, so setting it in a process that is already running does nothing. Any
    other LD_PRELOAD entries of this process are kept after the hook. The hook needs
    the CUDA runtime (libcudart) when the process starts, before torch finds its own
    copy, so the folder of the one torch loaded here goes first on LD_LIBRARY_PATH.
    Raises ValueError on a machine without CUDA.
    """
    require_cuda("torch_memory_saver_env()")
    _import_saver()
    from torch_memory_saver.utils import get_binary_path_from_package

    hook = str(get_binary_path_from_package(_PRELOAD_HOOK_STEM))
    others = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and "torch_memory_saver" not in p]
    env = {"LD_PRELOAD": ":".join([hook, *others])}
    torch.cuda.init()  # loads the CUDA runtime if torch has not yet
    library_path = _cuda_runtime_dirs()
    library_path += [
        p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p and p not in library_path
    ]
    if library_path:
        env["LD_LIBRARY_PATH"] = ":".join(library_path)
    return env


class TorchMemorySaverBackend:
    """Memory backend on torch_memory_saver: allocations made in `region(tag)` are unmapped on pause.

    With `enable_cpu_backup` their contents are copied to host memory and back;
    without it they come back uninitialised (fine for caches, wrong for weights).
    `hook_mode="preload"` (the only mode offered) needs the process started with
    `torch_memory_saver_env()`.

    torch_memory_saver kills the process when a paused allocation is paused again,
    so this class refuses (RuntimeError) a pause of what is paused and a resume of
    what is not.

    Unlike the pinned-host backend, `pause` leaves torch's cache of unused blocks
    alone (emptied between two tags' pauses, it could hand a paused tag's cached
    segments to cudaFree): empty it before pausing, as `Lifecycle` does with
    `clear_torch_caches` as its `clear_caches` hook.
    """

    def __init__(self, *, enable_cpu_backup: bool = True, hook_mode: HookMode = "preload") -> None:
        require_cuda("offload_backend='torch_memory_saver'")
        if hook_mode not in HOOK_MODES:
            raise ValueError(
                f"hook_mode={hook_mode!r}: choose one of {list(HOOK_MODES)} (torch_memory_saver's 'torch' "
                "mode aborts the process when memory allocated outside its regions is freed)"
            )
        start_with_env = (
            "start it with the environment of torch_memory_saver_env() "
            "(Ray: runtime_env={'env_vars': torch_memory_saver_env()}),"
        )
        if hook_mode == "preload" and not _hook_in_ld_preload():
            raise ValueError(
                "offload_backend='torch_memory_saver' with hook_mode='preload': this process was not "
                f"started with the hook in LD_PRELOAD; {start_with_env}"
            )
        saver = _import_saver().torch_memory_saver
        # ld.so skips a preload it cannot load (e.g. libcudart not on its path) with only a warning;
        # torch_memory_saver would then load the hook late, and pause would silently do nothing.
        libraries = _mapped_libraries()
        if (
            hook_mode == "preload"
            and saver._impl is None
            and libraries is not None
            and not any("torch_memory_saver_hook_mode_preload" in p for p in libraries)
        ):
            raise ValueError(
                "offload_backend='torch_memory_saver': LD_PRELOAD names the hook but it was not loaded "
                "when this process started (look for an 'ld.so: object ... cannot be preloaded' "
                f"warning; usually libcudart is not on LD_LIBRARY_PATH); {start_with_env}"
            )
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
