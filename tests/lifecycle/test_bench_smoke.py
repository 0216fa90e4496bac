"""The lifecycle benchmark runs end to end on a tiny state, so that it cannot rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "lifecycle_bench.py"


@pytest.mark.slow
def test_the_benchmark_runs_tiny_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "lifecycle.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--gib", "0.02", "--repeats", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert 0.02 <= report["state_gib"] < 0.03
    assert report["tensors"] > 10, "optimizer state as many tensors"
    assert report["memcpy"]["d2h_gbps"] > 0 and report["memcpy"]["h2d_gbps"] > 0
    pinned = report["pinned_host"]
    assert pinned["intact"] is True
    assert pinned["sleep_gbps"] > 0 and pinned["wake_gbps"] > 0
    assert pinned["host_gib"] >= report["state_gib"]
    assert isinstance(report["goal_met"], bool)
    assert "| pinned_host backend |" in proc.stdout and "goal (each direction" in proc.stdout
    if "skipped" not in report["torch_memory_saver"]:
        assert report["torch_memory_saver"]["intact"] is True
