"""Without a GPU, the fused decode's kernel tests run in Triton's interpreter, in a subprocess.

Triton decides when a kernel is decorated (its own `tl.max`, `tl.rand`, ... included)
whether it is interpreted, so TRITON_INTERPRET=1 must be set before triton is first
imported; in this process transformers may already have imported it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..._triton_interpreter import INTERPRETED

KERNEL_TESTS = [
    Path(__file__).with_name(name) for name in ("test_decode_kernels.py", "test_weight_change_kernel.py")
]
INTERPRETER_NUMPY_WARNING = "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
"""Triton 3.6's interpreter turns a loop bound loaded from memory (a one-element array) into an int
the way NumPy >= 1.25 deprecates; Triton 3.8's does not. Only the interpreter does this: a compiled
kernel never meets NumPy."""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() or INTERPRETED, reason="the kernel tests run in this process")
def test_the_kernel_tests_pass_in_tritons_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "pytest", *map(str, KERNEL_TESTS), "-q", "-p", "no:cacheprovider", "-x"]
    proc = subprocess.run(
        [*command, "-W", INTERPRETER_NUMPY_WARNING],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-3000:]
