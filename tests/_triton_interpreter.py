"""Triton's interpreter in the tests: whether it runs, and its numerics made the GPU's.

Kernel tests run on a GPU, or without one in Triton's interpreter (`TRITON_INTERPRET=1`, set
before triton is first imported, hence in a subprocess of their own).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton kernels run in Triton's interpreter in this process (set before triton was imported)."""


def patch_interpreter_numerics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make two numerics of Triton's interpreter (triton 3.8) those of the GPU, until `monkeypatch` undoes it.

    fp32 -> bf16 casts truncate in the interpreter (the GPU, as torch, rounds to nearest
    even), and its `tl.dot` multiplies bf16 operands as their raw 16-bit patterns.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder: Any = interpreter.InterpreterBuilder
    cast_impl, create_dot = builder.cast_impl, builder.create_dot

    def as_fp32(handle: Any) -> Any:
        if handle.dtype != tl.bfloat16:
            return handle
        bits = np.ascontiguousarray(handle.data).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def rounding_cast(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return interpreter.TensorHandle(values.to(torch.bfloat16).view(torch.uint16).numpy(), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    def fp32_dot(self: Any, a: Any, b: Any, acc: Any, precision: Any, imprecise: Any) -> Any:
        return create_dot(self, as_fp32(a), as_fp32(b), acc, precision, imprecise)

    monkeypatch.setattr(builder, "cast_impl", rounding_cast)
    monkeypatch.setattr(builder, "create_dot", fp32_dot)


ON_GPU = torch.cuda.is_available() and not INTERPRETED
"""Kernel tests run on CUDA here."""

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def kernel_test(fn: Any) -> Any:
    """Mark `fn` a Triton kernel's test (`triton_kernels`): it runs on a GPU or in the interpreter,
    and is skipped elsewhere, where one interpreted subprocess runs them all."""
    skip = pytest.mark.skipif(
        not (ON_GPU or INTERPRETED),
        reason="no GPU: run in Triton's interpreter by tests/test_kernels_interpreted.py",
    )
    return pytest.mark.triton_kernels(skip(fn))
