"""Faults in a real run of `ppo-driver demo` on CPU (Ray, Megatron workers, the embedded engine).

- The engine's process is killed during a `generate` (fault point `engine.generate`, the
  second call: rollout 1, after a weight update): it is restarted on its bundle, gets the
  actor's current weights, generates its prompts again, and the run finishes; the
  metrics and the event log record the restart.
- kill -9 of the driver between the critic's save and the actor's (the critic one
  checkpoint ahead), then a critic whose process dies during its save: each start
  resumes from the last rollout that every part completed, with that rollout's data
  cursor; the parts in between are set aside, and the dead critic is named by role,
  rank and pid in one line, exit 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow


def demo(
    run_dir: Path, *flags: str, fault: str | None = None, once: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`ppo-driver demo` in a subprocess (a short run, evals of the starting and the last weights only,
    no TensorBoard), with a fault point."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_FAULT")}
    env |= {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    if fault is not None:
        env["TANDEM_FAULT_POINT"] = fault
    if once is not None:
        env["TANDEM_FAULT_ONCE"] = str(once)
    command = [
        sys.executable, "-m", "tandem.ppo.app.cli", "demo", "--run-dir", str(run_dir), "--no-progress",
        "--eval-interval", "1000", "--no-tensorboard", "--no-export-hf", *flags,
    ]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_an_engine_killed_during_generate_is_restarted_and_the_run_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = demo(
        run_dir,
        "--num-rollout",
        "2",
        "--no-eval-before-train",
        fault="engine.generate:call=2",
        once=tmp_path / "fired",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "fired").exists()  # the engine was killed
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    assert [m["engine/restarts"] for m in metrics] == [0.0, 1.0]
    assert metrics[-1]["engine/restarts_total"] == 1.0
    events = read_jsonl(run_dir / "events.jsonl")
    (restart,) = [e for e in events if e["event"] == "engine_restart"]
    assert restart["rank"] == 0 and restart["restarts"] == 1 and restart["weights_version"] == 1
    # It restarted with the base model's weights and got the actor's current ones: those of
    # the last weight sync (after step 0).
    synced = [e for e in events if e["event"] == "weights_received" and e["t"] < restart["t"]]
    assert restart["digest_after"] == synced[-1]["digests"][0] != restart["digest_before"]
    (step_1_end,) = [e["t"] for e in events if e["event"] == "step_end" and e["rollout_id"] == 1]
    assert restart["t"] < step_1_end
    assert "restarting it on its bundle (restart 1 of at most 3)" in proc.stderr


def _state(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())["data"]
    return data


def test_a_run_killed_during_saves_resumes_from_the_last_complete_rollout(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    flags = ("--num-rollout", "2", "--save-interval", "1")

    # 1. kill -9 of the driver once the critic has saved rollout 1 and the actor has not.
    first = demo(run_dir, *flags, fault="run_save.model:role=critic,rollout_id=1")
    assert first.returncode == -9, first.stderr[-4000:]
    assert (run_dir / "critic" / "iter_0000001" / "metadata.json").is_file()
    assert not (run_dir / "actor" / "iter_0000001").exists()
    killed_state = _state(run_dir / "driver" / "iter_0000001.json")

    # 2. The next start resumes after rollout 0 (not the critic's 1); this time the critic's
    #    process dies while it writes rollout 1's checkpoint.
    second = demo(run_dir, *flags, fault="checkpoint.written:role=critic,rollout_id=1")
    assert second.returncode == 1, second.stderr[-4000:]
    assert "resuming after rollout 0; set aside in " in second.stderr
    assert "critic/iter_0000001, driver/iter_0000001.json" in second.stderr
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("ppo-driver demo: error: critic rank 0 (pid "), second.stderr[-4000:]
    assert ") died: " in last and "Traceback" not in second.stderr
    # The same data cursor after rollout 1 as the killed run had: rollout 1 was drawn again.
    assert _state(run_dir / "driver" / "iter_0000001.json") == killed_state

    # 3. The next start resumes after rollout 0 again, sets the critic's half-written
    #    checkpoint aside, and finishes.
    third = demo(run_dir, *flags)
    assert third.returncode == 0, third.stderr[-4000:]
    assert "resuming after rollout 0; set aside in " in third.stderr
    assert "critic/iter_0000001.partial" in third.stderr
    for role in ("actor", "critic"):
        assert (run_dir / role / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert _state(run_dir / "driver" / "iter_0000001.json") == killed_state
    # The starting weights' eval once: the resumed starts do not log a second record of a step.
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [-1, 0, 1]
    aside = sorted(
        str(p.relative_to(run_dir / "set_aside")).split("/", 1)[1]
        for p in (run_dir / "set_aside").glob("*/*/*")
    )
    assert aside == [
        "critic/iter_0000001", "critic/iter_0000001.partial", "driver/iter_0000001.json", "driver/iter_0000001.json",
    ]  # fmt: skip

    # 4. Started again, the finished run says so at once (no Ray).
    again = demo(run_dir, *flags)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.startswith(f"run complete: {run_dir} holds every rollout (0..1)")
