"""The GPU regression check: each row of the PPO bench, shared and resident, against a recorded baseline.

A default chosen by one A/B can help one path and hurt another (a RoPE default measured on fixed
shapes once doubled the packed path's step). So the check runs every path that users take, in
one call on one GPU, and fails where a mode's step is slower than the baseline's by more than the
tolerance, or where a mode that ran in the baseline fails now:

- `fixed`: the 0.5B bench's headline work (256 prompts x 128 tokens, every response 512 tokens);
- `realistic`: the same prompts with EOS on and packing (about 280-token responses, varying);
- `tokens`: the fixed work with micro-batches cut by tokens (`use_dynamic_batch_size`).

    source .gpu-kit/setup.sh && python3 bench/regression_check.py --out "$OUT/regression"
    ... --rows realistic --set fused_rope=false     # an A/B against the baseline: does it pass?
    ... --update-baseline                           # record this run as the new baseline

The baseline (`bench/regression_baseline.json`) names the commit and GPU it was measured on; a
row measured on another GPU is reported and not judged, and so is a mode whose mean is of one
step after the warm-up (the bench takes three a mode, which its time budget does not cut:
`--min-steps 3`). Every figure is the bench's own `step_s_mean` (the mean `time/step` of the
steps after the warm-up, the wall clock of each `PPODriver.step()`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "ppo_gpu_bench.py"
BASELINE = ROOT / "bench" / "regression_baseline.json"
MODES = ("shared", "resident")

TOKENS = ("--set", "use_dynamic_batch_size=true", "--set", "max_tokens_per_gpu=32768")
ROWS: dict[str, tuple[str, ...]] = {
    "fixed": (),
    "realistic": ("--lengths", "realistic"),
    "tokens": (*TOKENS, "--set", "log_probs_max_tokens_per_gpu=65536"),
}
"""Each row's arguments to bench/ppo_gpu_bench.py beyond the ones every row shares (`COMMON`)."""

COMMON = ("--steps", "3", "--min-steps", "3", "--skip-probe")
"""A warm-up step and two measured ones a mode, which the time budget does not cut; no training-speed probe."""

MIN_STEADY = 2
"""Steps after the warm-up a mode's mean needs to be judged: one step alone varied by 12 % between two calls
of the realistic row on one H100 (8.06 and 9.13 s resident, docs/benchmarks.md)."""

TOLERANCE = 0.15
"""How much slower than the baseline a step may be before the check fails: the bench's own spread
between calls on one H200 is a few percent (6.33 / 6.36 s shared at one commit, docs/benchmarks.md),
and the regressions this check exists for were 1.5-2x."""


@dataclass(frozen=True)
class Verdict:
    """One row and mode, judged against the baseline."""

    row: str
    mode: str
    baseline_s: float | None
    measured_s: float | None
    error: str | None
    judged: bool
    steady: int | None = None
    """The steps after the warm-up that the mean is of (None: the bench did not say)."""

    @property
    def ratio(self) -> float | None:
        if self.baseline_s is None or self.measured_s is None:
            return None
        return self.measured_s / self.baseline_s

    def failed(self, tolerance: float) -> bool:
        if not self.judged:
            return False
        if self.error is not None or self.measured_s is None:
            return self.baseline_s is not None  # it ran in the baseline and fails now
        ratio = self.ratio
        return ratio is not None and ratio > 1.0 + tolerance


def judge(baseline: dict[str, Any], measured: dict[str, dict[str, Any]], gpu: str | None) -> list[Verdict]:
    """Each measured row's modes against the baseline's (`measured[row][mode]` = {"step_s", "error"})."""
    verdicts = []
    rows = baseline.get("rows", {})
    same_gpu = gpu is not None and gpu == baseline.get("gpu")
    for row, modes in measured.items():
        for mode, result in modes.items():
            recorded = rows.get(row, {}).get(mode)
            steady = result.get("steady")
            enough = steady is None or steady >= MIN_STEADY or result.get("error") is not None
            verdicts.append(
                Verdict(
                    row=row,
                    mode=mode,
                    baseline_s=None if recorded is None else float(recorded),
                    measured_s=result.get("step_s"),
                    error=result.get("error"),
                    judged=same_gpu and recorded is not None and enough,
                    steady=steady,
                )
            )
    return verdicts


def read_bench(path: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    """(mode -> {"step_s", "error", "steady"}, the GPU's name) from one bench JSON."""
    if not path.is_file():
        return {m: {"step_s": None, "error": f"no {path.name} written"} for m in MODES}, None
    report = json.loads(path.read_text())
    out = {}
    for mode, result in report.get("modes", {}).items():
        steady = result.get("steady_steps")
        out[mode] = {
            "step_s": result.get("step_s_mean"),
            "error": result.get("error"),
            "steady": None if steady is None else len(steady),
        }
    if report.get("error"):
        for mode in MODES:
            out.setdefault(mode, {"step_s": None, "error": report["error"]})
    return out, report.get("gpu")


def table(verdicts: list[Verdict], tolerance: float) -> str:
    lines = ["| row | mode | baseline s | measured s | ratio | verdict |", "|---|---|---:|---:|---:|---|"]
    for v in verdicts:
        ratio = v.ratio
        if v.error:
            verdict = f"error: {v.error[:80]}"
        elif v.steady is not None and v.steady < MIN_STEADY:
            verdict = f"not judged ({v.steady} step after the warm-up; {MIN_STEADY} needed)"
        elif not v.judged:
            verdict = "not judged (no baseline for this GPU)"
        else:
            verdict = "FAIL" if v.failed(tolerance) else "ok"
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(
            f"| {v.row} | {v.mode} | {fmt(v.baseline_s)} | {fmt(v.measured_s)} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | {verdict} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for each row's bench JSON and the verdicts"
    )
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows of {sorted(ROWS)}")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument(
        "--bench", type=Path, default=BENCH, help="the PPO bench script (a stand-in in tests)"
    )
    parser.add_argument("--update-baseline", action="store_true", help="record this run as the baseline")
    parser.add_argument(
        "--commit", default=None, help="the commit measured (recorded with --update-baseline)"
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
        help="a config override for every row (an A/B against the baseline)",
    )  # fmt: skip
    parser.add_argument(
        "--bench-args", default="", help="more arguments for every bench run (e.g. '--quick' on CPU)"
    )
    parser.add_argument("--time-budget-s", type=float, default=None, help="each row's bench time budget")
    args = parser.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        parser.error(f"--rows: {', '.join(unknown)} not among {', '.join(ROWS)}")
    if not 0 < args.tolerance < 10:
        parser.error(f"--tolerance {args.tolerance}: give a fraction, e.g. 0.15 for 15 %")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    baseline = json.loads(args.baseline.read_text()) if args.baseline.is_file() else {"rows": {}}
    measured: dict[str, dict[str, Any]] = {}
    gpu = None
    runs = []
    for row in args.rows:
        json_path = args.out / f"ppo_gpu_bench_{row}.json"
        cmd = [sys.executable, str(args.bench), "--out", str(json_path), *COMMON, *ROWS[row]]
        for item in args.overrides:
            cmd += ["--set", item]
        if args.time_budget_s is not None:
            cmd += ["--time-budget-s", str(args.time_budget_s)]
        cmd += args.bench_args.split()
        begun = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, check=False)
        runs.append(
            {"row": row, "command": " ".join(cmd[1:]), "rc": proc.returncode, "wall_s": time.time() - begun}
        )
        measured[row], row_gpu = read_bench(json_path)
        gpu = gpu or row_gpu
    verdicts = judge(baseline, measured, gpu)
    failed = [v for v in verdicts if v.failed(args.tolerance)]
    print(table(verdicts, args.tolerance))
    report = {
        "gpu": gpu,
        "baseline": {k: baseline.get(k) for k in ("commit", "gpu")},
        "tolerance": args.tolerance,
        "overrides": args.overrides,
        "runs": runs,
        "verdicts": [{**v.__dict__, "ratio": v.ratio, "failed": v.failed(args.tolerance)} for v in verdicts],
    }
    (args.out / "regression.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.update_baseline:
        rows = baseline.get("rows", {}) if baseline.get("gpu") == gpu else {}
        for row, modes in measured.items():
            rows[row] = {
                m: r["step_s"]
                for m, r in modes.items()
                if r["error"] is None
                and r["step_s"]
                and (r.get("steady") is None or r["steady"] >= MIN_STEADY)
            }
        new = {
            "gpu": gpu,
            "commit": args.commit,
            "command": "python3 bench/regression_check.py",
            "rows": rows,
        }
        args.baseline.write_text(json.dumps(new, indent=2) + "\n")
        print(f"baseline written: {args.baseline}")
    if failed:
        print(
            "regression: "
            + "; ".join(
                f"{v.row} {v.mode} {v.measured_s or 0:.2f} s against {v.baseline_s:.2f} s" for v in failed
            )
            + f" (tolerance {args.tolerance:.0%})",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
