"""Capacity: the largest Qwen2.5 shape that PPO-trains with a critic of its own size on one GPU, full or LoRA, shared or resident.

For each shape of `--shapes`, each kind of fine-tuning of `--finetune` (`full`, `lora`:
the actor and the critic with adapters of `--lora-rank`) and each mode (`resident`,
then `shared`; `fit`: shared with `--memory-plan fit`, its row giving the GiB each step's plan
moved, `moved_gib`), one `bench/ppo_gpu_bench.py` run in its own process, on the bench's
work (256 prompts x 128 tokens, 512-token responses, KL loss on, so the reference is
there too), `--steps` steps and no probe. Each row says whether the run trained; its
steady step (the mean after the first, the step's wall clock); the device-wide peak GPU
memory; the peak host memory in use; the host buffers the sleep backend keeps; the
weight sync's seconds; and, for a run that did not train, why: `CUDA out of memory`,
the host's memory (Ray's memory monitor or the kernel killing a process), or the error's
last line, with the run's log kept. Beside each row, and alone for each shape of
`--estimate` not run, the arithmetic of the same run (`capacity_arithmetic.py`: the
GPU's peak, the host's memory, the disk, and the limit each passes).

`--lora-sync adapters,merged` runs each LoRA row once for each way its actor reaches the
engine (`--lora-sync`: the adapters alone, merged into the engine's base; or the whole
merged weights): the weight sync's A/B.

    source .gpu-kit/setup.sh && python3 bench/capacity_bench.py --out "$OUT" --shapes qwen2.5-1.5b,qwen2.5-3b
    source .gpu-kit/setup.sh && python3 bench/capacity_bench.py --out "$OUT" --shapes qwen2.5-7b \
        --finetune lora --modes shared --lora-sync adapters,merged
    source .gpu-kit/setup.sh && python3 bench/capacity_bench.py --out "$OUT" --shapes qwen2.5-3b --modes shared,fit \
        --steps 4 -- --response-len 2048
    ./uvw run python bench/capacity_bench.py --quick --finetune full,lora --out /tmp/capacity   # CPU smoke run

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
from capacity_arithmetic import GPU_GIB, Work, estimate
from ppo_harness import SHAPES, fmt, write_report

BENCH = Path(__file__).resolve().parent / "ppo_gpu_bench.py"
BENCH_MODE = {"fit": "shared_fit"}
"""The bench's own mode of each capacity mode: `fit` is its `shared_fit` (`--memory-plan fit`)."""
MODES = ("resident", "shared", "fit")


def why_it_failed(report: dict[str, Any] | None, log: str) -> str:
    text = log + json.dumps(report or {})
    if "CUDA out of memory" in text or "OutOfMemoryError: CUDA" in text:
        return "CUDA out of memory"
    if "running low on memory" in text or "Killed" in log or "SIGKILL" in text:
        return "host memory (a process killed)"
    errors = [m.get("error") for m in (report or {}).get("modes", {}).values() if m.get("error")]
    last = (errors[0] if errors else log).strip().splitlines()
    return last[-1][:200] if last else "no output"


def lora_flags(args: argparse.Namespace, sync: str) -> list[str]:
    """ppo_gpu_bench.py's `--set`s of a LoRA row: both roles' adapters, the base's sleep, the sync."""
    values = [f"lora_rank={args.lora_rank}", f"critic_lora_rank={args.lora_rank}", f"lora_sync={sync}"]
    values.append(f"lora_base_offload={str(args.lora_base_offload).lower()}")
    if args.lora_base_share is not None:  # else the driver's default: one copy wherever the bases sleep
        values.append(f"lora_base_share={str(args.lora_base_share).lower()}")
    return [flag for value in values for flag in ("--set", value)]


def run_one(
    shape: str, mode: str, args: argparse.Namespace, work: Path, *, finetune: str = "full", sync: str = ""
) -> dict[str, Any]:
    label = "-".join(part for part in (shape, finetune, sync, mode) if part)
    out = work / f"{label}.json"
    log_path = work / f"{label}.log"
    cmd = [sys.executable, str(BENCH), "--out", str(out), "--workdir", str(work / "models"), "--skip-probe"]
    cmd += ["--quick"] if args.quick else ["--shape", shape]
    cmd += ["--steps", str(args.steps), "--time-budget-s", str(args.time_budget_s)]
    # `fit`: the shared run with the memory plan (ppo_gpu_bench's shared_fit mode alone).
    cmd += {"resident": ["--skip-shared"], "shared": ["--skip-resident"]}.get(
        mode, ["--skip-shared", "--skip-resident", "--ab-memory-plan"]
    )
    if args.micro_batch_size is not None:
        cmd += ["--micro-batch-size", str(args.micro_batch_size)]
    cmd += lora_flags(args, sync) if finetune == "lora" else []
    cmd += args.bench_args
    started = time.time()
    with log_path.open("w") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.time_budget_s + 240, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    row: dict[str, Any] = {"shape": shape, "finetune": finetune, "mode": mode, "rc": rc}
    row |= {"lora_sync": sync or None, "wall_s": time.time() - started}
    report = json.loads(out.read_text()) if out.is_file() else None
    result = (report or {}).get("modes", {}).get(BENCH_MODE.get(mode, mode), {})
    trained = rc == 0 and bool(result.get("steps")) and not result.get("error")
    row["trained"] = trained
    row["steps"] = len(result.get("steps") or [])
    row["step_s"] = result.get("step_s_mean") if trained else None
    row["gpu_peak_gib"] = (result.get("gpu_peak_gib") or {}).get("overall")
    # Where the peak was (and, for a run that failed, how far it got): the row must say it once
    # the bench's own folder is gone with the machine.
    row["gpu_peak_gib_by_phase"] = (result.get("gpu_peak_gib") or {}).get("per_phase")
    row["host_used_peak_gib"] = result.get("host_used_peak_gib")
    row["host_buffer_gib"] = result.get("host_buffer_gib")
    row["weight_sync_s"] = (result.get("phase_s_mean") or {}).get("weight_sync") if trained else None
    row["engine_weight_update_s"] = result.get("engine_weight_update_s") if trained else None
    row["params"] = (report or {}).get("model", {}).get("params")
    row["moved_gib"] = result.get("moved_gib")  # the memory plan's, a step (fit)
    row["why_not"] = None if trained else why_it_failed(report, log_path.read_text(errors="replace")[-20000:])
    if rc is None:
        row["why_not"] = f"timed out after {args.time_budget_s + 240:.0f} s"
    if not trained:
        row["log_tail"] = log_path.read_text(errors="replace").splitlines()[-40:]
    row["bench_json"], row["log"] = str(out), str(log_path)
    return row


def first_gpu_gib() -> float | None:
    """The first GPU's memory in GiB, from nvidia-smi (no CUDA context in this process: the runs need the
    GPU); None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out[0]) / 1024 if out and out[0].isdigit() else None


def estimates(args: argparse.Namespace, shapes: list[str]) -> list[dict[str, Any]]:
    """The arithmetic of every (shape, fine-tuning, mode) of the run and of `--estimate`."""
    work = Work(micro_batch=args.micro_batch_size or Work.micro_batch, gpu_gib=args.gpu_gib)
    rows = []
    for shape in shapes:
        for finetune in args.finetune.split(","):
            for mode in args.modes.split(","):
                one = estimate(
                    shape,
                    SHAPES[shape],
                    finetune,  # type: ignore[arg-type]
                    "shared" if mode == "fit" else mode,  # type: ignore[arg-type]  # fit holds at most shared's
                    rank=args.lora_rank,
                    base_offload=args.lora_base_offload,
                    base_share=args.lora_base_share is not False,  # counted only where the bases sleep
                    work=work,
                )
                rows.append({**one.as_dict(), "mode": mode})
    return rows


def table(report: dict[str, Any]) -> str:
    """The runs and the arithmetic of every shape as one markdown table (est.: by arithmetic)."""
    lines = [
        "| shape | params | fine-tuning | mode | trains | step s | sync s | peak GPU GiB (est.) "
        "| peak host GiB (est.) | host buffers GiB | why not (arithmetic: what passes its limit) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    estimated = {(e["shape"], e["finetune"], e["mode"]): e for e in report["estimates"]}
    run_keys = set()
    for row in report["runs"]:
        key = (row["shape"], row.get("finetune", "full"), row["mode"])
        run_keys.add(key)
        est = estimated.get(key, {})
        buffers = row.get("host_buffer_gib")
        finetune = key[1] + (f" ({row['lora_sync']} sync)" if row.get("lora_sync") else "")
        why = row.get("why_not") or ""
        if est.get("why_not"):
            why = f"{why} ({est['why_not']})" if why else f"(est.: {est['why_not']})"
        lines.append(
            f"| {row['shape']} | {fmt((row.get('params') or est.get('params') or 0) / 1e9)} B | {finetune} "
            f"| {row['mode']} | {'yes' if row['trained'] else 'no'} | {fmt(row.get('step_s'))} "
            f"| {fmt(row.get('weight_sync_s'), '.3f')} "
            f"| {fmt(row.get('gpu_peak_gib'), '.1f')} ({fmt(est.get('gpu_peak_gib'), '.0f')}) "
            f"| {fmt(row.get('host_used_peak_gib'), '.1f')} ({fmt(est.get('host_gib'), '.0f')}) "
            f"| {fmt(sum(buffers.values()) if buffers else None, '.1f')} | {why} |"
        )
    for key, est in estimated.items():
        if key in run_keys:
            continue
        lines.append(
            f"| {key[0]} | {fmt(est['params'] / 1e9)} B | {key[1]} | {key[2]} | {'no' if est['why_not'] else 'fits'} "
            f"(est.) | | | ({fmt(est['gpu_peak_gib'], '.0f')}) | ({fmt(est['host_gib'], '.0f')}) | "
            f"| {est['why_not'] or 'arithmetic only'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder (or a .json path) for the results")
    parser.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-3b", help="comma-separated shapes to run")
    parser.add_argument(
        "--estimate",
        default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-3b,qwen2.5-7b,qwen2.5-14b,qwen2.5-32b",
        help="shapes whose arithmetic the table gets, run or not",
    )
    parser.add_argument("--modes", default="resident,shared")
    parser.add_argument(
        "--finetune", default="full", help="comma-separated: full, lora (both roles' adapters)"
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="the LoRA rows' rank (actor and critic)")
    parser.add_argument(
        "--lora-base-offload",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the LoRA rows' bases sleep on the host, copied there once (the driver's default); "
        "--no-lora-base-offload: they stay on the GPU",
    )
    parser.add_argument(
        "--lora-base-share",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the LoRA rows' actor and critic keep one host copy of their bases (the driver's "
        "lora_base_share; unset: its default, one copy wherever the bases sleep on the host); "
        "--no-lora-base-share: one copy each",
    )
    parser.add_argument(
        "--lora-sync",
        default="adapters",
        help="comma-separated: adapters, merged; each LoRA row once for each (the weight sync's A/B)",
    )
    parser.add_argument("--micro-batch-size", type=int, default=None, help="the runs' and the arithmetic's")
    parser.add_argument(
        "--gpu-gib",
        type=float,
        default=None,
        help="the arithmetic's GPU memory (default: the first GPU's, from nvidia-smi; without one the H200's 140)",
    )
    parser.add_argument("--steps", type=int, default=2, help="steps a run (the first is its warm-up)")
    parser.add_argument("--time-budget-s", type=float, default=240.0, help="each run's --time-budget-s")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: the bench's tiny model")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("bench_args", nargs="*", help="after --: more ppo_gpu_bench.py arguments")
    args = parser.parse_args(argv)
    bad = [f for f in args.finetune.split(",") if f not in ("full", "lora")]
    bad += [m for m in args.modes.split(",") if m not in MODES]
    bad += [s for s in args.lora_sync.split(",") if s not in ("adapters", "merged")]
    if bad:
        parser.error(
            f"{bad[0]!r}: --finetune takes full, lora; --modes resident, shared, fit; --lora-sync adapters, merged"
        )
    if args.gpu_gib is None:
        args.gpu_gib = first_gpu_gib() or GPU_GIB
    elif args.gpu_gib <= 0:
        parser.error(f"--gpu-gib {args.gpu_gib}: give the GPU's memory in GiB, e.g. 80 for an H100")
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
        "gpu_gib": args.gpu_gib,
        "estimates": estimates(args, [s for s in dict.fromkeys([*estimated, *shapes]) if s in SHAPES]),
        "runs": [],
    }
    for shape in shapes:
        for finetune in args.finetune.split(","):
            for sync in args.lora_sync.split(",") if finetune == "lora" else [""]:
                for mode in args.modes.split(","):
                    print(f"=== {shape} {finetune} {sync} {mode}", flush=True)
                    row = run_one(shape, mode, args, work, finetune=finetune, sync=sync)
                    report["runs"].append(row)
                    print(
                        json.dumps({k: v for k, v in row.items() if k not in ("bench_json", "log")}),
                        flush=True,
                    )
                    write_report(report, json_path)
    print(table(report))
    print(f"\nJSON: {json_path}")
    return 0 if report["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
