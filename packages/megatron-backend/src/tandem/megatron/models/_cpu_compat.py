"""The CPU compatibility layer that lets megatron-core run on CPU under gloo.

megatron-core assumes a CUDA device in a few places that the CPU path still
reaches. This module is the ONLY place where those assumptions are bent, and
it does nothing when CUDA is available (`enable_cpu_compat()` returns False
and leaves torch untouched), so nothing of it is active on a GPU host.

What it covers, and why:

- `device="cuda"` literals and `.cuda()` calls (e.g. the token counter in
  `pipeline_parallel/schedules.py`, the causal mask in `transformer/utils.py`,
  the tied-embedding sync in `language_module.py`): a torch function mode
  rewrites any CUDA device argument to the CPU. Torch function modes are
  per thread, so every entry point of this package calls `enable_cpu_compat()`
  again in the thread it runs in (cheap: it checks a thread-local flag).
- `torch.cuda.current_device()` (used as `device=` of buffers in the tensor-
  and pipeline-parallel code): returns the CPU device instead of initialising
  CUDA, which would fail.
- `torch.cuda.synchronize()` (pipeline p2p, timers): a no-op.
- The RNG tracker: `parallel.init_distributed` uses Megatron's inference RNG
  tracker on CPU (`model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)`),
  whose `fork()` does not touch CUDA generators; our models have no dropout.
- Fused kernels: `hf_config.ModelSpec.transformer_config` turns every fused
  path off when `cpu_compat_active()`.
- Not supported on CPU (the worker must avoid them): Megatron's distributed
  optimizer and its `clip_grad` helpers (clip with `torch.nn.utils.clip_grad_norm_`
  over the model-parallel group yourself).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tandem.megatron.models._megatron_core import import_megatron_core

_lock = threading.Lock()
_patched = False
_thread_state = threading.local()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Torch function mode that sends every CUDA device argument to the CPU."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            # `.cuda()` on a CPU tensor: stay where it is.
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _no_synchronize(device: Any = None) -> None:
    return None


class _NullStream:
    """Stands in for a CUDA stream on the CPU (Megatron's DDP orders its grad sync on streams)."""

    def wait_event(self, event: Any) -> None:
        """No CUDA work to order."""

    def wait_stream(self, stream: Any) -> None:
        """No CUDA work to order."""

    def synchronize(self) -> None:
        """No CUDA work to wait for."""


def _null_stream(device: Any = None) -> _NullStream:
    return _NullStream()


def cpu_compat_active() -> bool:
    """Whether this process runs Megatron on CPU (no CUDA device), i.e. whether the shims apply."""
    return not torch.cuda.is_available()


def enable_cpu_compat() -> bool:
    """Install the CPU shims for this process and the calling thread; idempotent.

    Returns True when the shims are active (no CUDA), False on a CUDA host,
    where nothing is changed. Call it in every thread that runs Megatron code;
    the package's entry points (`init_distributed`, `build_model`, the forward
    and weight functions) already do.
    """
    import_megatron_core()  # first, on every host: the fusions compile on first call
    if not cpu_compat_active():
        return False
    global _patched
    with _lock:
        if not _patched:
            torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
            torch.cuda.synchronize = _no_synchronize
            torch.cuda.current_stream = _null_stream  # type: ignore[assignment]
            _patched = True
    if not getattr(_thread_state, "mode_entered", False):
        # Entered for the life of the thread on purpose: Megatron code may run
        # at any later time in this thread (worker methods, backward passes).
        _CudaToCpuMode().__enter__()
        _thread_state.mode_entered = True
    return True
