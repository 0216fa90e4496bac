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
- SIGTERM (a scheduler's preemption) finishes the step and saves it, exit 143; checkpoints
  that do not read (a shard truncated to 0 bytes, an emptied driver state) are set aside
  and named, and the run resumes from the newest that reads; a full disk during a save
  (ENOSPC from the fault point) stops the run in one line, keeping the last checkpoint.

Each start is a `ppo-driver demo` process of its own: the signals, the kill -9 and the
faults in the workers are the command's to handle; each test serves several checks with
one run folder.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow


def demo_command(
    run_dir: Path, *flags: str, fault: str | None = None, once: Path | None = None, action: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """`ppo-driver demo` (a short run, evals of the starting and the last weights only, no TensorBoard),
    with a fault point, and its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_FAULT")}
    env |= {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    if fault is not None:
        env["TANDEM_FAULT_POINT"] = fault
    if once is not None:
        env["TANDEM_FAULT_ONCE"] = str(once)
    if action is not None:
        env["TANDEM_FAULT_ACTION"] = action
    command = [
        sys.executable, "-m", "tandem.ppo.app.cli", "demo", "--run-dir", str(run_dir), "--no-progress",
        "--eval-interval", "1000", "--no-tensorboard", "--no-export-hf", *flags,
    ]  # fmt: skip
    return command, env


def demo(run_dir: Path, *flags: str, **faults: Any) -> subprocess.CompletedProcess[str]:
    """`demo_command` run to its end in a subprocess."""
    command, env = demo_command(run_dir, *flags, **faults)
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


def test_sigterm_unreadable_checkpoints_and_a_full_disk_in_one_run_folder(tmp_path: Path) -> None:
    from tandem.megatron.runtime.checkpoint_folder import read_latest

    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"

    # 1. SIGTERM once steps 0..2 are logged: the step under way finishes and is saved, exit 143.
    command, env = demo_command(run_dir, "--num-rollout", "200", "--save-interval", "1")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 4:  # the eval before, steps 0..2
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-4000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err[-4000:]
    last = err.strip().splitlines()[-1]
    match = re.fullmatch(
        rf"ppo-driver demo: stopped by SIGTERM\. interrupted after rollout (\d+) \(saved: rollout \1, in "
        rf"{re.escape(str(run_dir))}; the same command resumes it\)",
        last,
    )
    assert match is not None, err[-4000:]
    k = int(match.group(1))
    assert k >= 2 and read_latest(run_dir / "actor") == k == read_latest(run_dir / "critic")
    assert [m["step"] for m in read_jsonl(metrics)] == list(range(-1, k + 1))
    assert "SIGTERM received" not in err  # Ray's handler, and its C++ stack dump, stayed out of it

    # 2. The newest checkpoint's actor shard truncated to 0 bytes, the one before's driver state emptied:
    #    the next start names both, resumes after k - 2, and its first save finds the disk full.
    shard = run_dir / "actor" / f"iter_{k:07d}" / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(b"")
    state = run_dir / "driver" / f"iter_{k - 1:07d}.json"
    state.write_text("")
    second = demo(
        run_dir, "--num-rollout", str(k + 1), "--save-interval", "1",
        fault=f"checkpoint.writing:role=critic,rollout_id={k - 1}", action="enospc",
    )  # fmt: skip
    assert second.returncode == 1, second.stderr[-4000:]
    assert f"resuming after rollout {k - 2}; set aside in " in second.stderr
    assert f"does not read: {shard} is 0 bytes; it had {size} when its save completed" in second.stderr
    assert f"does not read: {state} does not read as the driver's state (not JSON" in second.stderr
    last = second.stderr.strip().splitlines()[-1]
    # The worker named by its process (Ray's error of the cause's class keeps the name in its text alone).
    assert re.match(
        rf"ppo-driver demo: error: a train worker \(pid \d+\): no space left on device at "
        rf"{re.escape(str(run_dir / 'critic'))}: the save needs about ",
        last,
    ), second.stderr[-4000:]
    assert f"the last complete checkpoint (rollout {k - 2}) is kept" in last
    assert "Traceback" not in second.stderr
    assert read_latest(run_dir / "critic") == k - 2 == read_latest(run_dir / "actor")
    assert not list((run_dir / "critic").glob("*.partial"))

    # Set aside, never deleted; the next start resumes from there (as after any failed save, above).
    aside = {p.name for p in (run_dir / "set_aside").glob("*/*/*")}
    assert {f"iter_{k:07d}", f"iter_{k - 1:07d}.json"} <= aside
