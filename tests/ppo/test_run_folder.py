"""The run folder: locked while in use (stale locks taken over), fixed flags refused on resume, left as it was.

No Ray here: `RunFolder.open` runs before Ray starts, and these tests check that
it decides from the folder alone and writes nothing but its lock. The CLI tests
(tests/ppo/test_faults_cli.py) run the same cases through `ppo-driver train`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tandem.ppo.config import PPOConfig
from tandem.ppo.config.file import unvalidated, write_yaml
from tandem.ppo.run.folder import CONFIG_FILE, FIXED_ON_RESUME, RunFolder
from tandem.ppo.run.lock import LOCK_FILE, RunLock


def snapshot(root: Path) -> dict[str, tuple[int, float]]:
    """Every path under `root` with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime) for p in sorted(root.rglob("*"))}


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def config(run_dir: Path, hf_dir: Path, **overrides: Any) -> PPOConfig:
    values = {"hf_checkpoint": str(hf_dir), "prompt_data": str(hf_dir / "p.jsonl"), "run_dir": str(run_dir)}
    return unvalidated({**values, "export_hf": False, **overrides})


def finished_run(run_dir: Path, hf_dir: Path, rollouts: int, **overrides: Any) -> PPOConfig:
    """A run folder as a run of `rollouts` steps leaves it (checkpoint contents stubbed)."""
    cfg = config(run_dir, hf_dir, num_rollout=rollouts, **overrides)
    write_yaml(cfg, run_dir / CONFIG_FILE)
    for k in range(rollouts):
        for role in ("actor", "critic"):
            folder = run_dir / role / f"iter_{k:07d}"
            folder.mkdir(parents=True)
            (folder / "metadata.json").write_text("{}")
            (run_dir / role / "latest_checkpointed_iteration.txt").write_text(f"{k}\n")
        state = {
            "rollout_id": k,
            "data": {"epoch": 0, "cursor": k},
            "python_rng": [],
            "metrics": [{"step": k}],
        }
        (run_dir / "driver").mkdir(exist_ok=True)
        (run_dir / "driver" / f"iter_{k:07d}.json").write_text(json.dumps(state))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": k}) + "\n" for k in range(rollouts)))
    return cfg


# --- the lock -------------------------------------------------------------------------------------

HOLD = """
import sys, time
from tandem.ppo.run.lock import RunLock
RunLock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_run_is_refused_while_the_first_lives_and_a_dead_holders_lock_is_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            with pytest.raises(
                ValueError, match=rf"^--run-dir: .* is in use by another run, pid {holder.pid} on "
            ):
                RunLock.acquire(tmp_path)
        finally:
            holder.send_signal(signal.SIGKILL)  # kill -9: no cleanup, the lock file stays
            holder.wait(timeout=60)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # stale, left behind
    lock = RunLock.acquire(tmp_path)
    assert f"taking over the lock of pid {holder.pid}" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    # A second holder in this process is refused too (flock is per open file).
    with pytest.raises(ValueError, match=rf"in use by another run, pid {os.getpid()}"):
        RunLock.acquire(tmp_path)
    lock.release()
    lock.release()  # idempotent
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_file_of_a_dead_pid_without_a_flock_is_stale(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    info = {"pid": int(dead.stdout), "host": os.uname().nodename, "started": time.time()}
    (tmp_path / LOCK_FILE).write_text(json.dumps(info))
    lock = RunLock.acquire(tmp_path)
    assert lock.held
    lock.release()


# --- opening a run folder -------------------------------------------------------------------------


def test_a_failed_start_in_a_new_folder_leaves_no_folder(tmp_path: Path, hf_dir: Path) -> None:
    run_dir = tmp_path / "runs" / "new"
    folder = RunFolder.open(config(run_dir, hf_dir))
    assert (run_dir / LOCK_FILE).is_file() and folder.resume.rollout_id is None and not folder.complete
    folder.close()  # never committed: the start failed
    assert not run_dir.exists()


def test_changed_fixed_flags_are_refused_naming_them_and_the_folder_is_untouched(
    tmp_path: Path, hf_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    finished_run(run_dir, hf_dir, 2, lr=3e-3)
    before = snapshot(run_dir)
    changed = config(run_dir, hf_dir, num_rollout=4, lr=1e-3, tensor_model_parallel_size=2)
    with pytest.raises(ValueError) as info:
        RunFolder.open(changed)
    message = str(info.value)
    assert message.startswith("--lr, --tensor-model-parallel-size: cannot change when resuming")
    assert (
        "--lr was 0.003, now 0.001" in message
        and "These may change on resume: the run length (--num-rollout)" in message
    )
    assert "\n" not in message
    assert snapshot(run_dir) == before

    # What may change on resume: the run length, cadence, logging.
    folder = RunFolder.open(config(run_dir, hf_dir, num_rollout=4, lr=3e-3, save_interval=1, progress=False))
    assert folder.resume.rollout_id == 1 and not folder.complete
    critic = folder.critic_config()
    assert folder.actor_config().load_rollout_id == 1
    assert critic is not None and critic.load_rollout_id == 1
    folder.close()
    assert snapshot(run_dir) == before


def test_a_finished_run_is_complete_and_nothing_is_written(tmp_path: Path, hf_dir: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = finished_run(run_dir, hf_dir, 3)
    before = snapshot(run_dir)
    folder = RunFolder.open(cfg)
    assert folder.complete and folder.resume.rollout_id == 2
    folder.close()
    assert snapshot(run_dir) == before
    exporting = RunFolder.open(config(run_dir, hf_dir, num_rollout=3, export_hf=True))
    assert not exporting.complete  # the HF export is still to be written
    exporting.close()


def test_commit_sets_aside_the_critic_a_checkpoint_ahead_and_writes_the_config(
    tmp_path: Path, hf_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    finished_run(run_dir, hf_dir, 2)
    (run_dir / "actor" / "iter_0000001").rename(run_dir / "actor" / "iter_0000001.partial")
    (run_dir / "actor" / "latest_checkpointed_iteration.txt").write_text("0\n")
    folder = RunFolder.open(config(run_dir, hf_dir, num_rollout=3))
    assert folder.resume.rollout_id == 0
    critic = folder.critic_config()
    assert folder.actor_config().load_rollout_id == 0
    assert critic is not None and critic.load_rollout_id == 0
    folder.commit()
    folder.close()
    aside = sorted(
        str(p.relative_to(run_dir)).split("/", 2)[2] for p in (run_dir / "set_aside").glob("*/*/*")
    )
    assert aside == ["actor/iter_0000001.partial", "critic/iter_0000001", "driver/iter_0000001.json"]
    assert (run_dir / "critic" / "latest_checkpointed_iteration.txt").read_text() == "0\n"
    assert not (run_dir / LOCK_FILE).exists()


def test_a_fresh_start_loads_nothing_even_where_parts_exist(tmp_path: Path, hf_dir: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = finished_run(run_dir, hf_dir, 1)
    (run_dir / "driver" / "iter_0000000.json").unlink()
    folder = RunFolder.open(cfg)
    assert folder.resume.rollout_id is None
    for worker in (folder.actor_config(), folder.critic_config()):
        assert worker is not None
        assert worker.load is None and worker.critic_load is None and worker.load_rollout_id is None
    folder.close()


def test_every_fixed_flag_is_a_config_field() -> None:
    import dataclasses

    names = {f.name for f in dataclasses.fields(PPOConfig)}
    assert set(FIXED_ON_RESUME) <= names
    assert {"num_rollout", "save_interval", "load_rollout_id"}.isdisjoint(FIXED_ON_RESUME)
