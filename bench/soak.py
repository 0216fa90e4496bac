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

CPU, the demo (a tiny model; 500 steps, a save every 10, two resumes; about 7 minutes on
two cores):

    nice -n 10 ./uvw run python bench/soak.py --steps 500 --save-interval 10 --resumes 2 --out docs/results/soak_cpu.json

One H200, the 0.5B bench shape (`bench/ppo_gpu_bench.py`'s defaults: 256 prompts x 128
tokens, 512-token responses, KL loss), shared, a start a call (`--only-start 0`, then 1, ...,
the same `--workdir` each time; a call's report covers the starts so far), the last
checkpoint kept only (14 GB a save, on a 64 GB disk); docs/benchmarks.md says what each
takes:

    source .gpu-kit/setup.sh && python3 bench/soak.py --shape qwen2.5-0.5b --steps 200 --save-interval 25 --resumes 4 --keep-checkpoints 1 --workdir runs/soak-h200 --out "$OUT/soak_h200.json" --only-start 0

Quick CPU smoke runs (12 steps, one resume), of the demo and of the GPU path (the GPU bench's
CPU smoke model in its shared mode):

    ./uvw run python bench/soak.py --quick --out /tmp/soak.json
    ./uvw run python bench/soak.py --quick --shape qwen2.5-0.5b --out /tmp/soak-gpu-path.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from soak_stats import RUN_FOLDER_KEY, descendants, folder_bytes, kind_of, proc_stats, slopes, summary  # noqa: E402


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
        trace: bool
        warmup: int
        out: Any
        gpu: dict[str, dict[str, Any]]

        def setup(self) -> None:
            self.gpu = {}
            super().setup()
            if self.complete:
                return
            # Every wake and sleep goes through the roles' owner: each model's GPU memory right after it
            # wakes and sleeps, the engines' right after they release theirs.
            gpus, wake, sleep = self.gpus, self.gpus.wake, self.gpus.sleep

            def woken(role: Any) -> None:
                wake(role)
                if role in ("actor", "critic"):
                    self._gpu_of("awake", self._handles_of(role))

            def put_to_sleep(role: Any) -> None:
                sleep(role)
                if role in ("actor", "critic", "engine"):
                    self._gpu_of("released" if role == "engine" else "asleep", self._handles_of(role))

            gpus.wake, gpus.sleep = woken, put_to_sleep  # type: ignore[method-assign]

        def _handles_of(self, role: str) -> dict[str, Any]:
            if role == "engine":
                return {f"engine-{r}": h for r, h in enumerate(self.engines.handles)}
            return {f"{role}-{r}": h for r, h in enumerate(self.gpus.group(role).workers)}  # type: ignore[arg-type]

        def _workers(self) -> dict[str, Any]:
            named: dict[str, Any] = {}
            for group in self.gpus.models():
                named |= self._handles_of(group.role)
            return named | self._handles_of("engine")

        def _inside(self, handles: dict[str, Any]) -> dict[str, Any]:
            refs = {name: h.__ray_call__.remote(inside_worker) for name, h in handles.items()}
            return {name: ray.get(ref, timeout=300) for name, ref in refs.items()}

        def _gpu_of(self, when: str, handles: dict[str, Any]) -> None:
            for name, found in self._inside(handles).items():
                if "gpu_allocated" in found:
                    self.gpu.setdefault(name, {})[when] = {
                        "allocated": found["gpu_allocated"],
                        "reserved": found["gpu_reserved"],
                    }

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
            first = self.start_rollout_id
            if self.trace and rollout_id == first + self.warmup:
                # Python's allocations from the end of the warm-up on, in the driver and each worker.
                start_tracing(None)
                for handle in self._workers().values():
                    ray.get(handle.__ray_call__.remote(start_tracing), timeout=300)
            last = self.stop_after if self.stop_after is not None else self.config.num_rollout - 1
            if self.trace and rollout_id == last and rollout_id > first + self.warmup:
                grown = {"driver": traced_growth(None)}
                for name, handle in self._workers().items():
                    grown[name] = ray.get(handle.__ray_call__.remote(traced_growth), timeout=300)
                trace = {"start": self.start_index, "from_step": first + self.warmup, "to_step": rollout_id}
                self.out.write(json.dumps({"trace": trace | {"grown": grown}}) + "\n")
                self.out.flush()
            if self.stop_after is not None and rollout_id == self.stop_after:
                # As a scheduler would: the loop saves this step, then stops.
                os.kill(os.getpid(), signal.SIGTERM)
            return metrics

        def _host(self, workers: dict[str, dict[str, Any]]) -> dict[str, Any]:
            me = os.getpid()
            known = {found["pid"]: name for name, found in workers.items()}
            host: dict[str, Any] = {"driver": _numbers(proc_stats(me))}
            ray_own = {"rss": 0, "fds": 0, "threads": 0, "processes": 0}
            by_kind: dict[str, int] = {}
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
                    kind = kind_of(stats["name"])
                    by_kind[kind] = by_kind.get(kind, 0) + stats["rss"]
            host["ray"] = ray_own | {"rss_by_process": by_kind}
            host["total"] = {
                k: sum(v.get(k) or 0 for v in host.values() if isinstance(v, dict))
                for k in ("rss", "fds", "threads")
            }
            host["total"]["pinned_and_host_buffers"] = sum(
                (v.get("host_buffers") or 0) + (v.get("pinned_reserved") or 0) for v in host.values()
            )
            return {"host": host}

    return SoakDriver


def start_tracing(actor: Any) -> int:
    """Run in a process (through `__ray_call__`, or directly): trace Python's allocations from now on."""
    import tracemalloc

    tracemalloc.start(8)
    return os.getpid()


def traced_growth(actor: Any, top: int = 12) -> list[str]:
    """Run in a process: the lines whose Python allocations grew most since `start_tracing`, then stop."""
    import tracemalloc

    if not tracemalloc.is_tracing():
        return []
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [
            tracemalloc.Filter(False, tracemalloc.__file__),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
        ]
    )
    tracemalloc.stop()
    stats = snapshot.statistics("lineno")[:top]
    return [
        f"{s.traceback[0].filename}:{s.traceback[0].lineno}: {s.size / 1024:.0f} KiB in {s.count} blocks"
        for s in stats
    ]


def _numbers(stats: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (stats or {}).items() if k != "name"}


def run_start(spec: dict[str, Any]) -> int:
    """One start of the run: the driver from the run folder's checkpoint, until `stop_after` or the end."""
    from tandem.ppo.config.file import unvalidated
    from tandem.ppo.run.log import Interrupted

    driver = soak_driver_class()(unvalidated(spec["values"]))
    driver.start_index, driver.stop_after = spec["index"], spec["stop_after"]
    driver.trace, driver.warmup = spec["trace"], spec["warmup"]
    out_path = Path(spec["samples"])
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
    common = {
        "num_rollout": args.steps,
        "save_interval": args.save_interval,
        "keep_checkpoints": args.keep_checkpoints,
        "progress": False,
        # Each start stops itself by SIGTERM, a preemption with no SIGKILL behind it: the step's save finishes
        # however long it takes (a 0.5B actor and critic write 14 GB), not within the default grace period.
        "sigterm_grace_s": None,
    }
    if args.shape is None:
        from tandem.ppo._demo import DEMO_DEFAULTS, prepare_demo

        return prepare_demo({**DEMO_DEFAULTS, "run_dir": str(run_dir), "tensorboard": True, **common})
    import ppo_gpu_bench
    from ppo_harness import QUICK_MODEL, REWARD_SOURCE, SHAPES, build_policy, write_prompts

    # The GPU bench's own shared mode; with --quick its CPU smoke shape (the same path, tested on a CPU).
    bench = ppo_gpu_bench.parse_args(
        [
            "--out", str(work), "--shape", args.shape, *(["--quick"] if args.quick else []),
            *shlex.split(args.bench_args),
        ]
    )  # fmt: skip
    hf_dir, data, reward = work / "policy", work / "prompts.jsonl", work / "bench_reward.py"
    shape, dtype = (QUICK_MODEL, "float32") if args.quick else (SHAPES[args.shape], "bfloat16")
    bench.stop_token_ids = ()  # the bench's fixed lengths (as its main sets them)
    build_policy(hf_dir, shape, dtype=dtype, seed=bench.seed)
    write_prompts(data, hf_dir, n=bench.prompts * 8, prompt_len=bench.prompt_len, seed=0)  # 8 steps an epoch
    reward.write_text(REWARD_SOURCE)
    values = ppo_gpu_bench.ppo_values(bench, "shared", hf_dir, data, reward, run_dir)
    return {**values, **common}


COUNTS = {"steps": (500, 12), "save_interval": (10, 2), "resumes": (2, 1), "warmup": (10, 2)}
"""Each count's default, and --quick's: the flags given keep their values, with --quick or not."""


def resolve_counts(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the counts not given with the defaults of `COUNTS` (--quick's where set)."""
    for name, (full, quick) in COUNTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the report (JSON); the samples go beside it")
    parser.add_argument(
        "--shape", default=None, help="a ppo_harness shape on the GPU (default: the CPU demo)"
    )
    parser.add_argument("--steps", type=int, default=None, help="default 500 (--quick: 12)")
    parser.add_argument("--save-interval", type=int, default=None, help="default 10 (--quick: 2)")
    parser.add_argument(
        "--resumes",
        type=int,
        default=None,
        help="starts after the first, each from a checkpoint; default 2 (--quick: 1)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps of each start left out of its fit; default 10 (--quick: 2)",
    )
    parser.add_argument(
        "--keep-checkpoints",
        type=int,
        default=None,
        help="the run's --keep-checkpoints (a 0.5B actor and critic take about 14 GB a save)",
    )
    parser.add_argument(
        "--only-start",
        type=int,
        default=None,
        help="run this start alone (0 .. --resumes), e.g. one a call where a call's time is bounded: the same "
        "--workdir and --out each time; the report covers the starts so far",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="12 steps, a save every 2, one resume, unless given (with --shape: its CPU smoke model)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="the run's folder (default: a temp dir)")
    parser.add_argument(
        "--bench-args",
        default="",
        help="with --shape: the GPU bench's own flags for the soaked work, e.g. '--prompts 64 "
        "--global-batch-size 64 --response-len 128' (a leak is a slope per step, whatever the step's size)",
    )
    parser.add_argument(
        "--trace-python",
        action="store_true",
        help="trace Python's allocations (tracemalloc) in the driver and each worker after the warm-up, and "
        "report the lines that grew most by each start's end (slower: a diagnosis, not a measurement)",
    )
    parser.add_argument("--start", default=None, help=argparse.SUPPRESS)  # internal: one start's JSON
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if args.start is not None:
        spec = json.loads(args.start)
        return run_start(spec)
    if args.bench_args and args.shape is None:
        parser.error("--bench-args: the GPU bench's flags need --shape (the demo has its own work)")
    resolve_counts(args)
    started = time.time()
    bounds = [round(args.steps * (i + 1) / (args.resumes + 1)) - 1 for i in range(args.resumes + 1)]
    only = args.only_start
    if only is not None and not 0 <= only < len(bounds):
        parser.error(f"--only-start: got {only}; it must lie in [0, --resumes = {args.resumes}]")
    if only and args.workdir is None:
        parser.error("--only-start after 0 needs the --workdir of the starts before")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="soak-"))
    # What the starts record lives in the run's folder, which outlasts a call (--only-start); each call
    # writes the report and a copy of the samples beside --out.
    samples, started_before = work / "soak_samples.jsonl", work / "soak_starts.json"
    if only:
        done = max((json.loads(line).get("step", -1) for line in _lines(samples)), default=-1)
        if done != bounds[only - 1]:
            parser.error(
                f"--only-start {only}: {samples} records steps up to {done}, and start {only} follows step "
                f"{bounds[only - 1]}; run the starts before it first, with the same --workdir"
            )
        values = json.loads((work / "soak_values.json").read_text())
        starts = json.loads(started_before.read_text()) if started_before.is_file() else []
    else:
        work.mkdir(parents=True, exist_ok=True)
        values = run_values(args, work)
        (work / "soak_values.json").write_text(json.dumps(values))
        samples.unlink(missing_ok=True)
        starts = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for index, last in enumerate(bounds):
        if only is not None and index != only:
            continue
        stop_after = last if index < args.resumes else None
        spec = {"values": values, "index": index, "stop_after": stop_after, "samples": str(samples)}
        spec |= {"trace": args.trace_python, "warmup": args.warmup}
        t0 = time.time()
        proc = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--start", json.dumps(spec)])
        starts.append(
            {"index": index, "stop_after": stop_after, "exit": proc.returncode, "seconds": time.time() - t0}
        )
        started_before.write_text(json.dumps(starts))
        if proc.returncode != 0:
            break
    copy = args.out.with_name(args.out.stem + "_samples.jsonl")
    shutil.copyfile(samples, copy)
    lines = [json.loads(line) for line in _lines(samples)]
    records = [r for r in lines if "trace" not in r]
    report = {
        "bench": "soak",
        "command": "python bench/soak.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": _commit(),
        "host": platform.node(),
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "elapsed_s": time.time() - started,
        "run": {
            k: values[k]
            for k in (
                "num_rollout",
                "save_interval",
                "rollout_batch_size",
                "rollout_max_response_len",
                "device",
            )
            if k in values
        },
        "shape": args.shape or "demo",
        "warmup_steps": args.warmup,
        "starts": starts,
        "steps_recorded": len(records),
        "samples": str(copy),
        "slopes": slopes(records, args.warmup),
        "python_allocations_grown": [r["trace"] for r in lines if "trace" in r],
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(summary(report))
    expected = args.steps if only is None else bounds[only] + 1  # the steps through this start
    return 0 if all(s["exit"] == 0 for s in starts) and len(records) == expected else 1


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def _commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=BENCH)
    return proc.stdout.strip() or None


if __name__ == "__main__":
    sys.exit(main())
