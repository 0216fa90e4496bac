"""Without a GPU, the Megatron backend's Triton kernel tests (`triton_kernels`) run in Triton's interpreter.

One subprocess for all of them: TRITON_INTERPRET=1 must be set before triton is first imported,
which this process has done already.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .._triton_interpreter import INTERPRETED

KERNEL_TESTS = [Path(__file__).with_name(name) for name in ("test_rope_kernels.py", "test_swiglu.py")]


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available() or INTERPRETED, reason="the kernel tests run in their own files"
)
def test_the_kernel_tests_pass_in_tritons_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "pytest", *map(str, KERNEL_TESTS), "-m", "triton_kernels"]
    proc = subprocess.run(
        [*command, "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # The four RoPE kernel tests and the two SwiGLU ones, none skipped.
    assert "6 passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-3000:]
