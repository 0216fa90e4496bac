"""The Triton SwiGLU (`models.swiglu`, `_swiglu_kernels`) against Megatron's eager SwiGLU, and its hook.

The kernel tests (`kernel_test`) run on CUDA on a GPU; without one, tests/test_kernels_interpreted.py
runs them in a subprocess under Triton's interpreter, its bf16 casts made the GPU's.

- Drawn shapes and dtypes (hypothesis): values and gradients as eager's, each within one rounding
  of it and most bit for bit (the forward computes as torch's SiLU does; the SiLU's backward may
  fuse differently than torch's kernel); an error of the kernels (a swapped half, a sign) is
  orders larger.
- Autograd keeps the MLP's input alone, where eager keeps the SiLU's output beside it.
- `bias_swiglu_impl` routes: no bias on CUDA to the kernels, no bias elsewhere to the eager
  SwiGLU, a bias (or fp8, offload) to Megatron's own; `install()` puts it in Megatron's MLP.
- A model with the hook against one with Megatron's eager SwiGLU, in the RoPE check's process
  (`model_checks`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.models import swiglu

from .._triton_interpreter import DEVICE, INTERPRETED, kernel_test, patch_interpreter_numerics


@pytest.fixture(autouse=True)
def _gpu_numerics(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRETED:
        patch_interpreter_numerics(monkeypatch)


def _values_and_grad(fn: Any, x: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.detach().clone().requires_grad_()
    out = fn(leaf)
    out.backward(upstream)
    assert leaf.grad is not None
    return out.detach(), leaf.grad


def _assert_within_one_rounding(ours: torch.Tensor, eager: torch.Tensor) -> None:
    assert ours.shape == eager.shape and ours.dtype == eager.dtype
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-6)
        return
    step = torch.finfo(ours.dtype).eps  # one step of the mantissa, relative
    error = (ours.float() - eager.float()).abs()
    assert bool((error <= step * eager.float().abs() + 1e-30).all()), error.max().item()
    assert (ours != eager).float().mean().item() <= 0.02  # a few in a hundred at most


@kernel_test
@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    width=st.integers(1, 700),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    scale=st.sampled_from([0.5, 3.0, 12.0]),
    seed=st.integers(0, 2**16),
)
def test_the_kernels_compute_what_eager_does(
    rows: list[int], width: int, dtype: torch.dtype, scale: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*rows, 2 * width, generator=gen) * scale).to(DEVICE, dtype)
    upstream = torch.randn(*rows, width, generator=gen).to(DEVICE, dtype)
    ours = _values_and_grad(swiglu.swiglu, x, upstream)
    eager = _values_and_grad(swiglu.swiglu_eager, x, upstream)
    for a, b in zip(ours, eager, strict=True):
        _assert_within_one_rounding(a, b)


@kernel_test
def test_autograd_keeps_the_input_alone() -> None:
    x = torch.randn(4, 2, 64).to(DEVICE, torch.bfloat16).requires_grad_()
    kept: dict[str, list[int]] = {"ours": [], "eager": []}
    for name, fn in (("ours", swiglu.swiglu), ("eager", swiglu.swiglu_eager)):

        def pack(t: torch.Tensor, sizes: list[int] = kept[name]) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x)
    assert kept["ours"] == [x.numel()]
    assert sum(kept["eager"]) > x.numel()  # the SiLU's output (or its input) kept besides


def test_the_hook_routes_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    megatron_calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(swiglu, "_megatron_impl", lambda *a: megatron_calls.append(a) or torch.zeros(1))
    kernel_calls: list[torch.Tensor] = []
    monkeypatch.setattr(swiglu, "swiglu", lambda x: kernel_calls.append(x) or torch.ones(1))
    x = torch.randn(3, 2, 8)
    # On CPU with KERNELS "auto": the eager SwiGLU, neither the kernels nor Megatron's compiled one.
    assert torch.equal(swiglu.bias_swiglu_impl(x, None), swiglu.swiglu_eager(x))
    assert not kernel_calls and not megatron_calls
    monkeypatch.setattr(swiglu, "KERNELS", "triton")
    swiglu.bias_swiglu_impl(x, None)
    assert len(kernel_calls) == 1
    bias = torch.zeros(8)
    for args in ((x, bias, False, False), (x, None, True, False), (x, None, False, True)):
        swiglu.bias_swiglu_impl(*args)
    assert len(kernel_calls) == 1 and len(megatron_calls) == 3
    # From `install(min_elements)` on, smaller inputs run eager and the rest by the kernels.
    monkeypatch.setattr(swiglu, "_min_elements", x.numel() + 1)
    assert torch.equal(swiglu.bias_swiglu_impl(x, None), swiglu.swiglu_eager(x))
    large = torch.randn(3, 3, 8)
    swiglu.bias_swiglu_impl(large, None)
    assert [t.shape for t in kernel_calls] == [x.shape, large.shape]


@pytest.mark.slow
def test_install_puts_the_hook_in_megatrons_mlp() -> None:
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp

    before = mlp.bias_swiglu_impl
    try:
        swiglu.install(min_elements=swiglu.MIN_ELEMENTS)
        assert swiglu._min_elements == swiglu.MIN_ELEMENTS
        swiglu.install()  # idempotent: Megatron's own function is still what the hook falls back to
        assert swiglu.installed() and mlp.bias_swiglu_impl is swiglu.bias_swiglu_impl
        assert swiglu._megatron_impl is fused_bias_swiglu.bias_swiglu_impl
        assert swiglu._min_elements == 0, "the last install's size"
    finally:
        mlp.bias_swiglu_impl = before
    assert not swiglu.installed()


@pytest.mark.slow
def test_a_model_with_the_hook_computes_what_megatrons_eager_swiglu_does(
    model_checks: dict[Any, Any],
) -> None:
    """`_scripts/swiglu_check.py`, in rope_check.py's process (`model_checks`: Megatron's world):
    `fused_swiglu=True` turns `bias_activation_fusion` on and every MLP calls the hook; on the CPU (the eager
    SwiGLU) the logits and gradients equal those of `fused_swiglu=False` bit for bit, on CUDA (the kernels, an
    fp32 model) to fp32's rounding; the control without SiLU moves the logits."""
    r = model_checks["swiglu"]
    assert r["bias_activation_fusion:True"] and not r["bias_activation_fusion:False"] and r["installed"]
    # Per forward, one call an MLP, 2 layers: 3 forwards with a backward and one without.
    assert r["calls"] == {"bias_swiglu_impl": 8}
    unfused, fused = r[False], r[True]
    assert unfused.keys() == fused.keys() and len(unfused) > 20
    for name, expected in unfused.items():
        if torch.cuda.is_available():
            torch.testing.assert_close(fused[name], expected, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(fused[name], expected), name
    expected = unfused["sbhd_no_grad:logits"]
    assert (r["no_silu:logits"] - expected).abs().max().item() > 1e-3 * expected.abs().max().item()


def test_the_kernels_are_on_by_default_where_the_model_is_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fused_swiglu` None (`WorkerConfig`'s default) runs the kernels on CUDA with Triton, eager on CPU
    or without Triton; True and False are taken as given; `build_model` refuses anything else."""
    import dataclasses
    import importlib.util

    from tandem.megatron.config import WorkerConfig
    from tandem.megatron.models import build_model
    from tandem.megatron.models.networks import swiglu_min_elements, uses_fused_swiglu

    assert {f.name: f for f in dataclasses.fields(WorkerConfig)}["fused_swiglu"].default is None
    assert uses_fused_swiglu(None, on_cuda=True) == (importlib.util.find_spec("triton") is not None)
    assert not uses_fused_swiglu(None, on_cuda=False)
    for on_cuda in (False, True):
        assert uses_fused_swiglu(True, on_cuda=on_cuda) and not uses_fused_swiglu(False, on_cuda=on_cuda)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    assert not uses_fused_swiglu(None, on_cuda=True)
    # None takes the calls of at least MIN_ELEMENTS (the size from which they ran faster), True every call.
    assert swiglu_min_elements(None) == swiglu.MIN_ELEMENTS > 0 and swiglu_min_elements(True) == 0
    spec: Any = None  # never reached: the arguments are checked first
    with pytest.raises(ValueError, match="fused_swiglu 'yes' must be True, False or None"):
        build_model(spec, "actor", fused_swiglu="yes")  # type: ignore[arg-type]
