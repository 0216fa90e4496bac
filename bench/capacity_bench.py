"""Capacity: the largest Qwen2.5 shape that PPO-trains with a critic of its own size on one GPU, shared and resident.

For each shape of `--shapes` and each mode (`resident` first, then `shared`), one
`bench/ppo_gpu_bench.py` run in its own process, on the bench's work (256 prompts x
128 tokens, 512-token responses, KL loss on, so the reference model is there too),
`--steps` steps and no probe. Each row says whether the run trained; its steady step
(the mean after the first, the step's wall clock); the device-wide peak GPU memory;
the peak host memory in use; the host buffers the sleep backend keeps for the two
models; and, for a run that did not train, why: `CUDA out of memory`, the host's
memory (Ray's memory monitor or the kernel killing a process), or the error's last
line, with the run's log kept. The arithmetic of the training state sits beside each
shape, so that a shape too big to try still gets its row: per model, bf16 weights
(2 bytes a parameter), fp32 main gradients (4), fp32 main parameters (4) and Adam's
two moments (8), of which a sleep keeps on the host all but the gradients (14 bytes a
parameter; the gradients are zeroed before each minibatch and not kept).

    source .gpu-kit/setup.sh && python3 bench/capacity_bench.py --out "$OUT" --shapes qwen2.5-1.5b,qwen2.5-3b
    ./uvw run python bench/capacity_bench.py --quick --out /tmp/capacity   # CPU smoke run: the tiny model

Results: `OUT/capacity_bench.json` (rewritten after each run) and a markdown table
printed at the end; each run's own bench JSON and log under `--workdir`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_harness import SHAPES, fmt, write_report

BENCH = Path(__file__).resolve().parent / "ppo_gpu_bench.py"
GIB = 1024**3
STATE_BYTES_PER_PARAM = 2 + 4 + 4 + 8
"""bf16 weights, fp32 main gradients, fp32 main parameters, Adam's two fp32 moments."""
HOST_BYTES_PER_PARAM = 2 + 4 + 8
"""What a sleep keeps on the host: all of the state but the gradients (zeroed before each minibatch)."""


def shape_params(shape: dict[str, Any]) -> int:
    """Parameters of a Qwen2-style decoder of this shape (attention biases on q, k, v; tied or untied head)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = h // heads
    attn = h * h + h + 2 * (h * kv * head_dim + kv * head_dim) + h * h
    layer = attn + 3 * h * i + 2 * h
    embedding = shape["vocab_size"] * h
    head = 0 if shape.get("tie_word_embeddings", True) else embedding
    return embedding + n * layer + h + head


def why_it_failed(report: dict[str, Any] | None, log: str) -> str:
    text = log + json.dumps(report or {})
    if "CUDA out of memory" in text or "OutOfMemoryError: CUDA" in text:
        return "CUDA out of memory"
    if "running low on memory" in text or "Killed" in log or "SIGKILL" in text:
        return "host memory (a process killed)"
    errors = [m.get("error") for m in (report or {}).get("modes", {}).values() if m.get("error")]
    last = (errors[0] if errors else log).strip().splitlines()
    return last[-1][:200] if last else "no output"


def run_one(shape: str, mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / f"{shape}-{mode}.json"
    log_path = work / f"{shape}-{mode}.log"
    cmd = [sys.executable, str(BENCH), "--out", str(out), "--workdir", str(work / "models"), "--skip-probe"]
    cmd += ["--quick"] if args.quick else ["--shape", shape]
    cmd += ["--steps", str(args.steps), "--time-budget-s", str(args.time_budget_s)]
    cmd += ["--skip-shared" if mode == "resident" else "--skip-resident"]
    cmd += args.bench_args
    started = time.time()
    with log_path.open("w") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.time_budget_s + 240, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    row: dict[str, Any] = {"shape": shape, "mode": mode, "rc": rc, "wall_s": time.time() - started}
    report = json.loads(out.read_text()) if out.is_file() else None
    result = (report or {}).get("modes", {}).get(mode, {})
    trained = rc == 0 and bool(result.get("steps")) and not result.get("error")
    row["trained"] = trained
    row["steps"] = len(result.get("steps") or [])
    row["step_s"] = result.get("step_s_mean") if trained else None
    row["gpu_peak_gib"] = (result.get("gpu_peak_gib") or {}).get("overall")
    row["host_used_peak_gib"] = result.get("host_used_peak_gib")
    row["host_buffer_gib"] = result.get("host_buffer_gib")
    row["params"] = (report or {}).get("model", {}).get("params")
    row["why_not"] = None if trained else why_it_failed(report, log_path.read_text(errors="replace")[-20000:])
    if rc is None:
        row["why_not"] = f"timed out after {args.time_budget_s + 240:.0f} s"
    row["bench_json"], row["log"] = str(out), str(log_path)
    return row


def estimate(shape: str) -> dict[str, Any]:
    params = shape_params(SHAPES[shape])
    return {
        "shape": shape,
        "params": params,
        "state_gib_per_model": params * STATE_BYTES_PER_PARAM / GIB,
        "host_gib_both_models_asleep": 2 * params * HOST_BYTES_PER_PARAM / GIB,
        "resident_state_gib": (2 * STATE_BYTES_PER_PARAM + 2 + 2) * params / GIB,
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        "| shape | params | state a model (est.) | mode | trains | step s | peak GPU GiB | peak host GiB | host buffers GiB | why not |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    estimates = {e["shape"]: e for e in report["estimates"]}
    for row in report["runs"]:
        est = estimates.get(row["shape"], {})
        buffers = row.get("host_buffer_gib")
        lines.append(
            f"| {row['shape']} | {fmt((row.get('params') or est.get('params') or 0) / 1e9)} B "
            f"| {fmt(est.get('state_gib_per_model'), '.1f')} GiB | {row['mode']} | {'yes' if row['trained'] else 'no'} "
            f"| {fmt(row.get('step_s'))} | {fmt(row.get('gpu_peak_gib'), '.1f')} | {fmt(row.get('host_used_peak_gib'), '.1f')} "
            f"| {fmt(sum(buffers.values()) if buffers else None, '.1f')} | {row.get('why_not') or ''} |"
        )
    for shape in report["not_run"]:
        est = estimates[shape]
        lines.append(
            f"| {shape} | {fmt(est['params'] / 1e9)} B | {fmt(est['state_gib_per_model'], '.1f')} GiB | not run | | | | "
            f"| {fmt(est['host_gib_both_models_asleep'], '.1f')} (est.) | arithmetic only |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder (or a .json path) for the results")
    parser.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-3b", help="comma-separated shapes to run")
    parser.add_argument("--estimate", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-3b,qwen2.5-7b")
    parser.add_argument("--modes", default="resident,shared")
    parser.add_argument("--steps", type=int, default=2, help="steps a run (the first is its warm-up)")
    parser.add_argument("--time-budget-s", type=float, default=240.0, help="each run's --time-budget-s")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: the bench's tiny model")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("bench_args", nargs="*", help="after --: more ppo_gpu_bench.py arguments")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    json_path = args.out if args.out.suffix == ".json" else args.out / "capacity_bench.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="capacity-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    shapes = ["quick"] if args.quick else [s for s in args.shapes.split(",") if s]
    estimated = [s for s in args.estimate.split(",") if s]
    report: dict[str, Any] = {
        "_started": time.time(),
        "bench": "capacity_bench",
        "command": "python3 bench/capacity_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "estimates": [estimate(s) for s in estimated],
        "runs": [],
        "not_run": [s for s in estimated if s not in shapes],
    }
    for shape in shapes:
        for mode in args.modes.split(","):
            print(f"=== {shape} {mode}", flush=True)
            row = run_one(shape, mode, args, work)
            report["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("bench_json", "log")}), flush=True)
            write_report(report, json_path)
    print(table(report))
    print(f"\nJSON: {json_path}")
    return 0 if report["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
