"""bench/ppo_gpu_bench.py --quick on CPU: both modes and the probe run, and the JSON holds their figures.

Nothing is timed here: the figures only have to exist (the real run is on an H200). The quick run
scores with a reward model (`--reward-model`) beside the rule reward: shared, the reward model
wakes, scores and sleeps each step; resident, it never sleeps. (One bench run for both: each
costs minutes of CI; the rule reward's own path runs in the scaling-cell test.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "ppo_gpu_bench.py"

SHARED_PHASES = (
    "rollout",
    "generate",
    "reward",
    "engine_release",
    "critic_wake",
    "critic_train",
    "critic_sleep",
    "actor_wake",
    "actor_train",
    "actor_sleep",
    "engine_resume_weights",
    "weight_sync",
    "engine_resume_kv_cache",
    "step",
)
RESIDENT_PHASES = ("rollout", "generate", "reward", "critic_train", "actor_train", "weight_sync", "step")


def test_quick_run_writes_both_modes_the_probe_the_reward_model_and_the_teacher(
    tmp_path: Path, ray_cluster: str
) -> None:
    out = tmp_path / "out"
    # Each mode's driver and the probe join the session's cluster (RAY_ADDRESS) as jobs of their own.
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_ADDRESS": ray_cluster,
    }
    cmd = [sys.executable, str(BENCH), "--quick", "--reward-model", "--teacher", "qwen2.5-1.5b"]
    cmd += ["--out", str(out)]
    cmd += ["--workdir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    path = out / "ppo_gpu_bench.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    errors = {m: r.get("error") for m, r in report.get("modes", {}).items()}
    errors["probe"] = (report.get("probe") or {}).get("error")
    errors["bench"] = report.get("error")
    assert proc.returncode == 0, (errors, proc.stdout[-2000:], proc.stderr[-2000:])
    assert report["quick"] is True
    assert set(report["modes"]) == {"shared", "resident"}
    for mode, phases in (("shared", SHARED_PHASES), ("resident", RESIDENT_PHASES)):
        result = report["modes"][mode]
        assert result["error"] is None, result["error"]
        assert [s["step"] for s in result["steps"]] == [0, 1]
        for step in result["steps"]:
            missing = [p for p in phases if f"time/{p}" not in step]
            assert missing == [], (mode, missing)
            assert step["throughput/tokens_per_s"] > 0
            assert "reward/mean" in step
        assert result["step_s_mean"] > 0
        assert result["tokens_per_s"] > 0
        assert result["sharing_adds_share"] is not None
        # What each weight sync changed in the engine's weights (counted on its device) is reported.
        assert all(0 < f <= 1 for f in result["changed_fraction_since_start"]), result
        assert result["engine_weight_update_s"] > 0 and result["sampler_log_prob_gap"] >= 0
        # Inside each train's phase, its seconds by part on the worker, within the phase's own.
        inside = result["train_time_s_mean"]
        for role in ("actor", "critic"):
            assert {f"{role}/passes", f"{role}/optimizer_step", f"{role}/other"} <= inside.keys(), inside
            assert 0 < inside[f"{role}/total"] <= result["phase_s_mean"][f"{role}_train"]
    assert report["modes"]["shared"]["config"]["offload_train"] is True
    # What the sleep backend keeps on the host (bench/capacity_bench.py reads it): shared, both models'
    # state; resident, nothing.
    buffers = {m: report["modes"][m]["host_buffer_gib"] for m in ("shared", "resident")}
    assert set(buffers["shared"]) == set(buffers["resident"]) == {"actor", "critic"}, buffers
    assert all(v > 0 for v in buffers["shared"].values()) and not any(buffers["resident"].values()), buffers
    resident = report["modes"]["resident"]["config"]
    assert resident["offload_train"] is False
    assert resident["rollout_kv_cache_memory_fraction"] == pytest.approx(0.1)
    # Same seed and data: the rollouts (and so the rewards) of the two modes agree.
    assert report["modes"]["shared"]["reward_mean"] == pytest.approx(
        report["modes"]["resident"]["reward_mean"]
    )
    assert report["overhead_of_sharing"] is not None
    assert report["verl_anchor_s"]["step"] == 66.0
    assert set(report["goals"]) >= {"shared_step_le_5s", "shared_over_resident_le_5pct", "probe_mfu_ge_50pct"}
    for mode in ("shared", "resident"):
        # The driver's time/step is the wall clock of the bench's own span around each step.
        assert report["modes"][mode]["clock_gap_s"] < 0.05, report["modes"][mode]["clock_gap_s"]
        # The memory peaks' timeline holds each step's rollout (cut into generate and reward) and
        # its trained phases, each inside that step's span.
        intervals = report["modes"][mode]["phase_intervals"]
        for step in (0, 1):
            (span,) = [i for i in intervals if i["phase"] == "step_total" and i["step"] == step]
            mine = {i["phase"]: i for i in intervals if i["step"] == step and i["phase"] != "step_total"}
            assert {"rollout", "critic_train", "actor_train"} <= set(mine), (mode, step, sorted(mine))
            for i in mine.values():
                assert span["t0"] <= i["t0"] <= i["t1"] <= span["t1"], (mode, i, span)

    _check_the_reward_model(report, out)
    _check_the_teacher(report, out)

    probe = report["probe"]
    assert probe["error"] is None, probe["error"]
    assert probe["tokens_per_s"] > 0 and probe["mfu_6n"] > 0 and probe["params"] > 0

    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "ppo_gpu_bench_reward.png").is_file(), report.get("plot_error")


def _check_the_reward_model(report: dict[str, Any], out: Path) -> None:
    assert report["reward_model"]["params"] > 0 and "reward model" in report["shape"]
    for mode in ("shared", "resident"):
        result = report["modes"][mode]
        assert result["config"]["rm_type"] == "model"
        for step in result["steps"]:
            assert "reward/model" in step and "reward/custom" in step
            assert step["reward/mean"] == pytest.approx(
                step["reward/model"] + step["reward/custom"], abs=1e-6
            )
            assert step["time/reward_model"] > 0
        events = [
            json.loads(line)
            for line in (out / "ppo_gpu_bench_runs" / mode / "events.jsonl").read_text().splitlines()
        ]
        kinds = [e["event"] for e in events]
        assert kinds.count("score_begin") == len(result["steps"])
        if mode == "shared":
            assert kinds.count("rm_wake") == kinds.count("rm_sleep") - 1 == len(result["steps"])  # + setup's
            for step in result["steps"]:
                for phase in (
                    "reward_model_wake",
                    "reward_model_score",
                    "reward_model_sleep",
                    "engine_release",
                ):
                    assert f"time/{phase}" in step, phase
            assert result["phase_s_mean"]["reward_model_wake"] is not None
        else:
            assert "rm_wake" not in kinds and "rm_sleep" not in kinds
    # Same seed, data and reward model: the two modes score the same rollouts alike.
    assert report["modes"]["shared"]["reward_mean"] == pytest.approx(
        report["modes"]["resident"]["reward_mean"]
    )


def test_a_failing_scaling_cell_is_kept_and_the_sweep_goes_on(tmp_path: Path) -> None:
    """The engine is killed in the second generate of the first cell, and may not be restarted: that
    cell fails, its error is kept, and a fresh driver runs the next cell's two steps. (A Ray of the bench's own:
    its engine workers must inherit the fault point from the bench's environment, which the session cluster's
    workers do not.)"""
    out = tmp_path / "scaling.json"
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "TANDEM_FAULT_POINT": "engine.generate:call=2",
        "TANDEM_FAULT_ONCE": str(tmp_path / "fired"),
    }
    cmd = [sys.executable, str(BENCH), "--quick", "--out", str(out), "--workdir", str(tmp_path / "work")]
    cmd += ["--skip-shared", "--skip-probe", "--scaling", "4x8,8x8", "--global-batch-size", "4"]
    cmd += ["--set", "max_engine_restarts=0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert (tmp_path / "fired").is_file()
    result = json.loads(out.read_text())["modes"]["resident"]
    assert result["error"] is None, result["error"]
    assert set(result["cell_errors"]) == {"4x8"}, result.get("cell_errors")
    assert [(s["cell"], s["cell_step"]) for s in result["steps"]] == [("4x8", 0), ("8x8", 0), ("8x8", 1)]
    assert set(result["step_s_by_cell"]) == {"8x8"}
    assert "| 4x8 | failed |" in proc.stdout


def _check_the_teacher(report: dict[str, Any], out: Path) -> None:
    assert report["teacher"]["params"] > 0 and "teacher" in report["shape"]
    for mode in ("shared", "resident"):
        result = report["modes"][mode]
        assert result["config"]["teacher_hf_checkpoint"] and result["config"]["opd_coef"] == 1.0
        for step in result["steps"]:
            assert step["time/teacher"] > 0 and step["time/kl_first"] > 0
            assert "actor/opd_reverse_kl" in step
        events = [
            json.loads(line)
            for line in (out / "ppo_gpu_bench_runs" / mode / "events.jsonl").read_text().splitlines()
        ]
        teacher = [e["event"] for e in events if e.get("role") == "teacher"]
        assert teacher.count("log_probs_begin") == len(result["steps"])
        if mode == "shared":
            # Woken each step, put to sleep each step and once at the start (it loads awake).
            assert teacher.count("wake") == teacher.count("sleep") - 1 == len(result["steps"])
            for step in result["steps"]:
                for phase in ("teacher_wake", "teacher_log_probs", "teacher_sleep"):
                    assert f"time/{phase}" in step, phase
        else:
            assert "wake" not in teacher and "sleep" not in teacher
    # Same seed, data and teacher: the first step's rollouts are the same, and so is their reverse KL.
    assert report["modes"]["shared"]["steps"][0]["actor/opd_reverse_kl"] == pytest.approx(
        report["modes"]["resident"]["steps"][0]["actor/opd_reverse_kl"], rel=1e-4
    )
