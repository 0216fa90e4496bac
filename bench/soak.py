"""Soak: a long run's resources, step by step, and the slope of each; a leak is a slope.

The run is the real driver (`PPODriver.run`: its loop, saves, evals), started again
`--resumes` times as a preemption would: each start is a process of its own that
stops itself with SIGTERM after its share of the steps (the loop finishes the step
and saves it) and the next resumes from that checkpoint. After every step it records:

- host memory: the resident set (RSS) of the driver, of each worker process (actor and
  critic ranks, engines, found through Ray's `__ray_call__`) and of Ray's own processes
  (GCS, raylet, idle workers: the driver's other descendants), with each one's open file
  descriptors and threads;
- pinned host memory: torch's pinned-host allocator in each worker (GPU only) and the bytes
  the sleep backend keeps in host buffers (`host_buffer_bytes`);
- GPU memory, allocated and reserved by torch, of each model right after it wakes and right
  after it sleeps, and of the engine awake and released (GPU only);
- the run folder's size, and the step's seconds.

Each series gets a least-squares line per start (the first `--warmup` steps of a start
left out: allocator caches and lazy imports fill then), and one slope for all starts
(the same slope, an intercept per start: processes begin afresh at each resume); the run
folder's slope is fitted over the whole run, since the folder carries over. Slopes are
given per 100 steps, with their standard error and their share of the series' mean.

CPU, the demo (a tiny model; 500 steps, a save every 10, two resumes; about an hour on
two cores; run it alone):

    nice -n 10 ./uvw run python bench/soak.py --steps 500 --save-interval 10 --resumes 2 --out docs/results/soak_cpu.json

One H200, the 0.5B bench shape (`bench/ppo_gpu_bench.py`'s defaults: 256 prompts x 128
tokens, 512-token responses, KL loss), shared:

    source .gpu-kit/setup.sh && python3 bench/soak.py --shape qwen2.5-0.5b --steps 200 --save-interval 10 --resumes 1 --out "$OUT/soak_h200.json"

Quick CPU smoke runs (12 steps, one resume), of the demo and of the GPU path (the GPU bench's
CPU smoke model in its shared mode):

    ./uvw run python bench/soak.py --quick --out /tmp/soak.json
    ./uvw run python bench/soak.py --quick --shape qwen2.5-0.5b --out /tmp/soak-gpu-path.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

RUN_FOLDER_KEY = "run_dir_bytes"
"""The one series fitted over the whole run (the folder carries over from start to start)."""


# --- fits --------------------------------------------------------------------------------------


def fit(points: list[tuple[int, float, int]]) -> dict[str, Any] | None:
    """One slope for (step, value, start) points, an intercept per start; per 100 steps, with its
    standard error, R² within starts, and its share of the mean. None with fewer than 3 points."""
    by_start: dict[int, list[tuple[int, float]]] = {}
    for step, value, start in points:
        by_start.setdefault(start, []).append((step, value))
    sxx = sxy = 0.0
    centred: list[tuple[float, float]] = []
    for pts in by_start.values():
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        centred += [(x - mx, y - my) for x, y in pts]
    for dx, dy in centred:
        sxx += dx * dx
        sxy += dx * dy
    n, dof = len(centred), len(centred) - 1 - len(by_start)
    if n < 3 or sxx == 0 or dof < 1:
        return None
    slope = sxy / sxx
    residual = sum((dy - slope * dx) ** 2 for dx, dy in centred)
    total = sum(dy * dy for _, dy in centred)
    stderr = math.sqrt(residual / dof / sxx)
    mean = sum(v for _, v, _ in points) / len(points)
    return {
        "per_100_steps": 100 * slope,
        "stderr_per_100_steps": 100 * stderr,
        "share_of_mean_per_100_steps": 100 * (100 * slope) / mean if mean else None,
        "r2": 1 - residual / total if total else None,
        "points": n,
        "starts": len(by_start),
        "mean": mean,
    }


def series(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float, int]]]:
    """Every numeric leaf of the records' `values` as (step, value, start) points, by dotted key."""
    out: dict[str, list[tuple[int, float, int]]] = {}

    def walk(prefix: str, node: Any, step: int, start: int) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v, step, start)
        elif isinstance(node, int | float) and not isinstance(node, bool) and math.isfinite(node):
            out.setdefault(prefix, []).append((step, float(node), start))

    for r in records:
        walk("", r["values"], r["step"], r["start"])
    return out


def slopes(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Each series' `fit`: within starts after their first `warmup` steps; the run folder over the run."""
    first = {}
    for r in records:
        first.setdefault(r["start"], r["step"])
    fits: dict[str, Any] = {}
    for key, points in sorted(series(records).items()):
        if key == RUN_FOLDER_KEY:
            fits[key] = fit([(s, v, 0) for s, v, _ in points])
            continue
        kept = [(s, v, st) for s, v, st in points if s >= first[st] + warmup]
        fits[key] = fit(kept)
        if fits[key] is not None:
            each = {st: fit([p for p in kept if p[2] == st]) for st in sorted({p[2] for p in kept})}
            fits[key]["per_start_per_100_steps"] = {st: f and f["per_100_steps"] for st, f in each.items()}
    return fits


# --- what a process holds (Linux /proc; no dependency) ------------------------------------------


def proc_stats(pid: int) -> dict[str, Any] | None:
    """RSS bytes, open file descriptors and threads of process `pid`, and its name; None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields.get("VmRSS", "0 kB").split()[0])
    return {
        "rss": rss_kib * 1024,
        "fds": fds,
        "threads": int(fields["Threads"]),
        "name": cmdline.strip()[:80],
    }


def descendants(root: int) -> list[int]:
    """The pids below `root` in the process tree (Ray's daemons and workers below the driver)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, pp in parent.items() if pp == pid]
        found += children
        frontier += children
    return found


def folder_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def inside_worker(actor: Any) -> dict[str, Any]:
    """Run in a worker process (through `__ray_call__`): its pid, and what torch and the sleep backend hold."""
    out: dict[str, Any] = {"pid": os.getpid()}
    worker = getattr(actor, "_worker", None)
    if worker is not None and hasattr(worker, "host_buffer_bytes"):
        out["host_buffers"] = worker.host_buffer_bytes()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu_allocated"] = torch.cuda.memory_allocated()
        out["gpu_reserved"] = torch.cuda.memory_reserved()
        try:
            host = torch.cuda.host_memory_stats()
            out["pinned_allocated"] = host.get("allocated_bytes.current")
            out["pinned_reserved"] = host.get("reserved_bytes.current")
        except (AttributeError, RuntimeError):
            pass
    return out


# --- one start (a process of its own) ------------------------------------------------------------


def soak_driver_class() -> type:
    """PPODriver that records what each process holds after every step, and stops itself after `stop_after`."""
    import ray

    from tandem.ppo.loop.driver import PPODriver

    class SoakDriver(PPODriver):
        start_index: int
        stop_after: int | None
        out: Any
        gpu: dict[str, dict[str, Any]]

        def _workers(self) -> dict[str, Any]:
            named = {f"{g.role}-{r}": h for g in self._models() for r, h in enumerate(g.workers)}
            named |= {f"engine-{r}": h for r, h in enumerate(self.engines.handles)}
            return named

        def _inside(self, handles: dict[str, Any]) -> dict[str, Any]:
            refs = {name: h.__ray_call__.remote(inside_worker) for name, h in handles.items()}
            return {name: ray.get(ref, timeout=300) for name, ref in refs.items()}

        def _gpu_of(self, role: str, when: str, handles: dict[str, Any]) -> None:
            for name, found in self._inside(handles).items():
                if "gpu_allocated" in found:
                    self.gpu.setdefault(name, {})[when] = {
                        "allocated": found["gpu_allocated"],
                        "reserved": found["gpu_reserved"],
                    }

        def _wake(self, group: Any) -> None:
            super()._wake(group)
            self._gpu_of(group.role, "awake", {f"{group.role}-{r}": h for r, h in enumerate(group.workers)})

        def _sleep(self, group: Any) -> None:
            super()._sleep(group)
            self._gpu_of(group.role, "asleep", {f"{group.role}-{r}": h for r, h in enumerate(group.workers)})

        def _release_engines(self) -> None:
            super()._release_engines()
            self._gpu_of("engine", "released", {f"engine-{r}": h for r, h in enumerate(self.engines.handles)})

        def step(self, rollout_id: int, sampled: Any = None, *, start_next: Any = None) -> dict[str, Any]:
            self.gpu = {}
            metrics = super().step(rollout_id, sampled, start_next=start_next)
            workers = self._inside(self._workers())
            for name, found in workers.items():  # the engines awake again, the models asleep
                if name.startswith("engine") and "gpu_allocated" in found:
                    self.gpu.setdefault(name, {})["awake"] = {
                        "allocated": found["gpu_allocated"],
                        "reserved": found["gpu_reserved"],
                    }
            values = self._host(workers)
            values["gpu"] = self.gpu
            values[RUN_FOLDER_KEY] = folder_bytes(self.run_dir)
            values["time_step_s"] = metrics.get("time/step")
            record = {"start": self.start_index, "step": rollout_id, "t": time.time(), "values": values}
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()
            if self.stop_after is not None and rollout_id == self.stop_after:
                os.kill(
                    os.getpid(), signal.SIGTERM
                )  # as a scheduler would: the loop saves this step, then stops
            return metrics

        def _host(self, workers: dict[str, dict[str, Any]]) -> dict[str, Any]:
            me = os.getpid()
            known = {found["pid"]: name for name, found in workers.items()}
            host: dict[str, Any] = {"driver": _numbers(proc_stats(me))}
            ray_own = {"rss": 0, "fds": 0, "threads": 0, "processes": 0}
            for pid in descendants(me):
                stats = proc_stats(pid)
                if stats is None:
                    continue
                if pid in known:
                    name = known[pid]
                    host[name] = _numbers(stats) | {
                        k: workers[name].get(k)
                        for k in ("host_buffers", "pinned_allocated", "pinned_reserved")
                    }
                else:
                    for k in ("rss", "fds", "threads"):
                        ray_own[k] += stats[k]
                    ray_own["processes"] += 1
            host["ray"] = ray_own
            host["total"] = {
                k: sum(v.get(k) or 0 for v in host.values() if isinstance(v, dict))
                for k in ("rss", "fds", "threads")
            }
            host["total"]["pinned_and_host_buffers"] = sum(
                (v.get("host_buffers") or 0) + (v.get("pinned_reserved") or 0) for v in host.values()
            )
            return {"host": host}

    return SoakDriver


def _numbers(stats: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (stats or {}).items() if k != "name"}


def run_start(values: dict[str, Any], start_index: int, stop_after: int | None, out_path: Path) -> int:
    """One start of the run: the driver from the run folder's checkpoint, until `stop_after` or the end."""
    from tandem.ppo.config.file import unvalidated
    from tandem.ppo.run.log import Interrupted

    driver = soak_driver_class()(unvalidated(values))
    driver.start_index, driver.stop_after = start_index, stop_after
    with out_path.open("a") as out:
        driver.out = out
        try:
            driver.setup()
            driver.run()
        except Interrupted:
            pass  # the stop this start asked for: the step saved
        finally:
            driver.close()
    return 0


# --- the whole soak ----------------------------------------------------------------------------


def run_values(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The PPOConfig fields of the soaked run: the demo's, or the GPU bench's shared mode of `--shape`."""
    run_dir = work / "run"
    common = {"num_rollout": args.steps, "save_interval": args.save_interval, "progress": False}
    if args.shape is None:
        from tandem.ppo._demo import DEMO_DEFAULTS, prepare_demo

        return prepare_demo({**DEMO_DEFAULTS, "run_dir": str(run_dir), "tensorboard": True, **common})
    import ppo_gpu_bench
    from ppo_harness import QUICK_MODEL, REWARD_SOURCE, SHAPES, build_policy, write_prompts

    # The GPU bench's own shared mode; with --quick its CPU smoke shape (the same path, tested on a CPU).
    bench = ppo_gpu_bench.parse_args(
        ["--out", str(work), "--shape", args.shape, *(["--quick"] if args.quick else [])]
    )
    hf_dir, data, reward = work / "policy", work / "prompts.jsonl", work / "bench_reward.py"
    shape, dtype = (QUICK_MODEL, "float32") if args.quick else (SHAPES[args.shape], "bfloat16")
    bench.stop_token_ids = ()  # the bench's fixed lengths (as its main sets them)
    build_policy(hf_dir, shape, dtype=dtype, seed=bench.seed)
    write_prompts(data, hf_dir, n=bench.prompts * 8, prompt_len=bench.prompt_len, seed=0)  # 8 steps an epoch
    reward.write_text(REWARD_SOURCE)
    values = ppo_gpu_bench.ppo_values(bench, "shared", hf_dir, data, reward, run_dir)
    return {**values, **common}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the report (JSON); the samples go beside it")
    parser.add_argument(
        "--shape", default=None, help="a ppo_harness shape on the GPU (default: the CPU demo)"
    )
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument(
        "--resumes", type=int, default=2, help="starts after the first, each from a checkpoint"
    )
    parser.add_argument("--warmup", type=int, default=10, help="steps of each start left out of its fit")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="12 steps, a save every 2, one resume (with --shape: its CPU smoke model)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="the run's folder (default: a temp dir)")
    parser.add_argument("--start", default=None, help=argparse.SUPPRESS)  # internal: one start's JSON
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if args.start is not None:
        spec = json.loads(args.start)
        return run_start(spec["values"], spec["index"], spec["stop_after"], Path(spec["samples"]))
    if args.quick:
        args.steps, args.save_interval, args.resumes, args.warmup = 12, 2, 1, 2
    started = time.time()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    values = run_values(args, work)
    samples = args.out.with_name(args.out.stem + "_samples.jsonl")
    samples.unlink(missing_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    bounds = [round(args.steps * (i + 1) / (args.resumes + 1)) - 1 for i in range(args.resumes + 1)]
    starts = []
    for index, last in enumerate(bounds):
        stop_after = last if index < args.resumes else None
        spec = {"values": values, "index": index, "stop_after": stop_after, "samples": str(samples)}
        t0 = time.time()
        proc = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--start", json.dumps(spec)])
        starts.append(
            {"index": index, "stop_after": stop_after, "exit": proc.returncode, "seconds": time.time() - t0}
        )
        if proc.returncode != 0:
            break
    records = [json.loads(line) for line in samples.read_text().splitlines()] if samples.is_file() else []
    report = {
        "bench": "soak",
        "command": "python bench/soak.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": _commit(),
        "host": platform.node(),
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "elapsed_s": time.time() - started,
        "run": {
            k: values[k]
            for k in ("num_rollout", "save_interval", "rollout_batch_size", "device")
            if k in values
        },
        "shape": args.shape or "demo",
        "warmup_steps": args.warmup,
        "starts": starts,
        "steps_recorded": len(records),
        "samples": str(samples),
        "slopes": slopes(records, args.warmup),
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(summary(report))
    return 0 if all(s["exit"] == 0 for s in starts) and len(records) == args.steps else 1


def summary(report: dict[str, Any]) -> str:
    """The slopes as a markdown table (the series that matter: totals, each process, GPU, the folder)."""
    lines = ["| series | mean | per 100 steps | ± (1 s.e.) | % of mean | R² |", "|---|---|---|---|---|---|"]
    for key, f in report["slopes"].items():
        if f is None or key.endswith(".pid") or ".processes" in key:
            continue
        mib = any(w in key for w in ("rss", "bytes", "allocated", "reserved", "buffers"))
        scale, unit = (2**20, " MiB") if mib else (1, "")
        share = f["share_of_mean_per_100_steps"]
        lines.append(
            f"| {key} | {f['mean'] / scale:.2f}{unit} | {f['per_100_steps'] / scale:+.3f}{unit} | "
            f"{f['stderr_per_100_steps'] / scale:.3f} | {'' if share is None else f'{share:+.2f} %'} | "
            f"{'' if f['r2'] is None else f'{f["r2"]:.2f}'} |"
        )
    return "\n".join(lines)


def _commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=BENCH)
    return proc.stdout.strip() or None


if __name__ == "__main__":
    sys.exit(main())
