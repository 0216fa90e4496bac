"""megatron-core's fusions are compiled at their first call, not while megatron-core loads
(`tandem.megatron.models._megatron_core`): the same functions, compiled once, with their options."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from tandem.megatron.models._megatron_core import compile_on_first_call


def counting_compile() -> tuple[Callable[..., Any], list[tuple[Any, dict[str, Any]]]]:
    """A stand-in for torch.compile that records each compile and doubles the function's result."""
    made: list[tuple[Any, dict[str, Any]]] = []

    def compile_fn(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        made.append((fn, options))
        return lambda *a, **k: 2 * fn(*a, **k)

    return compile_fn, made


def test_nothing_is_compiled_until_the_first_call_and_then_once() -> None:
    compile_fn, made = counting_compile()
    deferred = compile_on_first_call(compile_fn)

    def add(a: int, b: int = 0) -> int:
        return a + b

    wrapped = deferred(add)
    assert made == [] and wrapped.__name__ == "add"
    assert wrapped(1, b=2) == 6  # the compiled function ran
    assert wrapped(3) == 6
    assert made == [(add, {})]


def test_torch_compiles_three_forms_keep_their_options() -> None:
    compile_fn, made = counting_compile()
    deferred = compile_on_first_call(compile_fn)

    def one() -> int:
        return 1

    as_factory = deferred(mode="max-autotune")(one)
    with_options = deferred(one, dynamic=True)
    assert made == []
    assert as_factory() == with_options() == 2
    assert made == [(one, {"mode": "max-autotune"}), (one, {"dynamic": True})]


def test_megatron_core_loads_without_dynamo_or_inductor_and_torch_compile_is_restored() -> None:
    """In a fresh interpreter (an import test needs one): what a worker process loads."""
    code = (
        "import json, sys, torch\n"
        "real = torch.compile\n"
        "from tandem.megatron.models._megatron_core import import_megatron_core\n"
        "core = import_megatron_core()\n"
        "import megatron.core.transformer, megatron.core.optimizer\n"
        "from megatron.core.fusions import fused_bias_swiglu\n"
        "print(json.dumps({'restored': torch.compile is real, 'core': core.__name__,\n"
        "  'inductor': 'torch._inductor.compile_fx' in sys.modules,\n"
        "  'wrapper': fused_bias_swiglu.swiglu.__code__.co_name}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["restored"] and seen["core"] == "megatron.core"
    assert not seen["inductor"], "megatron-core's import compiled its fusions"
    # Megatron's @jit_fuser kernel is our first-call wrapper (torch.compile's is dynamo's `_fn`).
    assert seen["wrapper"] == "call"
