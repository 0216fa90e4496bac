"""Shared PPO on two GPUs with the real `ppo-driver train`: TP=2, DP=2, a critic with its own layout.

Issue 16's bench. Everything is built here (the random Qwen2.5-0.5B-shaped model, its
tokenizer, the prompts and the dense reward of bench/ppo_gpu_bench.py), then each run
is one `python3 -m tandem.ppo.app.cli train --config RUN.yaml` in a fresh process, on the
same seed and data:

| run | actor | critic | where |
|---|---|---|---|
| `one_gpu` | TP 1 | TP 1 | one GPU: the reference curves |
| `tp2`, `tp2_resident` | TP 2 | TP 2 | two GPUs, one engine on each |
| `dp2`, `dp2_resident` | DP 2 | DP 2 | two GPUs, values routed per rank |
| `own`, `own_resident` | TP 2 | DP 2 | two GPUs, the critic's own layout |
| `split` | TP 1 | TP 1 | actor and critic on GPU 0, the engine on GPU 1 (`--no-colocate`) |

`*_resident` is `--no-offload-train`: nothing sleeps, so the NCCL groups are never
torn down. Per run: the driver's per-step `time/*`, `memory/*_gib` (nvidia-smi at each
phase's end, the fuller GPU) and `lifecycle/*` seconds, the reward and loss curves, the
engines' weight fingerprints after every sync (events.jsonl `weights_received`: equal on
both engines, and changing from step to step), and the exported HF folder. Then:

- **bit-identical**: each shared run's metrics and final exported weights against its
  resident twin (every tensor `torch.equal`);
- **asleep**: the GPU memory in use once the actor has gone to sleep after its update
  (both models asleep, the engine's memory released), less what was in use before the
  run and the CUDA contexts of the processes on that GPU (a bare context is measured
  here first, by a child process), per process;
- **curves**: reward and losses per step of every run next to `one_gpu`'s;
- **cross-GPU weight sync** (`split`): `time/weight_sync` next to a copy of the same bytes
  from GPU 0 to GPU 1, device to device and through pinned host memory, timed here.

Results: `OUT/two_gpu_bench.json` (rewritten after every run) and each run's
metrics.jsonl, events.jsonl and log under `OUT/two_gpu_runs/<run>/`; a markdown
summary is printed. `--runs` picks runs (comma list), `--time-budget-s` skips those
that would not fit.

GPU host with two GPUs, from the repo root:

    source .gpu-kit/setup.sh && python3 bench/two_gpu_bench.py --out "$OUT"

CPU smoke run (tiny model, gloo, two logical GPUs; the memcpy row is skipped):

    ./uvw run python bench/two_gpu_bench.py --quick --out /tmp/two-gpu-bench
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ppo_harness as single  # the model, tokenizer, prompts and reward builders

GIB = 1024**3

LAYOUTS: dict[str, dict[str, Any]] = {
    "one_gpu": {"local_gpus": 1, "actor_num_gpus_per_node": 1, "tensor_model_parallel_size": 1},
    "tp2": {"local_gpus": 2, "actor_num_gpus_per_node": 2, "tensor_model_parallel_size": 2},
    "dp2": {"local_gpus": 2, "actor_num_gpus_per_node": 2, "tensor_model_parallel_size": 1},
    "own": {
        "local_gpus": 2,
        "actor_num_gpus_per_node": 2,
        "tensor_model_parallel_size": 2,
        "critic_tensor_model_parallel_size": 1,
    },
    "split": {
        "local_gpus": 2,
        "actor_num_gpus_per_node": 1,
        "tensor_model_parallel_size": 1,
        "colocate": False,
        "rollout_num_gpus": 1,
    },
}
RUNS = ("tp2", "tp2_resident", "dp2", "dp2_resident", "own", "own_resident", "split", "one_gpu")
PROCESSES_PER_GPU = 3
"""Actor rank, critic rank and engine share each GPU in the colocated layouts."""


def run_values(args: argparse.Namespace, name: str, paths: dict[str, Path]) -> dict[str, Any]:
    """The PPOConfig fields of one run."""
    layout, resident, _ = name.partition("_resident")
    values: dict[str, Any] = {
        "hf_checkpoint": str(paths["hf"]),
        "prompt_data": str(paths["data"]),
        "input_key": "prompt",
        "apply_chat_template": False,
        "max_prompt_len": args.prompt_len,
        "run_dir": str(paths["work"] / name),
        "num_rollout": args.steps,
        "rollout_batch_size": args.prompts,
        "n_samples_per_prompt": 1,
        "global_batch_size": args.prompts,
        "micro_batch_size": args.micro_batch_size,
        "rollout_max_response_len": args.response_len,
        "rollout_ignore_eos": True,
        "custom_rm_path": f"{paths['reward']}:first_half_letters",
        "lr": args.lr,
        "critic_lr": args.critic_lr,
        "use_kl_loss": True,
        "kl_loss_coef": 0.001,
        "seed": args.seed,
        "device": "cpu" if args.quick else "cuda",
        "params_dtype": "float32" if args.quick else "bfloat16",
        "offload_backend": "pinned_host",
        "offload_train": not resident,
        "memory_plan": "whole",  # sleeping is whole-role sleep here: what must change nothing
        "local_single_rank_groups": args.local_single_rank_groups,
        "keep_single_rank_groups": args.keep_single_rank_groups,
        # The same engine budget in every run, so that shared and resident generate alike.
        "rollout_kv_cache_memory_fraction": args.kv_fraction,
        "export_hf": True,
        "tensorboard": False,
        "progress": False,
        "save_interval": None,
        "eval_interval": None,
        **LAYOUTS[layout],
    }
    if layout == "split":
        values.pop("rollout_kv_cache_memory_fraction")  # the engine has its GPU to itself
    return values


# --- measuring ----------------------------------------------------------------------------------------------
def gpu_used_gib() -> list[float] | None:
    """Memory in use on each GPU (nvidia-smi), GiB; None without GPUs."""
    from tandem.megatron.runtime.gpu_memory import all_devices_used_bytes

    used = all_devices_used_bytes()
    return None if used is None else [b / GIB for b in used]


CONTEXT_CHILD = """
import subprocess, sys, torch
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                     capture_output=True, text=True).stdout
print(int(out.split()[0]) / 1024)
"""


def cuda_context_gib() -> float | None:
    """GPU 0's memory with a bare torch CUDA context in a child process, less without it."""
    before = gpu_used_gib()
    if before is None:
        return None
    child = subprocess.run(
        [sys.executable, "-c", CONTEXT_CHILD],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"),
    )
    return float(child.stdout.split()[-1]) - before[0]


def copy_reference(nbytes: int, repeats: int = 5) -> dict[str, float] | None:
    """Seconds to copy `nbytes` from GPU 0 to GPU 1: device to device, and through pinned host memory."""
    import torch

    if torch.cuda.device_count() < 2:
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            times.append(time.perf_counter() - t0)
        return min(times)

    def via_host() -> None:
        host.copy_(src, non_blocking=True)
        torch.cuda.synchronize(0)
        dst.copy_(host, non_blocking=True)

    return {"device_to_device_s": best(lambda: dst.copy_(src)), "via_pinned_host_s": best(via_host)}


# --- reading a run ------------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def median_of(rows: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    keys = sorted(
        {k for r in rows for k, v in r.items() if k.startswith(prefix) and isinstance(v, int | float)}
    )
    # The first step pays one-off costs (first NCCL use, CUDA graphs, host buffers): medians of the rest.
    steady = rows[1:] or rows
    return {k: statistics.median(r[k] for r in steady if k in r) for k in keys}


CURVE_KEYS = ("reward/mean", "actor/pg_loss", "critic/value_loss", "actor/kl_loss")


def summarize_run(result: dict[str, Any], run_dir: Path) -> None:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    result["steps"] = len(rows)
    result["time"] = median_of(rows, "time/")
    result["memory_gib"] = {
        k: max(r[k] for r in rows if k in r)
        for k in sorted({k for r in rows for k in r if k.startswith("memory/")})
    }
    result["lifecycle"] = median_of(rows, "lifecycle/")
    result["curves"] = {k: [r.get(k) for r in rows] for k in CURVE_KEYS}
    # The steps' syncs, and those after a save on shared GPUs (the engines release their memory
    # for it and take the same weights back): those resend the weights of the step before.
    received, after_saves, in_step, last = [], [], False, None
    for e in events:
        if e["event"] in ("step_begin", "step_end"):
            in_step = e["event"] == "step_begin"
        elif e["event"] == "weights_received":
            if in_step:
                received.append(e)
            else:
                after_saves.append(e["digests"][0] == last)
            last = e["digests"][0]
    digests = [e["digests"][0] for e in received]
    result["weights_received"] = {
        "syncs": len(received),
        "engines": len(received[0]["digests"]) if received else 0,
        "all_engines_agree": bool(received) and all(e["agree"] for e in received),
        "changed_every_sync": all(a != b for a, b in itertools.pairwise(digests)),
        "after_saves": len(after_saves),
        "saves_resend_the_weights": all(after_saves),
    }
    result["metrics_rows"] = rows


def compare_weights(a: Path, b: Path) -> dict[str, Any]:
    """Every tensor of two exported HF folders, bit for bit."""
    import torch
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    ta, tb = tensors(a), tensors(b)
    if not ta or ta.keys() != tb.keys():
        return {"identical": False, "why": f"tensor names differ or none ({len(ta)} vs {len(tb)})"}
    differing = [k for k in ta if not torch.equal(ta[k], tb[k])]
    max_diff = max((float((ta[k].float() - tb[k].float()).abs().max()) for k in differing), default=0.0)
    return {
        "identical": not differing,
        "tensors": len(ta),
        "differing": len(differing),
        "max_abs_diff": max_diff,
    }


def compare_metrics(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Training metrics (not times, memory or lifecycle) of two runs, step by step."""
    skip = ("time/", "train_time/", "memory/", "lifecycle/", "throughput/", "perf/", "alloc/")
    differing = sorted(
        {
            k
            for ra, rb in zip(a, b, strict=False)
            for k, v in ra.items()
            if isinstance(v, int | float) and not k.startswith(skip) and rb.get(k) != v and v == v
        }
    )
    return {
        "steps": min(len(a), len(b)),
        "identical": not differing and len(a) == len(b),
        "differing": differing,
    }


# --- the bench ----------------------------------------------------------------------------------------------
def run_one(name: str, args: argparse.Namespace, paths: dict[str, Path], report: dict[str, Any]) -> None:
    from tandem.ppo.config.file import unvalidated, write_yaml

    values = run_values(args, name, paths)
    run_dir = Path(values["run_dir"])
    keep = paths["out"] / "two_gpu_runs" / name
    keep.mkdir(parents=True, exist_ok=True)
    config_path = keep / "config.yaml"
    write_yaml(unvalidated(values), config_path)
    result: dict[str, Any] = {"command": f"python3 -m tandem.ppo.app.cli train --config {config_path}"}
    report["runs"][name] = result
    result["gpu_used_before_gib"] = gpu_used_gib()
    started = time.time()
    with open(keep / "log.txt", "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "tandem.ppo.app.cli", "train", "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=args.run_timeout_s,
            check=False,
        )
    result["wall_s"] = time.time() - started
    result["exit_code"] = proc.returncode
    for file in ("metrics.jsonl", "events.jsonl"):
        if (run_dir / file).is_file():
            (keep / file).write_bytes((run_dir / file).read_bytes())
    summarize_run(result, run_dir)
    if proc.returncode != 0:
        result["error"] = (keep / "log.txt").read_text()[-4000:]
    print(f"[{name}] exit {proc.returncode}, {result['steps']} steps, {result['wall_s']:.0f} s", flush=True)


def analyse(report: dict[str, Any], paths: dict[str, Path]) -> None:
    runs = report["runs"]
    context = report.get("cuda_context_gib")
    for name, result in runs.items():
        twin = runs.get(f"{name}_resident")
        here = paths["work"] / name / "hf"
        if (
            twin is not None
            and not name.endswith("_resident")
            and result.get("steps")
            and twin.get("steps")
            and here.is_dir()
        ):
            result["vs_resident"] = {
                "metrics": compare_metrics(result["metrics_rows"], twin["metrics_rows"]),
                "weights": compare_weights(
                    paths["work"] / name / "hf", paths["work"] / f"{name}_resident" / "hf"
                ),
            }
        asleep = result.get("memory_gib", {}).get("memory/actor_sleep_gib")
        before = result.get("gpu_used_before_gib")
        colocated = LAYOUTS[name.partition("_resident")[0]].get("colocate", True)
        if (
            asleep is not None
            and before
            and context is not None
            and colocated
            and not name.endswith("_resident")
        ):
            beyond = asleep - max(before) - PROCESSES_PER_GPU * context
            result["asleep_beyond_contexts_gib_per_process"] = beyond / PROCESSES_PER_GPU
        reference = runs.get("one_gpu", {}).get("curves")
        if reference and result.get("curves") and name != "one_gpu":
            result["vs_one_gpu"] = {
                k: [None if a is None or b is None else a - b for a, b in zip(v, reference[k], strict=False)]
                for k, v in result["curves"].items()
            }
    split = runs.get("split")
    if split and split.get("time") and report.get("copy_reference"):
        split["weight_sync_vs_copy"] = {
            "weight_sync_s": split["time"].get("time/weight_sync"),
            **report["copy_reference"],
        }


def plot_curves(report: dict[str, Any], path: Path) -> None:
    """Reward and losses per step of every run, one panel each (skipped where matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    keys = CURVE_KEYS[:3]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6))
    for name, r in report["runs"].items():
        curves = r.get("curves") or {}
        style = "--" if name.endswith("_resident") else "-"
        for ax, key in zip(axes, keys, strict=True):
            ys = curves.get(key) or []
            if ys:
                ax.plot(range(len(ys)), ys, style, marker="o", markersize=3, label=name)
    for ax, key in zip(axes, keys, strict=True):
        ax.set_title(key)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"two_gpu_bench: {report['shape']} ({report.get('gpu') or 'CPU'})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(paths: list[Path]) -> dict[str, Any]:
    """Several reports of this bench (e.g. one per device call) as one: later runs of a name win."""
    report = json.loads(paths[0].read_text())
    for path in paths[1:]:
        other = json.loads(path.read_text())
        report["runs"].update({n: r for n, r in other["runs"].items() if r.get("steps")})
        for key in ("cuda_context_gib", "copy_reference"):
            report[key] = report.get(key) if report.get(key) is not None else other.get(key)
    report["runs"] = {n: report["runs"][n] for n in RUNS if n in report["runs"]}
    return report


def fmt(x: Any, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def print_summary(report: dict[str, Any]) -> None:
    print(
        f"\n{report['shape']}; {report.get('gpu')}; bare CUDA context {fmt(report.get('cuda_context_gib'))} GiB\n"
    )
    phases = ("generate", "critic_train", "actor_train", "weight_sync", "critic_sleep", "actor_sleep", "step")
    print(
        "| run | exit | "
        + " | ".join(f"{p} s" for p in phases)
        + " | peak GiB | asleep GiB/proc | same as resident |"
    )
    print("|---|---|" + "---:|" * len(phases) + "---:|---:|---|")
    for name, r in report["runs"].items():
        t = r.get("time", {})
        peak = max(r.get("memory_gib", {}).values(), default=None)
        same = r.get("vs_resident")
        same_txt = (
            "–"
            if same is None
            else f"metrics {'yes' if same['metrics']['identical'] else 'no'}, "
            f"weights {'yes' if same['weights'].get('identical') else 'no'}"
        )
        if r.get("skipped"):
            print(f"| {name} | not run: {r['skipped']} |" + " |" * (len(phases) + 3))
            continue
        cells = " | ".join(fmt(t.get(f"time/{p}")) for p in phases)
        print(
            f"| {name} | {r.get('exit_code')} | {cells} | {fmt(peak)} | "
            f"{fmt(r.get('asleep_beyond_contexts_gib_per_process'))} | {same_txt} |"
        )
    print("\nweights reached every engine:")
    for name, r in report["runs"].items():
        print(f"- {name}: {r.get('weights_received')}")
    split = report["runs"].get("split", {}).get("weight_sync_vs_copy")
    if split:
        print(f"\ncross-GPU weight sync ({report.get('weight_bytes', 0) / GIB:.2f} GiB): {split}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the results")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, gloo")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    p.add_argument("--steps", type=int, default=None, help="PPO steps a run (default 4; --quick 2)")
    p.add_argument("--prompts", type=int, default=None, help="prompts a step (default 64; --quick 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128; --quick 8")
    p.add_argument("--response-len", type=int, default=None, help="default 128; --quick 8")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default 8; --quick 4")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--critic-lr", type=float, default=1e-5)
    p.add_argument(
        "--kv-fraction", type=float, default=0.3, help="engine KV-cache budget (same in every run)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--no-local-single-rank-groups",
        dest="local_single_rank_groups",
        action="store_false",
        help="one-rank groups get NCCL communicators (torn down at each sleep) instead of answering in the process",
    )
    p.add_argument(
        "--keep-single-rank-groups",
        action="store_true",
        help="with --no-local-single-rank-groups: the one-rank communicators stay alive while asleep",
    )
    p.add_argument("--run-timeout-s", type=float, default=400)
    p.add_argument("--time-budget-s", type=float, default=560, help="skip runs that would end after this")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="run nothing: merge these reports (later runs of a name win), print the summary, draw the curves",
    )
    args = p.parse_args(argv)
    defaults = (2, 8, 8, 8, 4) if args.quick else (4, 64, 128, 128, 8)
    for name, default in zip(
        ("steps", "prompts", "prompt_len", "response_len", "micro_batch_size"), defaults, strict=True
    ):
        if getattr(args, name) is None:
            setattr(args, name, default)
    unknown = set(args.runs.split(",")) - set(RUNS)
    if unknown:
        p.error(f"--runs: unknown {sorted(unknown)}; pick from {', '.join(RUNS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        merged = merge(args.from_json)
        args.out.mkdir(parents=True, exist_ok=True)
        analyse(merged, {"work": args.out / "missing"})
        (args.out / "two_gpu_bench.json").write_text(json.dumps(merged, indent=2, default=str))
        print_summary(merged)
        plot_curves(merged, args.out / "two_gpu_bench_curves.png")
        return 0
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    started = time.time()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="two-gpu-bench-"))
    paths = {"out": out, "work": work, "json": out / "two_gpu_bench.json"}
    report: dict[str, Any] = {
        "bench": "two_gpu_bench",
        "command": "python3 bench/two_gpu_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "gpu": single.gpu_name(),
        "shape": (
            f"{args.prompts} prompts x {args.prompt_len} tokens, 1 response of {args.response_len} tokens, "
            f"{args.steps} steps, micro batch {args.micro_batch_size}, KL loss on"
        ),
        "runs": {},
    }

    def save() -> None:
        slim = {
            **report,
            "runs": {
                n: {k: v for k, v in r.items() if k != "metrics_rows"} for n, r in report["runs"].items()
            },
        }
        paths["json"].write_text(json.dumps(slim, indent=2, default=str))

    status = 0
    try:
        shape = single.QUICK_MODEL if args.quick else single.QWEN_05B
        paths["hf"] = work / "policy-hf"
        params = single.build_policy(
            paths["hf"], shape, dtype="float32" if args.quick else "bfloat16", seed=args.seed
        )
        report["model"] = {"family": "qwen2", **shape, "params": params}
        report["weight_bytes"] = params * (4 if args.quick else 2)
        paths["data"] = work / "prompts.jsonl"
        single.write_prompts(
            paths["data"], paths["hf"], n=args.prompts * args.steps, prompt_len=args.prompt_len, seed=0
        )
        paths["reward"] = work / "bench_reward.py"
        paths["reward"].write_text(single.REWARD_SOURCE)
        if not args.quick:
            report["cuda_context_gib"] = cuda_context_gib()
            report["copy_reference"] = copy_reference(report["weight_bytes"])
            import torch

            torch.cuda.empty_cache()
        save()
        durations: list[float] = []
        for name in args.runs.split(","):
            expected = max(durations, default=0.0)
            if durations and time.time() - started + expected > args.time_budget_s:
                report["runs"][name] = {"skipped": f"time budget ({args.time_budget_s:.0f} s)"}
                print(f"[{name}] skipped: time budget", flush=True)
                continue
            t0 = time.time()
            try:
                run_one(name, args, paths, report)
            except Exception:
                report["runs"][name] = {"error": traceback.format_exc()[-4000:]}
            durations.append(time.time() - t0)
            if report["runs"][name].get("exit_code") != 0:
                status = 1
            analyse(report, paths)
            save()
    except Exception:
        report["error"] = traceback.format_exc()[-6000:]
        print(report["error"], file=sys.stderr)
        status = 1
    analyse(report, paths)
    save()
    print_summary(report)
    plot_curves(report, out / "two_gpu_bench_curves.png")
    print(f"\nJSON: {paths['json']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
