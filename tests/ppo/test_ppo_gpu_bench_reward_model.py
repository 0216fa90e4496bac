"""bench/ppo_gpu_bench.py --quick --reward-model on CPU: both modes run with a reward model, and the JSON says so.

Nothing is timed here: the figures only have to exist (the real run is on an H200).
Shared, the reward model wakes, scores and sleeps each step; resident, it never sleeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "ppo_gpu_bench.py"


def test_quick_run_with_a_reward_model(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    cmd = [sys.executable, str(BENCH), "--quick", "--reward-model", "--skip-probe"]
    cmd += ["--out", str(out), "--workdir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    path = out / "ppo_gpu_bench.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    errors = {m: r.get("error") for m, r in report.get("modes", {}).items()}
    assert proc.returncode == 0, (errors, report.get("error"), proc.stdout[-2000:], proc.stderr[-2000:])
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
