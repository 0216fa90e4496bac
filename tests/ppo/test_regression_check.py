"""bench/regression_check.py: a row slower than its baseline beyond the tolerance fails the check, a
faster or equal one passes, one measured on another GPU or on a single step after the warm-up is not
judged, and a mode that ran in the baseline and errors now fails (over a stand-in for the PPO bench; the
real rows run on an H200)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import ppo_gpu_bench  # noqa: E402
import regression_check  # noqa: E402

GPU = "NVIDIA H200"


def baseline(rows: dict[str, dict[str, float]], gpu: str = GPU) -> dict:
    return {"gpu": gpu, "commit": "abc", "rows": rows}


@given(
    base=st.floats(0.1, 100.0),
    ratio=st.floats(0.2, 5.0),
    tolerance=st.floats(0.01, 1.0),
)
def test_a_step_fails_exactly_when_slower_than_the_tolerance(
    base: float, ratio: float, tolerance: float
) -> None:
    measured = {"realistic": {"shared": {"step_s": base * ratio, "error": None}}}
    (verdict,) = regression_check.judge(baseline({"realistic": {"shared": base}}), measured, GPU)
    assert verdict.judged
    assert verdict.failed(tolerance) == (base * ratio / base > 1 + tolerance)


def test_the_packed_path_twice_as_slow_fails_while_the_fixed_path_passes() -> None:
    """The regression this check was built for: a default that helped fixed shapes doubled the
    packed step (12.2 -> 25.3 s)."""
    base = baseline(
        {"fixed": {"shared": 6.33, "resident": 5.38}, "realistic": {"shared": 12.2, "resident": 12.0}}
    )
    measured = {
        "fixed": {"shared": {"step_s": 6.05, "error": None}, "resident": {"step_s": 5.48, "error": None}},
        "realistic": {"shared": {"step_s": 25.3, "error": None}, "resident": {"step_s": 25.0, "error": None}},
    }
    failed = {(v.row, v.mode) for v in regression_check.judge(base, measured, GPU) if v.failed(0.15)}
    assert failed == {("realistic", "shared"), ("realistic", "resident")}


def test_another_gpu_or_a_row_without_baseline_is_reported_not_judged() -> None:
    measured = {"fixed": {"shared": {"step_s": 60.0, "error": None}}}
    (other,) = regression_check.judge(baseline({"fixed": {"shared": 6.0}}), measured, "NVIDIA H100")
    (new,) = regression_check.judge(baseline({}), measured, GPU)
    assert not other.judged and not other.failed(0.15)
    assert not new.judged and not new.failed(0.15)


def test_a_mode_that_ran_in_the_baseline_and_errors_now_fails() -> None:
    measured = {"fixed": {"resident": {"step_s": None, "error": "CUDA out of memory"}}}
    (verdict,) = regression_check.judge(baseline({"fixed": {"resident": 5.4}}), measured, GPU)
    assert verdict.failed(0.15)


def test_a_mean_of_one_step_after_the_warm_up_is_not_judged() -> None:
    # One steady step varied by 12 % between two calls on one GPU: too few to judge a 15 % tolerance by.
    measured = {
        "realistic": {
            "shared": {"step_s": 20.0, "error": None, "steady": 1},
            "resident": {"step_s": 20.0, "error": None, "steady": 2},
        }
    }
    shared, resident = regression_check.judge(
        baseline({"realistic": {"shared": 10.0, "resident": 10.0}}), measured, GPU
    )
    assert not shared.judged and not shared.failed(0.15)
    assert resident.judged and resident.failed(0.15)
    assert "not judged (1 step after the warm-up; 2 needed)" in regression_check.table([shared], 0.15)


def test_the_benchs_time_budget_keeps_the_steps_asked_for(tmp_path: Path) -> None:
    out = ["--quick", "--out", str(tmp_path)]
    assert ppo_gpu_bench.parse_args(out).min_steps == 2
    assert ppo_gpu_bench.parse_args([*out, "--steps", "3", "--min-steps", "3"]).min_steps == 3
    for bad in (["--min-steps", "1"], ["--steps", "3", "--min-steps", "4"]):
        with pytest.raises(SystemExit):
            ppo_gpu_bench.parse_args([*out, *bad])


STAND_IN = """
import json, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
packed = "realistic" in args
sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
slow = 2.0 if packed and "fused_rope=false" in sets else 1.0
steady = list(range(1, int(args[args.index("--min-steps") + 1]))) if "--min-steps" in args else [1]
modes = {
    m: {"step_s_mean": s * slow, "error": None, "steady_steps": steady} for m, s in (("shared", 10.0), ("resident", 9.5))
}
out.write_text(json.dumps({"gpu": "NVIDIA H200", "modes": modes}))
"""


def test_main_records_a_baseline_then_fails_the_slow_default_and_passes_the_good_one(tmp_path: Path) -> None:
    bench = tmp_path / "bench.py"
    bench.write_text(STAND_IN)
    base = tmp_path / "baseline.json"
    common = ["--bench", str(bench), "--baseline", str(base), "--rows", "fixed,realistic"]
    assert (
        regression_check.main([*common, "--out", str(tmp_path / "a"), "--update-baseline", "--commit", "c1"])
        == 0
    )
    recorded = json.loads(base.read_text())
    assert recorded["commit"] == "c1" and recorded["rows"]["realistic"] == {"shared": 10.0, "resident": 9.5}
    assert regression_check.main([*common, "--out", str(tmp_path / "b")]) == 0
    assert regression_check.main([*common, "--out", str(tmp_path / "c"), "--set", "fused_rope=false"]) == 1
    report = json.loads((tmp_path / "c" / "regression.json").read_text())
    assert {(v["row"], v["mode"]) for v in report["verdicts"] if v["failed"]} == {
        ("realistic", "shared"),
        ("realistic", "resident"),
    }


def test_an_unknown_row_is_refused_naming_the_rows() -> None:
    with pytest.raises(SystemExit):
        regression_check.parse_args(["--out", "x", "--rows", "packed"])
