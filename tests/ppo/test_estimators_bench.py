"""bench/estimators.py: its figures mean what they say, its GPU task is ppo_gpu_bench's, and a tiny run works.

Nothing is timed here: the runs only have to produce the figures, and the
figures have to agree with the runs' own event logs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "estimators.py"


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("estimators_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_seconds_axis_is_the_event_log_and_marks_pick_finished_steps() -> None:
    b = bench()
    events = [
        {"t": 100.0, "event": "step_begin", "rollout_id": 0},
        {"t": 102.0, "event": "step_end", "rollout_id": 0},
        {"t": 102.5, "event": "step_begin", "rollout_id": 1},
        {"t": 106.5, "event": "step_end", "rollout_id": 1},
    ]
    assert b.step_clock(events) == {0: (0.0, 2.0), 1: (2.5, 6.5)}
    fast = {"elapsed_s": [1.0, 2.0, 3.0, 4.0], "reward": [0.0, 1.0, 1.0, 1.0]}
    slow = {"elapsed_s": [3.0, 6.0, 9.0, 12.0], "reward": [0.0, 0.0, 1.0, 1.0]}
    for r in (fast, slow):
        r["reward_trailing"] = [b.trailing_mean(r["reward"], i, 2) for i in range(4)]
    table = b.compare({"fast": fast, "slow": slow}, window=2)
    assert table["step_marks"] == [1, 2, 4]
    assert table["second_marks"] == [1.0, 2.0, 4.0]  # fractions of the shorter run's 4 s
    assert table["runs"]["fast"]["at_steps"] == {"1": 0.0, "2": 0.5, "4": 1.0}
    assert table["runs"]["fast"]["at_seconds"]["2.0"] == {"reward": 0.5, "steps_done": 2}
    assert table["runs"]["slow"]["at_seconds"]["4.0"] == {"reward": 0.0, "steps_done": 1}
    assert table["runs"]["slow"]["at_seconds"]["1.0"] is None  # no step finished by then


@pytest.mark.slow
def test_the_gpu_task_is_ppo_gpu_bench_with_variable_length_responses(tmp_path: Path) -> None:
    b = bench()
    args = argparse.Namespace(quick=True, response_len=None, prompts=None, n_samples=4, steps=2, seed=1)
    values = b.qwen05b_task(args, tmp_path)
    harness = b._harness()
    assert harness.__file__ == str(ROOT / "bench" / "ppo_gpu_bench.py")
    assert values["custom_rm_path"].endswith("bench_reward.py:first_half_letters")
    assert (tmp_path / "bench_reward.py").read_text() == harness.REWARD_SOURCE
    assert values["rollout_ignore_eos"] is False and values["n_samples_per_prompt"] == 4
    assert values["global_batch_size"] == values["rollout_batch_size"] * 4
    vocab = harness.QUICK_MODEL["vocab_size"]
    stops = values["rollout_stop_token_ids"]
    # A near-uniform random model stops after ~vocab / len(stops) tokens: half the 16-token cap.
    assert len(stops) == vocab // 8 and vocab - 1 not in stops and max(stops) < vocab
    assert len((tmp_path / "prompts.jsonl").read_text().splitlines()) == 4 * 2


@pytest.mark.slow
def test_a_tiny_demo_comparison(tmp_path: Path, ray_cluster: str) -> None:
    out = tmp_path / "out"
    # Each run joins the session's cluster (RAY_ADDRESS) as a job of its own.
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_ADDRESS": ray_cluster,
    }
    cmd = [
        sys.executable,
        str(BENCH),
        "--task",
        "demo",
        "--steps",
        "2",
        "--out",
        str(out),
        "--workdir",
        str(tmp_path / "w"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    report = json.loads((out / "estimators.json").read_text())
    errors = {n: r.get("error") for n, r in report["runs"].items()} | {"bench": report.get("error")}
    assert proc.returncode == 0, (errors, proc.stdout[-2000:], proc.stderr[-2000:])
    runs = report["runs"]
    assert list(runs) == ["ppo", "grpo"]
    assert runs["ppo"]["config"]["use_critic"] is True and runs["grpo"]["config"]["use_critic"] is False
    for name, run in runs.items():
        assert [s["step"] for s in run["steps"]] == [0, 1], name
        check = run["clock_check"]
        assert check["max_abs_step_vs_log_s"] < 0.01, (name, check)  # each step's timer is its span
        # The elapsed time is the steps' spans and what lies between them; the timers sum to the spans.
        assert check["elapsed_s"] == pytest.approx(check["sum_span_s"] + check["between_steps_s"], abs=1e-9)
        assert check["between_steps_s"] >= 0
        assert abs(check["sum_step_s"] - check["sum_span_s"]) < 0.01 * len(run["steps"])
        assert run["elapsed_s"][-1] == pytest.approx(check["elapsed_s"])
        assert run["samples_per_s"] > 0 and run["peak_memory_gib"] > 0 and run["setup_s"] > 0
        events = [
            json.loads(line)
            for line in (out / "estimators_runs" / name / "events.jsonl").read_text().splitlines()
        ]
        critic_events = [e for e in events if e.get("role") == "critic"]
        assert bool(critic_events) == (name == "ppo")
    assert runs["ppo"]["critic_s_mean"] > 0 and runs["grpo"]["critic_s_mean"] == 0
    # Same seed, prompts and initial weights: the first rollouts are the same.
    assert runs["ppo"]["reward"][0] == runs["grpo"]["reward"][0]
    assert set(report["comparison"]["runs"]) == {"ppo", "grpo"}
    assert (out / "estimators.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "estimators.md").read_text()
    assert (
        "| demo | ppo | grpo |" in table
        and "reward after 2 steps" in table
        and "samples/s (mean step)" in table
    )
