"""The train step's per-token-loss path gives the gradients of the aggregation it replaced (CPU, gloo).

`_scripts/grad_equivalence.py` runs one optimizer step's gradient both ways, in
two fresh processes, under data parallel 2 and under pipeline parallel 2, for
both roles and both loss aggregation modes; the gradients are compared here.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "_scripts"
PHASES = ("1x1", "1x2")  # two processes: data parallel 2, then pipeline parallel 2


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, random_llama: Callable[..., None]) -> Path:
    work = tmp_path_factory.mktemp("grads")
    random_llama(
        work / "hf",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    command = [sys.executable, str(SCRIPTS / "launch.py"), "2", str(SCRIPTS / "grad_equivalence.py")]
    proc = subprocess.run(
        [*command, str(work), ",".join(PHASES)], capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return work / "out"


@pytest.mark.parametrize("mode", ["sample_mean", "token_mean"])
@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("phase", PHASES)
def test_gradients_equal_the_previous_aggregation(run: Path, phase: str, role: str, mode: str) -> None:
    biggest = 0.0
    for rank in (0, 1):
        saved: dict[str, Any] = torch.load(run / f"{phase}-{role}-{mode}-rank{rank}.pt")
        old, new = saved["old"], saved["new"]
        assert old.keys() == new.keys() and old
        for name in old:
            torch.testing.assert_close(
                new[name], old[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
            )
            biggest = max(biggest, float(old[name].abs().max()))
    # The comparison is of real gradients, not of two zeros.
    assert biggest > 1e-4
