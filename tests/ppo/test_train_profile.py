"""bench/train_profile.py --quick on CPU: the timings, MFU figures and the profile's breakdown are consistent.

Nothing is timed here: the figures only have to exist and add up (the real run is on an H200).
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


def test_quick_profile_adds_up(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "bench/train_profile.py", "--quick", "--out", str(out), "--workdir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["tokens_per_train"] == 8 * 64 and len(r["train_s"]) == len(r["log_prob_forward_s"]) == 3
    if r["update_s"] is not None:
        assert r["update_s"] == pytest.approx(min(r["train_s"]) - min(r["log_prob_forward_s"]), rel=1e-9)
    else:
        assert min(r["train_s"]) <= min(r["log_prob_forward_s"]) and "--iters" in r["update_unmeasured"]
    assert r["mfu_train_6n"] > 0 and r["mfu_train_8n"] == pytest.approx(r["mfu_train_6n"] * 8 / 6)
    prof = r["profile"]
    assert sum(prof["by_kind_s"].values()) == pytest.approx(prof["kernel_s"])
    # The tiny model's matrix multiplies and SDPA show up under their kinds.
    assert prof["by_kind_s"]["matmul"] > 0 and prof["by_kind_s"]["attention"] > 0
    assert "aten::_local_scalar_dense" in prof["host_syncs"]


def test_the_update_is_the_fastest_calls_difference_and_null_when_not_positive() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from train_profile import update_figures

    # One slow forward (a recompilation) would make the medians' difference negative.
    figures = update_figures([2.6, 2.5], [6.2, 0.7], tokens=1000, params=10**8, peak=1e15)
    assert figures["update_s"] == pytest.approx(1.8)
    assert figures["tokens_per_s_update"] == pytest.approx(1000 / 1.8)
    assert figures["mfu_update_6n"] == pytest.approx(6 * 10**8 * 1000 / 1.8 / 1e15)
    unmeasured = update_figures([1.0, 1.1], [1.2, 1.0], tokens=1000, params=10**8, peak=1e15)
    assert unmeasured["update_s"] is None and unmeasured["mfu_update_6n"] is None
    assert "1.000 s" in unmeasured["update_unmeasured"]


def test_varied_lengths_draw_new_lengths_for_every_call(tmp_path: Path) -> None:
    """`--varied-lengths --packed`: each call's batch has lengths of its own, counted in its tokens."""
    out = tmp_path / "varied.json"
    cmd = [
        sys.executable,
        "bench/train_profile.py",
        "--quick",
        "--varied-lengths",
        "--packed",
        "--iters",
        "2",
        "--no-profile",
        "--out",
        str(out),
        "--workdir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    tokens = r["tokens_per_call"]
    assert r["varied_lengths"] and r["packed"] and len(tokens) == 2 * 2 + 2
    # 8 samples of 16 prompt tokens and 1..48 response tokens each, drawn anew per call.
    assert all(8 * (16 + 1) <= t <= 8 * 64 for t in tokens) and len(set(tokens)) > 1
    assert r["tokens_per_train"] == pytest.approx(sum(sorted(tokens)[2:4]) / 2)  # their median
    assert "[train_profile] train()" in proc.stdout
