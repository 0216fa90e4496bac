"""SwiGLU in one Triton kernel forward and one backward, behind Megatron's `bias_swiglu_impl`.

Why: with `bias_activation_fusion` off (the default: Megatron's fusion is a compiled call, whose
host cost outweighs its saving at small hidden sizes, docs/design.md), Megatron's MLP runs
`silu(x1) * x2` eagerly: a SiLU kernel and a multiply forward, and backward two multiplies, the
SiLU's backward and a concatenation of the two halves' gradients, each a pass over memory. In the
0.5B actor's profile these were 0.29 s of a `train()`'s 1.54 s of kernels (docs/benchmarks.md).
Eager autograd also keeps the SiLU's output for the multiply's backward: a third tensor of the
MLP's width a layer and micro-batch, beside the input.

How: `swiglu(x)` with `x` `(..., 2F)`: forward reads `x` once and writes `silu(x1) * x2`; backward
reads the output's gradient and `x` and writes `x`'s gradient (both halves, no concatenation).
Autograd keeps `x` alone. Arithmetic in fp32, rounded where eager rounds: the SiLU's output to
`x`'s dtype before the product (so the forward equals eager's bit for bit: `exp` is libdevice's,
as torch's `expf`, and the division rounds to nearest), the two gradient products of the multiply
before the SiLU's backward. The SiLU's backward `dy * s * (1 + x * (1 - s))` rounds each step on
its own (no fused multiply-add), where torch's CUDA kernel lets the compiler fuse: the gradient of
`x1` may differ from eager's in its last bit.

`install(min_elements)` routes Megatron's `bias_swiglu_impl` (what an MLP with
`bias_activation_fusion=True` calls) here where there is no bias, no fp8 store or CPU offload, the
input is on CUDA (or, for the tests, `KERNELS = "triton"` under Triton's interpreter) and holds at
least `min_elements`; other inputs without a bias run the eager SwiGLU, and calls with a bias
Megatron's own function. `build_model` installs it where `fused_swiglu` is True (every size), or
None (`WorkerConfig`'s default) on CUDA (`networks.uses_fused_swiglu`), from `MIN_ELEMENTS` on.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["KERNELS", "MIN_ELEMENTS", "bias_swiglu_impl", "install", "installed", "swiglu", "swiglu_eager"]

KERNELS: Literal["auto", "triton"] = "auto"
"""Where `install()`'s hook runs the Triton kernels: "auto", on CUDA inputs; "triton", on CPU inputs
too (only under Triton's interpreter, `TRITON_INTERPRET=1`: the tests)."""

MIN_ELEMENTS = 160_000_000
"""The smallest MLP input, in elements of its `(..., 2F)`, that the kernels take under `fused_swiglu` None (the
default): about 16,400 tokens of the 0.5B model's 9,728-wide input; smaller calls run eager. A/B on one H100
(docs/benchmarks.md, "the SwiGLU kernels by the size of the call"), each pass's calls of one size: passes of
20,480 and 40,960 tokens a call ran faster with the kernels (the actor's update at micro batch 32 0.96 ->
0.86 s, the forward-only passes of 20,480 tokens 0.47 -> 0.38 s and 0.39 -> 0.30 s), passes of 10,240
tokens and fewer slower (the updates at micro batch 16, 1.24 -> 1.33 s and 1.09 -> 1.20 s; on the packed
path, micro-batches of about 6,200 tokens, 1.09 -> 1.24, 1.28 -> 1.38 and 1.25 -> 1.50 s), where the
trains' host sets the pace; packed forward-only calls of about 12,400 tokens ran alike or slower."""

_install_lock = threading.Lock()
_min_elements = 0
"""`install()`'s `min_elements`: the smallest input the kernels take."""
_megatron_impl: Any = None
"""Megatron's own `bias_swiglu_impl`, kept by `install()` for the calls the kernels do not take."""


def swiglu_eager(x: Tensor) -> Tensor:
    """Megatron's unfused SwiGLU, `silu(x1) * x2` of the two halves of `x`'s last dimension."""
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(x1) * x2


def swiglu(x: Tensor) -> Tensor:
    """`silu(x1) * x2` of the halves of `x`'s last dimension by the Triton kernels, differentiable.

    Shape: `x` `(..., 2F)` in fp32, bf16 or fp16 (copied contiguous if its last dimension is not);
    output `(..., F)`.
    """
    from tandem.megatron.models import _swiglu_kernels

    if torch.is_grad_enabled() and x.requires_grad:
        return _swiglu_kernels.SwiGLU.apply(x)
    return _swiglu_kernels.forward(x)


def _takes(x: Tensor, bias: Tensor | None, fp8_input_store: bool, cpu_offload_input: bool) -> bool:
    return (
        bias is None
        and not fp8_input_store
        and not cpu_offload_input
        and (x.is_cuda or KERNELS == "triton")
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and x.shape[-1] % 2 == 0
        and x.numel() >= _min_elements
    )


def bias_swiglu_impl(
    input: Tensor,
    bias: Tensor | None,
    fp8_input_store: bool = False,
    cpu_offload_input: bool = False,
) -> Tensor:
    """Megatron's `fused_bias_swiglu.bias_swiglu_impl`: the Triton kernels where they apply, the eager
    `swiglu_eager` for other inputs without a bias (Megatron's would compile, ~20 s on a CPU), and
    Megatron's own function for the rest (a bias, an fp8 store, a CPU offload)."""
    if _takes(input, bias, fp8_input_store, cpu_offload_input):
        return swiglu(input)
    if bias is None and not fp8_input_store and not cpu_offload_input:
        return swiglu_eager(input)
    return _megatron_impl(input, bias, fp8_input_store, cpu_offload_input)


def installed() -> bool:
    """Whether Megatron's MLP calls `bias_swiglu_impl` here (`install()` ran in this process)."""
    from megatron.core.transformer import mlp

    return mlp.bias_swiglu_impl is bias_swiglu_impl


def install(min_elements: int = 0) -> None:
    """Have Megatron's MLP (with `bias_activation_fusion=True`) call `bias_swiglu_impl` here; idempotent.

    Sets `megatron.core.transformer.mlp.bias_swiglu_impl`, which `MLP.forward` reads at call time,
    for every model of this process; the kernels take inputs of at least `min_elements` (the last
    install's, for the process: a worker builds one model), eager the smaller.
    """
    global _megatron_impl, _min_elements
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp

    with _install_lock:
        _megatron_impl = fused_bias_swiglu.bias_swiglu_impl
        _min_elements = min_elements
        mlp.bias_swiglu_impl = bias_swiglu_impl
