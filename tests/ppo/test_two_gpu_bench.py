"""bench/two_gpu_bench.py and bench/process_group_bench.py on CPU (gloo, two logical GPUs).

Nothing is timed here: the runs must finish, the checks the bench makes must hold
(the weights on both engines, the shared run = the never-sleeping one), and the
merge of saved reports must give the same summary (the real runs are on two H200s).
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
BENCH = ROOT / "bench" / "two_gpu_bench.py"


def _run(*args: str, timeout: int = 900, ray_address: str | None = None) -> subprocess.CompletedProcess[str]:
    """`args` run by this interpreter; with `ray_address`, every run it starts joins that cluster as a job."""
    env = dict(os.environ, RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_a_quick_dp2_pair_runs_and_sleeping_changes_nothing(tmp_path: Path, ray_cluster: str) -> None:
    # Both runs join the session's cluster (4 logical GPUs) instead of starting a Ray each.
    proc = _run(
        str(BENCH), "--quick", "--out", str(tmp_path), "--runs", "dp2,dp2_resident", ray_address=ray_cluster
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads((tmp_path / "two_gpu_bench.json").read_text())
    shared, resident = report["runs"]["dp2"], report["runs"]["dp2_resident"]
    assert shared["exit_code"] == resident["exit_code"] == 0
    assert shared["steps"] == resident["steps"] == 2
    assert shared["weights_received"] == {
        "syncs": 2,
        "engines": 2,
        "all_engines_agree": True,
        "changed_every_sync": True,
        # The final save on the shared GPUs: the engines released their memory for it and got the
        # last step's weights again.
        "after_saves": 1,
        "saves_resend_the_weights": True,
    }
    assert resident["weights_received"]["after_saves"] == 0
    assert shared["vs_resident"]["metrics"]["identical"], shared["vs_resident"]
    assert shared["vs_resident"]["weights"]["identical"], shared["vs_resident"]
    # Only the shared run sleeps.
    assert "time/actor_sleep" in shared["time"] and "time/actor_sleep" not in resident["time"]
    assert (tmp_path / "two_gpu_runs" / "dp2" / "config.yaml").is_file()


def test_the_saved_h200_reports_merge_into_the_documented_summary(tmp_path: Path) -> None:
    saved = ROOT / "docs" / "results" / "two_gpu_bench.json"
    proc = _run(str(BENCH), "--out", str(tmp_path), "--from-json", str(saved), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| tp2 | 0 |" in proc.stdout and "metrics yes, weights yes" in proc.stdout
    merged = json.loads((tmp_path / "two_gpu_bench.json").read_text())
    assert merged["runs"]["split"]["weight_sync_vs_copy"]["weight_sync_s"] > 0


def test_the_process_group_bench_tears_down_both_ways(tmp_path: Path) -> None:
    out = tmp_path / "process_groups.json"
    proc = _run(
        str(ROOT / "bench" / "process_group_bench.py"), "--cycles", "2", "--out", str(out), timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["backend"] == "gloo" and result["groups_per_rank"] > 1
    assert set(result["rows"]) == {"one after the other", "concurrent", "concurrent, one-rank groups kept"}
    assert 0 < result["one_rank_groups_per_rank"] < result["groups_per_rank"]
    assert all(len(row["all"]["destroy_s"]) == 2 for row in result["rows"].values())
