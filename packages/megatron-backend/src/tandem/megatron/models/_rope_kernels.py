"""RoPE on CUDA as one Triton kernel a call: reads q (or k) once, writes it rotated once.

Why: Megatron's unfused RoPE launches about ten kernels for each of q and k, a layer and a
micro-batch, forward and backward (products, a negation, two concatenations, the cos and sin
of the angles); `torch.compile` fuses them but each compiled call costs the host its guards
(about a tenth of a millisecond), which on models below hidden size 2048 costs more than the
kernels save (docs/benchmarks.md, "Compiled calls against the host"). A Triton launch has
neither cost: one kernel forward, one backward, no guards.

How: `rope_rows` rotates every `(position, batch, head)` row of `t` (any strides over those
three dimensions, the channels contiguous) by its position's row of a cos and sin table,
rotate-half style on the first `rot_dim` channels, copying the rest. The table is computed
once per angles tensor (`rope_table`: Megatron computes the angles once a forward and
passes the same tensor to every layer) and kept for the next call; a packed row's positions
(each token's place in its sample) once per `cu_seqlens` (`packed_positions`).

Numerics are Megatron's bf16 ones exactly: each product is rounded to `t`'s dtype before the
sum (as eager rounds `t * cos` and `rotate_half(t) * sin`), and the backward rounds
`g * cos` and `g * sin` likewise before their sum, so outputs and gradients are bit-identical
to Megatron's unfused RoPE, in bf16 and fp32 alike (tests/megatron/test_rope_kernels.py). The
kernel is compiled without fused multiply-adds (`enable_fp_fusion=False`): with them the compiler
turns a rounded product and its sum into one `fma.rn.bf16`, one rounding where eager has two, and
about one output in a few differs from Megatron's by one bf16 step (seen on an H100).

Imported only where Triton is (CUDA hosts, or its interpreter, `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

COMPILE_OPTIONS = {"enable_fp_fusion": False}
"""No fused multiply-add: the compiler would otherwise turn a rounded product and its sum into one
`fma.rn.bf16` (one rounding where eager rounds twice): 1-ulp differences from Megatron's RoPE, seen
on an H100 and in the kernel's PTX (tests/megatron/test_rope_kernels.py)."""

_ROWS_PER_PROGRAM_ELEMENTS = 4096
"""Channels a program handles at most (rows × half the rotated channels): a power of two."""


@triton.jit
def _rope_rows_kernel(
    t_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    rows,
    batch,
    heads,
    t_stride_s,
    t_stride_b,
    t_stride_h,
    out_stride_s,
    out_stride_b,
    out_stride_h,
    table_stride,
    half,
    rest,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    live = row < rows
    head = row % heads
    b = (row // heads) % batch
    s = row // (heads * batch)
    src = t_ptr + s * t_stride_s + b * t_stride_b + head * t_stride_h
    dst = out_ptr + s * out_stride_s + b * out_stride_b + head * out_stride_h
    if HAS_POSITIONS:  # noqa: SIM108 (a constexpr branch of the kernel)
        position = tl.load(pos_ptr + s, mask=live, other=0).to(tl.int64)
    else:
        position = s
    table = position * table_stride

    ch = tl.arange(0, BLOCK_HALF)
    mask = live[:, None] & (ch < half)[None, :]
    x1 = tl.load(src[:, None] + ch[None, :], mask=mask, other=0.0)
    x2 = tl.load(src[:, None] + half + ch[None, :], mask=mask, other=0.0)
    cos1 = tl.load(cos_ptr + table[:, None] + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table[:, None] + half + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table[:, None] + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table[:, None] + half + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # Each product rounded to t's dtype before the sum, as eager rounds each product tensor.
    if BACKWARD:
        # g = (g1, g2): d x1 = g1 cos1 + g2 sin2, d x2 = g2 cos2 - g1 sin1.
        y1 = (a1 * cos1).to(dtype).to(tl.float32) + (a2 * sin2).to(dtype).to(tl.float32)
        y2 = (a2 * cos2).to(dtype).to(tl.float32) - (a1 * sin1).to(dtype).to(tl.float32)
    else:
        y1 = (a1 * cos1).to(dtype).to(tl.float32) - (a2 * sin1).to(dtype).to(tl.float32)
        y2 = (a2 * cos2).to(dtype).to(tl.float32) + (a1 * sin2).to(dtype).to(tl.float32)
    tl.store(dst[:, None] + ch[None, :], y1.to(dtype), mask=mask)
    tl.store(dst[:, None] + half + ch[None, :], y2.to(dtype), mask=mask)
    if HAS_PASS:
        other = tl.arange(0, BLOCK_PASS)
        other_mask = live[:, None] & (other < rest)[None, :]
        kept = tl.load(src[:, None] + 2 * half + other[None, :], mask=other_mask, other=0.0)
        tl.store(dst[:, None] + 2 * half + other[None, :], kept, mask=other_mask)


def rope_rows(t: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, *, backward: bool) -> Tensor:
    """`t` rotated (or, `backward`, a gradient rotated back) by its rows of the (cos, sin) table.

    Shape: `t` `(s, b, heads, d)`, any strides but the channels' (copied contiguous if not 1);
    `cos`, `sin` `(rows, rot_dim)` contiguous in `t`'s dtype, `rot_dim` even and at most `d`;
    `positions` None (row `i` of `s` reads table row `i`) or `(s,)` integers (table rows).
    Returns a new contiguous tensor like `t`.
    """
    if t.stride(-1) != 1:
        t = t.contiguous()
    seq, batch, heads, channels = t.shape
    rot_dim = cos.shape[-1]
    out = torch.empty((seq, batch, heads, channels), dtype=t.dtype, device=t.device)
    rows = seq * batch * heads
    if rows == 0:
        return out
    half, rest = rot_dim // 2, channels - rot_dim
    block_half = triton.next_power_of_2(half)
    block_rows = max(1, min(64, _ROWS_PER_PROGRAM_ELEMENTS // block_half))
    grid = (triton.cdiv(rows, block_rows),)
    _rope_rows_kernel[grid](
        t,
        out,
        cos,
        sin,
        positions if positions is not None else cos,
        rows,
        batch,
        heads,
        t.stride(0),
        t.stride(1),
        t.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        cos.stride(0),
        half,
        rest,
        BLOCK_ROWS=block_rows,
        BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(max(rest, 1)),
        HAS_PASS=rest > 0,
        HAS_POSITIONS=positions is not None,
        BACKWARD=backward,
        **COMPILE_OPTIONS,
    )
    return out


class _Rope(torch.autograd.Function):
    """`rope_rows` with its backward (the rotation by the opposite angle, rounded as eager)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None) -> Tensor:
        ctx.save_for_backward(cos, sin, positions)
        return rope_rows(t, cos, sin, positions, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        cos, sin, positions = ctx.saved_tensors
        return rope_rows(grad, cos, sin, positions, backward=True), None, None, None


def rotate(t: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None = None) -> Tensor:
    """`rope_rows` forward, differentiable where `t` needs a gradient (`t` `(s, b, heads, d)`)."""
    if torch.is_grad_enabled() and t.requires_grad:
        return _Rope.apply(t, cos, sin, positions)
    return rope_rows(t, cos, sin, positions, backward=False)


class _LastOf:
    """The value last computed from one tensor, reused while that tensor is the same object
    with the same contents (`_version`) and the other key parts match; one entry, thread-safe.

    The entry holds the tensor itself, so its `id` cannot be reused for another while cached."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple[Tensor, int, Any, Any] | None = None

    def get(self, source: Tensor, key: Any) -> Any:
        with self._lock:
            entry = self._entry
        if entry is not None and entry[0] is source and entry[1] == source._version and entry[2] == key:
            return entry[3]
        return None

    def put(self, source: Tensor, key: Any, value: Any) -> Any:
        with self._lock:
            self._entry = (source, source._version, key, value)
        return value


_tables = _LastOf()
_positions = _LastOf()


def rope_table(freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles `freqs` (`(s, 1, 1, rot_dim)`, fp32) as `(s, rot_dim)` tables in
    `dtype`, computed in `freqs`' dtype and rounded as Megatron does; kept for the next call
    with the same `freqs` (every layer of a forward passes the same tensor)."""
    cached = _tables.get(freqs, dtype)
    if cached is not None:
        return cached
    flat = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    table = (torch.cos(flat).to(dtype).contiguous(), torch.sin(flat).to(dtype).contiguous())
    return _tables.put(freqs, dtype, table)


def packed_positions(cu_seqlens: Tensor, tokens: int) -> Tensor:
    """Each token's position inside its sample, `(tokens,)` int32, from a packed row's
    `cu_seqlens` (`searchsorted`: no loop over samples, no host sync); kept for the next call
    with the same `cu_seqlens` (q and k of every layer)."""
    cached = _positions.get(cu_seqlens, tokens)
    if cached is not None:
        return cached
    index = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    sample = torch.searchsorted(cu_seqlens, index, right=True) - 1
    return _positions.put(cu_seqlens, tokens, (index - cu_seqlens[sample]).to(torch.int32))
