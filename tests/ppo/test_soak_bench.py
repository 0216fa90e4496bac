"""bench/soak.py's arithmetic and sampler (bench/soak_stats.py): a slope is found per start (each start's
own intercept) and over the run for the run folder, given per 100 steps; the /proc sampler sees this
process and its child. The soak itself runs the driver for hundreds of steps (docs/benchmarks.md): not a
CI test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import soak_stats as soak  # noqa: E402


@given(
    slope=st.floats(-5.0, 5.0),
    intercepts=st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=3),
    noise=st.lists(st.floats(-1.0, 1.0), min_size=60, max_size=60),
)
def test_the_slope_within_starts_is_found_whatever_each_start_begins_at(
    slope: float, intercepts: list[float], noise: list[float]
) -> None:
    """Each start's processes begin afresh (a resume): one slope, an intercept per start. Noise within
    ±1 moves the least-squares slope by at most sum|x - x̄| / sum (x - x̄)² (x the steps, centred per start),
    and not at all without noise."""
    points = [
        (step, 1e4 + intercepts[start] + slope * step + noise[step % 60], start)
        for start in range(len(intercepts))
        for step in range(start * 100, start * 100 + 60)
    ]
    found = soak.fit(points)
    assert found is not None and found["starts"] == len(intercepts)
    centred = [x - 29.5 for x in range(60)]  # each start's 60 steps, about their mean
    bound = sum(abs(d) for d in centred) / sum(d * d for d in centred)
    assert abs(found["per_100_steps"] / 100 - slope) <= bound + 1e-9
    exact = soak.fit([(s, 1e4 + intercepts[st] + slope * s, st) for s, _, st in points])
    assert exact is not None and exact["per_100_steps"] == pytest.approx(100 * slope, abs=1e-6)


def test_the_run_folder_is_fitted_over_the_run_and_the_rest_after_each_starts_warm_up() -> None:
    # Host RSS: 5 MB of warm-up at each start's first steps, then flat; the folder: 1 kB a step throughout.
    records = [
        {
            "start": start,
            "step": step,
            "values": {
                "host": {"rss": 1e9 + (5e6 if step - 50 * start < 3 else 0)},
                "run_dir_bytes": 1000 * step,
            },
        }
        for start in (0, 1)
        for step in range(50 * start, 50 * start + 50)
    ]
    fits = soak.slopes(records, warmup=3)
    assert fits["host.rss"]["per_100_steps"] == pytest.approx(0.0, abs=1e-3)
    assert fits["host.rss"]["points"] == 94 and fits["host.rss"]["per_start_per_100_steps"] == {
        0: 0.0,
        1: 0.0,
    }
    assert fits["run_dir_bytes"]["per_100_steps"] == pytest.approx(100_000)
    assert fits["run_dir_bytes"]["starts"] == 1
    assert "| run_dir_bytes | " in soak.summary({"slopes": fits})


def test_the_sampler_sees_a_process_and_its_descendants(tmp_path: Path) -> None:
    # The child says it is up once its interpreter has started: sampled before, a process still in
    # exec has well under a megabyte resident.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        assert child.pid in soak.descendants(os.getpid())
        stats = soak.proc_stats(child.pid)
        assert stats is not None and stats["rss"] > 1e6 and stats["threads"] >= 1 and stats["fds"] >= 3
    finally:
        child.kill()
        child.communicate()
    assert soak.proc_stats(child.pid) is None  # gone
    (tmp_path / "a").write_bytes(bytes(1000))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "c").write_bytes(bytes(24))
    assert soak.folder_bytes(tmp_path) == 1024


def test_the_gpu_soak_takes_the_benchs_own_flags_for_its_work(tmp_path: Path) -> None:
    import soak as soak_main

    parser_args = [
        "--out", str(tmp_path / "r.json"), "--shape", "qwen2.5-0.5b", "--quick",
        "--bench-args", "--prompts 8 --global-batch-size 8 --response-len 24",
    ]  # fmt: skip
    args = soak_main.build_parser().parse_args(parser_args)
    values = soak_main.run_values(args, tmp_path)
    assert (values["rollout_batch_size"], values["global_batch_size"]) == (8, 8)
    assert values["rollout_max_response_len"] == 24
    assert values["offload_train"] is True  # the bench's shared mode
    assert values["sigterm_grace_s"] is None  # its own SIGTERM: the step's save finishes, however long


def test_bench_flags_without_a_gpu_shape_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    import soak as soak_main

    with pytest.raises(SystemExit):
        soak_main.main(["--out", "/tmp/unused.json", "--bench-args", "--prompts 8"])
    assert "--bench-args" in capsys.readouterr().err


@pytest.mark.parametrize("quick", [False, True])
def test_the_counts_given_are_kept_and_the_others_are_the_defaults(quick: bool) -> None:
    import soak as soak_main

    given = ["--steps", "80", "--warmup", "5"]
    args = soak_main.build_parser().parse_args(["--out", "r.json", *given, *(["--quick"] if quick else [])])
    soak_main.resolve_counts(args)
    assert (args.steps, args.warmup) == (80, 5)
    column = 1 if quick else 0
    assert args.save_interval == soak_main.COUNTS["save_interval"][column]
    assert args.resumes == soak_main.COUNTS["resumes"][column]
