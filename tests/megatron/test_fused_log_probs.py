"""`fused_log_probs` (the Triton kernels, under Triton's CPU interpreter) against `vocab_parallel_log_probs`.

One subprocess with `TRITON_INTERPRET=1` runs the kernels on drawn cases (any row count,
vocabulary slice, padding, temperature, logit scale, dtype, with and without the entropy):
log-probs and entropies equal the plain-autograd reference on the logits cast to fp32 to
fp32 rounding, and the gradients of random upstream gradients of both outputs are within
the bound `test_chunked_log_probs.assert_grads_close` derives. The TP-2 run is
`test_chunked_log_probs.py::test_two_tensor_parallel_ranks_equal_the_whole_vocabulary[fused]`.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# `one_rank`: that module's gloo world (an autouse fixture), which the reference needs here too.
from .test_chunked_log_probs import assert_grads_close, grads_of, one_rank, reference  # noqa: F401

SCRIPTS = Path(__file__).parent / "_scripts"


def drawn_cases(count: int, seed: int) -> list[dict[str, Any]]:
    """`count` cases as `test_chunked_log_probs.cases` draws them, from a seeded generator."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        n, vocab_local = rng.randint(1, 24), rng.randint(2, 300)
        vocab_size = rng.choice([None, rng.randint(1, vocab_local)])
        dtype = rng.choice([torch.float32, torch.bfloat16])
        generator = torch.Generator().manual_seed(rng.randint(0, 2**31 - 1))
        scale = rng.choice([0.1, 1.0, 5.0, 30.0])
        cases.append(
            {
                "logits": (torch.randn(n, vocab_local, generator=generator) * scale).to(dtype),
                "targets": torch.randint(0, vocab_size or vocab_local, (n,), generator=generator),
                "upstream": [torch.randn(n, generator=generator), torch.randn(n, generator=generator)],
                "temperature": rng.choice([1.0, 0.7, 0.3, 1.5, 3.0]),
                "vocab_size": vocab_size,
                "with_entropy": rng.random() < 0.7,
            }
        )
    return cases


@pytest.mark.slow
def test_the_kernels_equal_the_reference(tmp_path: Path) -> None:
    cases = drawn_cases(40, seed=7)
    torch.save(cases, tmp_path / "cases.pt")
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "fused_log_probs_check.py"),
            str(tmp_path / "cases.pt"),
            str(tmp_path / "out.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, TRITON_INTERPRET="1"),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    results = torch.load(tmp_path / "out.pt")
    assert len(results) == len(cases)
    for i, (case, got) in enumerate(zip(cases, results, strict=True)):
        logits = case["logits"].clone().requires_grad_()
        want = reference(
            logits, case["targets"], case["temperature"], case["vocab_size"], case["with_entropy"]
        )
        torch.testing.assert_close(got["log_probs"], want[0], rtol=1e-5, atol=1e-5, msg=f"case {i}")
        if case["with_entropy"]:
            assert want[1] is not None
            torch.testing.assert_close(got["entropy"], want[1], rtol=1e-5, atol=1e-5, msg=f"case {i}")
        else:
            assert got["entropy"] is None
        want_grad = grads_of(want, logits, case["upstream"])
        assert got["grad"].dtype == logits.dtype
        assert_grads_close(got["grad"], want_grad, case["logits"], case["upstream"], case["temperature"])
        if case["vocab_size"] is not None:
            assert not got["grad"][:, case["vocab_size"] :].any(), (
                f"case {i}: gradient in the padding columns"
            )
