"""Saving a model (CPU, gloo): a save starts no process; a model saved before its first step resumes exactly.

A synchronous save starts no process: Megatron's write results stay in the saving process.

Megatron's torch_dist writer would otherwise make a spawn-context `multiprocessing`
Manager at each process's first save (a fresh interpreter: seconds per actor and
critic process). `checkpoint.in_process_write_results` hands it a thread-safe queue;
the saves still publish complete checkpoints.

A model saved before its first optimizer step (the actor during a critic-only
warm-up) has no optimizer state in its checkpoint; resumed from it, it trains on
to the same weights and optimizer state as the run that never stopped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "_scripts"


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory, random_llama: Callable[..., None]) -> Path:
    """A small random Llama folder, shared by the tests of this module."""
    folder = tmp_path_factory.mktemp("hf")
    random_llama(
        folder,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    return folder


def test_a_save_starts_no_process_and_publishes_the_checkpoint(tmp_path: Path, hf: Path) -> None:
    out, save = tmp_path / "save.json", tmp_path / "save"
    command = [sys.executable, str(SCRIPTS / "launch.py"), "1", str(SCRIPTS / "save_in_process_check.py")]
    proc = subprocess.run(
        [*command, str(hf), str(save), str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["started"] == [], result["started"]
    assert result["in_process"], result["queue"]
    assert result["complete"] == ["iter_0000000", "iter_0000001", "latest_checkpointed_iteration.txt"]
    for rollout in (0, 1):
        assert (save / f"iter_{rollout:07d}" / "metadata.json").is_file()


def test_a_model_saved_before_its_first_step_resumes_and_trains_as_the_straight_run(
    tmp_path: Path, hf: Path
) -> None:
    script = [sys.executable, str(SCRIPTS / "launch.py"), "1", str(SCRIPTS / "resume_before_step_check.py")]
    for phase in ("straight", "resumed"):
        proc = subprocess.run(
            [*script, phase, str(hf), str(tmp_path / "ckpt"), str(tmp_path / f"{phase}.pt")],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, (phase, proc.stdout[-3000:] + proc.stderr[-6000:])
    straight, resumed = (
        torch.load(tmp_path / f"{p}.pt", weights_only=False) for p in ("straight", "resumed")
    )
    assert straight["metrics"] == resumed["metrics"]
    assert straight["state"].keys() == resumed["state"].keys()
    assert any(k.startswith("optimizer/") for k in straight["state"]), sorted(straight["state"])[:20]
    for key, value in straight["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=0, atol=0, msg=key)
