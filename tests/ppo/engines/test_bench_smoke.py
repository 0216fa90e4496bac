"""The engine benchmark runs end to end on CPU (`--quick`), so that it cannot rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "engine_bench.py"


@pytest.mark.slow
def test_the_benchmark_runs_quick_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["copy_bandwidth_gbps"] > 0
    (model,) = report["models"]
    assert [row["batch"] for row in model["rows"]] == [4, 8]
    for row in model["rows"]:
        assert row["engine_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0
        assert row["bound_weights_tokens_per_s"] > row["bound_weights_kv_tokens_per_s"] > 0
        assert row["speedup_vs_hf"] > 0
    assert model["release_s"] >= 0 and model["resume_s"] >= 0
    assert model["sync_device_tensors_s"] > 0 and model["device_copy_s"] > 0
    assert isinstance(model["sync_goal_met"], bool)


MULTI_TURN = BENCH.parent / "multi_turn_bench.py"


@pytest.mark.slow
def test_the_multi_turn_benchmark_runs_quick(tmp_path: Path) -> None:
    out = tmp_path / "multi.json"
    proc = subprocess.run(
        [sys.executable, str(MULTI_TURN), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    # 4 episodes of 2 turns of 4 tokens: one engine call a turn, every episode in it.
    assert report["multi_turn"]["batch_sizes"] == [4, 4]
    assert report["multi_turn"]["model_tokens"] == report["single_turn"]["model_tokens"] == 4 * 2 * 4
    assert report["multi_over_single"] > 0
    assert report["kept_kv"]["model_tokens"] == report["multi_turn"]["model_tokens"]
    assert report["kept_kv"]["speedup_over_reprefill"] > 0
    reprefill = report["reprefill"]
    assert (
        0 < reprefill["already_cached_share"] < 1 and reprefill["upper_bound_saving_s"] < reprefill["seconds"]
    )
