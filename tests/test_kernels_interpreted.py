"""Without a GPU, every Triton kernel's test (`triton_kernels`: the Megatron backend's RoPE and SwiGLU, the
engines' fused decode and weight-change kernels) runs in Triton's interpreter.

One subprocess for all of them: Triton decides when a kernel is decorated whether it is interpreted, so
TRITON_INTERPRET=1 must be set before triton is first imported, which this process (transformers, the
models) has done already.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from ._triton_interpreter import INTERPRETED

TESTS = Path(__file__).parent
KERNEL_TESTS = {
    TESTS / "megatron" / "test_rope_kernels.py": 4,
    TESTS / "megatron" / "test_swiglu.py": 2,
    TESTS / "ppo" / "engines" / "test_decode_kernels.py": None,
    TESTS / "ppo" / "engines" / "test_weight_change_kernel.py": None,
}
"""Each file with its count of kernel tests where it holds other tests too (None: every test of the file)."""
INTERPRETER_NUMPY_WARNING = "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
"""Triton 3.6's interpreter turns a loop bound loaded from memory (a one-element array) into an int
the way NumPy >= 1.25 deprecates; Triton 3.8's does not. Only the interpreter does this: a compiled
kernel never meets NumPy."""


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available() or INTERPRETED, reason="the kernel tests run in their own files"
)
def test_the_kernel_tests_pass_in_tritons_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "pytest", *map(str, KERNEL_TESTS), "-m", "triton_kernels", "-rA"]
    proc = subprocess.run(
        [
            *command,
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "-x",
            "-W",
            INTERPRETER_NUMPY_WARNING,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=TESTS.parent,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " skipped" not in proc.stdout, proc.stdout[-3000:]
    passed = Counter(re.findall(r"^PASSED (\S+?\.py)::", proc.stdout, re.MULTILINE))
    for path, count in KERNEL_TESTS.items():
        name = str(path.relative_to(TESTS.parent))
        assert passed[name] == count if count is not None else passed[name] > 0, (name, dict(passed))
