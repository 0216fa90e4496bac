"""megatron-core imported so that its compiled fusions compile where they are first called, not as it loads.

Megatron decorates its fused kernels (`megatron.core.fusions`, `transformer/utils.py`, ...) with
`torch.compile` while its modules load (`megatron.core.jit.jit_fuser`), and building each compiled
wrapper imports torch's dynamo and inductor: about 1.2 s of CPU in every process that imports
megatron-core, which is every train worker and every Megatron test process (on two cores,
`import megatron.core.transformer, megatron.core.optimizer` took 2.7 s of CPU, 1.5 s this way).
Tandem calls those kernels only with `jit_fusions` (off by default, never on the CPU).

`import_megatron_core()` imports megatron-core with `torch.compile` replaced by a decorator that
compiles a function on its first call, with the arguments it was given, then puts `torch.compile`
back. A kernel that runs is compiled as before, at its first call instead of at import; one that
never runs is never compiled.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["compile_on_first_call", "import_megatron_core"]

_lock = threading.Lock()


def compile_on_first_call(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for `compile_fn` (`torch.compile`) that defers it to each function's first call.

    Takes `torch.compile`'s forms: `f(fn)`, `f(fn, **options)` and `f(**options)(fn)`.
    """

    def deferred(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        if fn is None:
            return lambda real: deferred(real, **options)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                with _lock:
                    if not compiled:
                        compiled.append(compile_fn(fn, **options))
            return compiled[0](*args, **kwargs)

        return call

    return deferred


def import_megatron_core() -> ModuleType:
    """`megatron.core`, imported (once per process) with its fusions compiled on first call."""
    if "megatron.core" in sys.modules:
        return sys.modules["megatron.core"]
    import torch

    with _lock:
        real = torch.compile
        torch.compile = compile_on_first_call(real)
        try:
            import megatron.core
        finally:
            torch.compile = real
    return megatron.core
