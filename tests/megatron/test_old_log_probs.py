"""The actor's old log-probs and the critic's old values taken from their update's own forward
(`reuse_old_log_probs`, `reuse_old_values`).

`_scripts/old_log_probs_check.py` trains one rollout (one epoch, one optimizer step) with the
old log-probs computed by a forward pass of their own and taken from the update's forward, in
fresh processes (1 process, then 2 under data parallel 2 and under pipeline parallel 2), for
PPO's and GSPO's policy loss, then the critic with its old values computed and reused: the
losses, metrics and trained weights (and the critic's targets and the values it sends the
actor) must agree, with one forward-only pass fewer. The config's rule of when that is exact
is tested here directly.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.megatron.config import WorkerConfig

SCRIPTS = Path(__file__).parent / "_scripts"
RUNS = {"1x1": 1, "1x1,1x2": 2}  # phases (TPxPP) -> processes: one rank; DP 2; PP 2
PHASES = {"1x1-one": ("1x1", 1), "1x1-dp2": ("1x1", 2), "1x2": ("1x2", 2)}


@pytest.fixture(scope="module")
def out_dirs(tmp_path_factory: pytest.TempPathFactory, random_llama: Callable[..., None]) -> dict[int, Path]:
    dirs = {}
    for phases, nproc in RUNS.items():
        work = tmp_path_factory.mktemp(f"old-log-probs-{nproc}")
        random_llama(
            work / "hf",
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            max_position_embeddings=64,
        )
        command = [
            sys.executable,
            str(SCRIPTS / "launch.py"),
            str(nproc),
            str(SCRIPTS / "old_log_probs_check.py"),
        ]
        proc = subprocess.run([*command, str(work), phases], capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
        dirs[nproc] = work / "out"
    return dirs


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
@pytest.mark.parametrize("case", sorted(PHASES))
def test_old_log_probs_from_the_update_train_as_a_forward_of_their_own_does(
    out_dirs: dict[int, Path], case: str, loss_type: str
) -> None:
    phase, nproc = PHASES[case]
    for rank in range(nproc):
        saved: dict[str, Any] = torch.load(out_dirs[nproc] / f"{phase}-{loss_type}-rank{rank}.pt")
        computed_passes, reused_passes = saved.pop("forward_only_passes")
        # Old and reference log-probs, then the reference's alone: one whole forward fewer.
        assert (int(computed_passes), int(reused_passes)) == (2, 1)
        # The rollout figure of the old log-probs is not reported when they come from the update.
        assert saved["metric:log_prob"][1] is None
        del saved["metric:log_prob"]
        assert any(k.startswith("weights/") for k in saved) and saved["metric:grad_norm"][0] > 1e-3
        for name, (computed, reused) in saved.items():
            assert reused is not None, name
            torch.testing.assert_close(
                reused, computed, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PHASES))
def test_old_values_from_the_update_train_as_a_forward_of_their_own_does(
    out_dirs: dict[int, Path], case: str
) -> None:
    phase, nproc = PHASES[case]
    for rank in range(nproc):
        saved: dict[str, Any] = torch.load(out_dirs[nproc] / f"{phase}-critic-rank{rank}.pt")
        computed_passes, reused_passes = saved.pop("forward_only_passes")
        assert (int(computed_passes), int(reused_passes)) == (1, 0)  # no forward of their own
        assert any(k.startswith("weights/") for k in saved) and saved["metric:grad_norm"][0] > 1e-3
        # The last stage's targets and the values it sends the actor; other stages have none.
        last = phase == "1x1" or rank == nproc - 1
        assert {"old_values", "returns", "sent_values"} <= set(saved) if last else "returns" not in saved
        for name, (computed, reused) in saved.items():
            assert reused is not None, name
            torch.testing.assert_close(
                reused, computed, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


def _config(tmp_path: Path, random_llama: Callable[..., None], **fields: Any) -> WorkerConfig:
    hf = tmp_path / "hf"
    if not (hf / "config.json").is_file():
        random_llama(
            hf,
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            max_position_embeddings=64,
        )
    base: dict[str, Any] = {
        "hf_checkpoint": str(hf),
        "rollout_batch_size": 8,
        "global_batch_size": 8,
        "device": "cpu",
        "params_dtype": "float32",
    }
    return WorkerConfig(**{**base, **fields})


def test_the_old_log_probs_are_the_updates_own_only_for_one_epoch_and_one_step(
    tmp_path: Path, random_llama: Callable[..., None]
) -> None:
    assert _config(tmp_path, random_llama).reuses_old_log_probs
    not_redundant = {
        "ppo_epochs": {"ppo_epochs": 2},
        "global_batch_size": {"global_batch_size": 4},
        "kl_coef": {"kl_coef": 0.05},
        "use_tis": {"use_tis": True},
    }
    for field, fields in not_redundant.items():
        auto = _config(tmp_path, random_llama, **fields)
        assert not auto.reuses_old_log_probs, field
        assert field in (auto.old_log_probs_redundant() or ""), field
        with pytest.raises(ValueError, match=rf"^reuse_old_log_probs: .*{field}"):
            _config(tmp_path, random_llama, reuse_old_log_probs=True, **fields)
    assert not _config(tmp_path, random_llama, reuse_old_log_probs=False).reuses_old_log_probs


def test_the_old_values_are_the_updates_own_only_for_one_epoch_and_one_step(
    tmp_path: Path, random_llama: Callable[..., None]
) -> None:
    # kl_coef and use_tis change the actor's loss, not the critic's: its old values stay the update's own.
    assert _config(tmp_path, random_llama, kl_coef=0.05, use_tis=True).reuses_old_values
    for field, fields in {
        "ppo_epochs": {"ppo_epochs": 2},
        "global_batch_size": {"global_batch_size": 4},
    }.items():
        auto = _config(tmp_path, random_llama, **fields)
        assert not auto.reuses_old_values, field
        assert field in (auto.old_values_redundant() or ""), field
        with pytest.raises(ValueError, match=rf"^reuse_old_values: .*{field}"):
            _config(tmp_path, random_llama, reuse_old_values=True, **fields)
    assert not _config(tmp_path, random_llama, reuse_old_values=False).reuses_old_values
    with pytest.raises(ValueError, match=r"^reuse_old_values: got 'yes'"):
        _config(tmp_path, random_llama, reuse_old_values="yes")
