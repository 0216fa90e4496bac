"""The Triton kernels of `swiglu`: one program a block of rows and columns of the MLP's width.

Imported only where Triton is (CUDA hosts, or its interpreter, `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

COMPILE_OPTIONS = {"enable_fp_fusion": False}
"""Each product and sum rounded on its own, as eager's separate kernels round them."""

_BLOCK_ROWS = 16
_BLOCK_COLS = 256


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter has no libdevice: there `exp` is NumPy's."""


@triton.jit
def _exp(a, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(a)  # CUDA's expf, as torch's kernels call it
    return tl.exp(a)


@triton.jit
def _sigmoid(a, LIBDEVICE: tl.constexpr):
    # torch's CUDA SiLU: 1 / (1 + expf(-x)) in fp32, the division rounded to nearest.
    return tl.div_rn(1.0, 1.0 + _exp(-a, LIBDEVICE))


@triton.jit
def _halves(x_ptr, rows, width, x_stride, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """This program's block: its rows and columns, their mask, and the block of each half of `x`."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (row < rows)[:, None] & (col < width)[None, :]
    src = x_ptr + row[:, None] * x_stride + col[None, :]
    return row, col, mask, tl.load(src, mask=mask, other=0.0), tl.load(src + width, mask=mask, other=0.0)


@triton.jit
def _forward_kernel(
    x_ptr,
    y_ptr,
    rows,
    width,
    x_stride,
    y_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row, col, mask, x1, x2 = _halves(x_ptr, rows, width, x_stride, BLOCK_ROWS, BLOCK_COLS)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    s = tl.div_rn(a, 1.0 + _exp(-a, LIBDEVICE)).to(dtype)  # torch's x / (1 + expf(-x)), rounded as eager
    y = s.to(tl.float32) * x2.to(tl.float32)
    tl.store(y_ptr + row[:, None] * y_stride + col[None, :], y.to(dtype), mask=mask)


@triton.jit
def _backward_kernel(
    g_ptr,
    x_ptr,
    dx_ptr,
    rows,
    width,
    g_stride,
    x_stride,
    dx_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row, col, mask, x1, x2 = _halves(x_ptr, rows, width, x_stride, BLOCK_ROWS, BLOCK_COLS)
    g = tl.load(g_ptr + row[:, None] * g_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    s = tl.div_rn(a, 1.0 + _exp(-a, LIBDEVICE)).to(dtype).to(tl.float32)
    # The multiply's backward, each product rounded as eager's tensors are.
    dx2 = (g * s).to(dtype)
    ds = (g * x2.to(tl.float32)).to(dtype).to(tl.float32)
    # The SiLU's backward: dy * sigmoid * (1 + x * (1 - sigmoid)), in fp32.
    sig = _sigmoid(a, LIBDEVICE)
    dx1 = ds * sig * (1.0 + a * (1.0 - sig))
    dst = dx_ptr + row[:, None] * dx_stride + col[None, :]
    tl.store(dst, dx1.to(dtype), mask=mask)
    tl.store(dst + width, dx2, mask=mask)


def _rows(x: Tensor) -> Tensor:
    """`x` as a 2-D `(rows, 2F)` tensor whose last dimension is contiguous."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _grid(rows: int, width: int) -> tuple[int, int]:
    return (triton.cdiv(rows, _BLOCK_ROWS), triton.cdiv(width, _BLOCK_COLS))


def forward(x: Tensor) -> Tensor:
    """`silu(x1) * x2`, `(..., 2F)` -> `(..., F)`."""
    flat = _rows(x)
    rows, width = flat.shape[0], flat.shape[1] // 2
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows and width:
        _forward_kernel[_grid(rows, width)](
            flat,
            out,
            rows,
            width,
            flat.stride(0),
            out.stride(0),
            BLOCK_ROWS=_BLOCK_ROWS,
            BLOCK_COLS=_BLOCK_COLS,
            LIBDEVICE=not INTERPRETED,
            **COMPILE_OPTIONS,
        )
    return out.view(*x.shape[:-1], width)


def backward(grad: Tensor, x: Tensor) -> Tensor:
    """The gradient of `x` (`(..., 2F)`) from the output's gradient `grad` (`(..., F)`)."""
    flat, g = _rows(x), _rows(grad)
    rows, width = flat.shape[0], flat.shape[1] // 2
    dx = torch.empty_like(flat)
    if rows and width:
        _backward_kernel[_grid(rows, width)](
            g,
            flat,
            dx,
            rows,
            width,
            g.stride(0),
            flat.stride(0),
            dx.stride(0),
            BLOCK_ROWS=_BLOCK_ROWS,
            BLOCK_COLS=_BLOCK_COLS,
            LIBDEVICE=not INTERPRETED,
            **COMPILE_OPTIONS,
        )
    return dx.view(x.shape)


class SwiGLU(torch.autograd.Function):
    """`forward` with `backward`; keeps the input alone for the backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return forward(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return backward(grad, x)
