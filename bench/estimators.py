"""What the critic costs and what it buys, on the same GPUs: PPO (a shared critic) against GRPO (none).

Each estimator runs in its own `PPODriver` (a fresh Ray) with the same seed,
prompts, samples per prompt, hyper-parameters and step count; only the
advantage estimator differs (PPO: GAE on a critic that time-shares the actor's
GPUs; GRPO and the other critic-free estimators: no critic starts). Because
the critic shares the GPUs, its cost is time, not hardware: the bench reports
per run the step time, the critic's share of it (its train, wake and sleep
phases), samples/s, peak memory and setup time, and the reward (a trailing mean
over `--window` steps) at fixed steps and at fixed wall-clock seconds.

Wall clock: a run's seconds axis is the event log's own clock, seconds from
its first `step_begin` to each `step_end` (RUN_DIR/events.jsonl), setup
excluded (reported apart). The bench checks that every step's `time/step`
equals its span in the log (`clock_check`) and reports the time between steps.

Tasks (`--task`):
- `demo` (CPU): `ppo-driver demo`'s task and settings (a tiny Llama learns `d+1`).
- `smollm2` (CPU): `ppo-driver demo --model smollm2`'s task and settings (the
  pretrained SmolLM2-135M-Instruct learns one-digit sums; `ppo-driver fetch-model
  smollm2` caches it, and this task fetches it the first time).
- `hf`: a pretrained Hugging Face model (e.g. SmolLM2-135M-Instruct) on a prompt
  file, with `--hf-checkpoint`, `--prompt-data` and a reward
  (`--set custom_rm_path=...` or `--set rm_type=math`); CPU unless `--set device=cuda`.
- `qwen05b` (one GPU): bench/ppo_gpu_bench.py's 0.5B bench (its random
  Qwen2.5-0.5B-shaped model, tokenizer, 128-token prompts and dense reward,
  built by that harness) with variable-length responses: EOS is not ignored, and
  a set of stop tokens ends a response after about half the cap on average.
  `--quick` shrinks it to the harness's tiny model on the CPU.
- `package.module:function`: a task of your own, `function(args, workdir) -> dict`
  of `PPOConfig` fields.
Any `PPOConfig` field can be set for every run with `--set field=value` (YAML value).

Results: OUT/estimators.json (rewritten after every run), OUT/estimators.png
(reward against step and against seconds, every run overlaid), OUT/estimators.md
(the table), each run's metrics.jsonl and events.jsonl under OUT/estimators_runs/<name>/.

    ./uvw run python bench/estimators.py --task demo --out /tmp/estimators          # CPU, the demo
    source .gpu-kit/setup.sh && python3 bench/estimators.py --task qwen05b --out "$OUT"   # one H200
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent

ESTIMATORS: dict[str, dict[str, Any]] = {
    "ppo": {"advantage_estimator": "gae", "use_critic": True},
    "grpo": {"advantage_estimator": "grpo", "use_critic": False},
    "drgrpo": {"advantage_estimator": "grpo", "grpo_std_normalization": False, "use_critic": False},
    "rloo": {"advantage_estimator": "rloo", "use_critic": False},
    "reinforce_plus_plus": {"advantage_estimator": "reinforce_plus_plus", "use_critic": False},
    "reinforce_plus_plus_baseline": {
        "advantage_estimator": "reinforce_plus_plus_baseline",
        "use_critic": False,
    },
}
"""The runs `--estimators` may name: each one's `PPOConfig` fields on top of the task's."""

CRITIC_PHASES = ("critic_wake", "critic_train", "critic_sleep", "kl_first")
"""The phases a step spends on the critic (the KL-first plan's extra actor wake exists only for it)."""


# --- tasks: the PPOConfig fields every run of the comparison shares ------------------------------------
def demo_task(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """`ppo-driver demo`'s task and settings (CPU)."""
    from tandem.ppo._demo import DEMO_DEFAULTS, prepare_demo

    values = {**DEMO_DEFAULTS, "run_dir": str(work / "demo"), "eval_interval": None, "save_interval": None}
    return prepare_demo(values)


def hf_task(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A pretrained model on a prompt file; small batches that fit a CPU (`--set` changes any)."""
    if not args.hf_checkpoint or not args.prompt_data:
        raise ValueError("--task hf: give --hf-checkpoint (a Hugging Face folder) and --prompt-data (JSONL)")
    return {
        "hf_checkpoint": args.hf_checkpoint,
        "prompt_data": args.prompt_data,
        "rollout_batch_size": 8,
        "n_samples_per_prompt": 4,
        "global_batch_size": 32,
        "micro_batch_size": 8,
        "rollout_max_response_len": 64,
        "lr": 1e-6,
        "critic_lr": 1e-5,
        "normalize_advantages": True,
        "device": "cpu",
        "params_dtype": "float32",
        "local_gpus": 1,
    }


def smollm2_task(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """`ppo-driver demo --model smollm2`'s task and settings (CPU): SmolLM2-135M-Instruct (fetched into
    the cache once) learns one-digit sums; a critic-free run has no critic-only warm-up step."""
    from tandem.ppo._sums import SUMS_DEFAULTS, prepare_sums_demo

    values = {**SUMS_DEFAULTS, "run_dir": str(work / "smollm2"), "eval_interval": None}
    return prepare_sums_demo(values)


def qwen05b_task(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """bench/ppo_gpu_bench.py's 0.5B bench, built by that harness, with variable-length responses."""
    harness = _harness()
    shape = harness.QUICK_MODEL if args.quick else harness.SHAPES["qwen2.5-0.5b"]
    prompt_len = 16 if args.quick else 128
    response_len = args.response_len or (16 if args.quick else 512)
    prompts = args.prompts or (4 if args.quick else 32)
    hf, data, reward = work / "policy-hf", work / "prompts.jsonl", work / "bench_reward.py"
    harness.build_policy(hf, shape, dtype="float32" if args.quick else "bfloat16", seed=args.seed)
    harness.write_prompts(data, hf, n=prompts * args.steps, prompt_len=prompt_len, seed=0)
    harness.check_prompts(hf, data, prompt_len)
    reward.write_text(harness.REWARD_SOURCE)
    gbs = prompts * args.n_samples
    # The harness's own defaults for everything this task does not set (parsed as its command line).
    harness_args = harness.parse_args(
        [
            "--out", str(work), "--steps", str(args.steps), "--prompts", str(prompts),
            "--prompt-len", str(prompt_len), "--response-len", str(response_len),
            "--global-batch-size", str(gbs), "--micro-batch-size", str(min(gbs, 4 if args.quick else 16)),
            "--seed", str(args.seed), *(["--quick"] if args.quick else []),
        ]
    )  # fmt: skip
    harness_args.stop_token_ids = ()  # this task's own stop ids follow
    values = harness.ppo_values(harness_args, "shared", hf, data, reward, work / "run")
    vocab = int(shape["vocab_size"])
    # A random model's next token is close to uniform: k of V ids as stop tokens end a response
    # after about V / k tokens; V / k = half the cap leaves ~e^-2 = 14 % of responses truncated.
    k = max(1, round(vocab / (response_len / 2)))
    values.update(
        n_samples_per_prompt=args.n_samples,
        rollout_ignore_eos=False,
        rollout_stop_token_ids=tuple(range(vocab - 1 - k, vocab - 1)),
        tensorboard=False,
    )
    return values


TASKS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "demo": demo_task,
    "hf": hf_task,
    "smollm2": smollm2_task,
    "qwen05b": qwen05b_task,
}


def _harness() -> Any:
    """bench/ppo_gpu_bench.py as a module (its model, tokenizer, data, reward and GPU memory sampler)."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module("ppo_gpu_bench")


def load_task(name: str) -> Callable[[argparse.Namespace, Path], dict[str, Any]]:
    if name in TASKS:
        return TASKS[name]
    module, sep, function = name.partition(":")
    if not sep:
        raise ValueError(f"--task: {name!r} is neither one of {', '.join(TASKS)} nor package.module:function")
    return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


# --- memory ----------------------------------------------------------------------------------------------
class HostMemory:
    """Peak proportional set size (PSS, so shared pages count once) summed over this process and its
    descendants (Ray's processes and workers), sampled every `interval_s`, with timestamps."""

    source = "host PSS of the process tree (psutil)"

    def __init__(self, interval_s: float = 0.5) -> None:
        import ray  # noqa: F401  (Ray ships psutil in ray/thirdparty_files and puts it on sys.path)

        self._psutil: Any = importlib.import_module("psutil")
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        me = self._psutil.Process()
        while not self._stop.is_set():
            total = 0
            for proc in [me, *me.children(recursive=True)]:
                with contextlib.suppress(Exception):
                    info = proc.memory_full_info()
                    total += getattr(info, "pss", info.rss)
            self.samples.append((time.time(), total / 2**20))
            self._stop.wait(self.interval_s)

    def peak(self, t0: float, t1: float) -> float | None:
        inside = [m for t, m in list(self.samples) if t0 <= t <= t1]
        return max(inside) if inside else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def memory_sampler(values: dict[str, Any]) -> Any:
    """Device memory (the harness's NVML / nvidia-smi sampler) on a GPU run, host memory on a CPU one."""
    if values.get("device") == "cpu":
        return HostMemory()
    return _harness().GpuMemory()


# --- one run -----------------------------------------------------------------------------------------------
RAY_START_ATTEMPTS = 3


def start_ray(values: dict[str, Any]) -> None:
    """A local Ray for one run, started again when its node times out starting (a loaded CPU machine); where
    RAY_ADDRESS names a cluster, that cluster joined instead.

    On a busy 2-core machine the raylet gives up when Ray's dashboard agent takes more than
    about 15 s to import; what the failed start left running is killed before the next try.
    """
    import ray
    from ray._private.node import Node

    if address := os.environ.get("RAY_ADDRESS"):  # a cluster to join, as the driver's runs do (the tests')
        ray.init(address=address, log_to_driver=False)
        return
    kwargs: dict[str, Any] = {"address": "local", "include_dashboard": False, "log_to_driver": False}
    if values.get("local_gpus"):
        kwargs["num_gpus"] = values["local_gpus"]
    for attempt in range(RAY_START_ATTEMPTS):
        try:
            ray.init(**kwargs)
            return
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt + 1 == RAY_START_ATTEMPTS:
                raise
            tb = exc.__traceback__
            while tb is not None:  # Node.__init__ raised: its `self` is still in the traceback
                node = tb.tb_frame.f_locals.get("self")
                if isinstance(node, Node):
                    node.kill_all_processes(check_alive=False, wait=True)
                    break
                tb = tb.tb_next
            print(f"Ray's node timed out starting; again ({attempt + 2} of {RAY_START_ATTEMPTS})", flush=True)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )


def step_clock(events: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """Each step's (begin, end) in seconds since the run's first `step_begin`, from the event log."""
    begins = {e["rollout_id"]: float(e["t"]) for e in events if e["event"] == "step_begin"}
    ends = {e["rollout_id"]: float(e["t"]) for e in events if e["event"] == "step_end"}
    if not begins:
        return {}
    t0 = min(begins.values())
    return {k: (begins[k] - t0, ends[k] - t0) for k in sorted(begins) if k in ends}


def run_estimator(
    name: str,
    task_values: dict[str, Any],
    args: argparse.Namespace,
    paths: dict[str, Path],
    steps: int,
    deadline: float = float("inf"),
) -> dict[str, Any]:
    """One run: a fresh driver and Ray; its per-step rows and summary, or its error.

    Its steps stop early (after at least one) when the next would end past `deadline` (time.time()).
    """
    import ray

    from tandem.ppo.config.file import unvalidated
    from tandem.ppo.loop.driver import PPODriver

    run_dir = paths["work"] / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    values = {
        **task_values,
        **ESTIMATORS[name],
        **args.set,
        "run_dir": str(run_dir),
        "num_rollout": steps,
        "progress": False,
        "export_hf": False,
    }
    if not values.get("use_critic", True):
        values["num_critic_only_steps"] = 0  # the task's critic warm-up has no critic to warm here
    result: dict[str, Any] = {"name": name, "config": _jsonable(values), "steps": [], "error": None}
    sampler = memory_sampler(values)
    sampler.start()
    result["memory_source"] = sampler.source
    started = time.time()
    driver = None
    try:
        config = unvalidated(values)
        result["samples_per_step"] = config.samples_per_rollout
        driver = PPODriver(config)
        start_ray(values)  # the driver joins it (and leaves its shutdown to us)
        driver.setup()
        result["setup_s"] = time.time() - started
        for rollout_id in range(driver.start_rollout_id, steps):
            metrics = driver.step(rollout_id)  # the steps alone: no checkpoint, eval or export
            driver.metrics_so_far.append(metrics)
            driver.logger.log(rollout_id, metrics)
            numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
            phases = {k: v for k, v in numbers.items() if k.startswith("time/")}
            result.setdefault("phases", []).append(phases)  # summarised as medians, then dropped
            row = {"step": rollout_id, "time/step": numbers["time/step"]}
            row |= {k: v for k, v in numbers.items() if k.startswith(("reward/", "throughput/"))}
            row["critic_s"] = sum(phases.get(f"time/{p}", 0.0) for p in CRITIC_PHASES)
            result["steps"].append(row)
            print(
                f"[{name}] step {rollout_id}: {row['time/step']:.2f} s, reward {row['reward/mean']:.4f}",
                flush=True,
            )
            if time.time() + 1.5 * row["time/step"] > deadline and rollout_id + 1 < steps:
                result["stopped_early"] = f"time budget: {len(result['steps'])} of {steps} steps"
                break
    except Exception:
        result["error"] = traceback.format_exc()[-6000:]
        print(f"[{name}] FAILED:\n{result['error']}", file=sys.stderr, flush=True)
    finally:
        if driver is not None:
            with contextlib.suppress(Exception):
                driver.close()
        with contextlib.suppress(Exception):
            ray.shutdown()
        sampler.stop()
    result["wall_s"] = time.time() - started
    # The machine's load over the run (1-minute load average at its end against the cores): a CPU
    # comparison's seconds are comparable only where both runs had the machine alike.
    result["load_avg_1m"], result["cpu_count"] = os.getloadavg()[0], os.cpu_count()
    events = read_jsonl(run_dir / "events.jsonl")
    copy = paths["out"] / "estimators_runs" / name
    copy.mkdir(parents=True, exist_ok=True)
    for file in ("metrics.jsonl", "events.jsonl"):
        with contextlib.suppress(Exception):
            shutil.copy(run_dir / file, copy / file)
    summarize_run(result, events, sampler, window=args.window)
    return result


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}


# --- figures ------------------------------------------------------------------------------------------
def trailing_mean(values: list[float], end: int, window: int) -> float:
    """Mean of `values[end - window + 1 .. end]` (fewer at the start)."""
    part = values[max(0, end - window + 1) : end + 1]
    return statistics.fmean(part)


def summarize_run(result: dict[str, Any], events: list[dict[str, Any]], sampler: Any, *, window: int) -> None:
    """Step time, critic share, samples/s, peak memory and the wall-clock check, into `result`."""
    rows = result["steps"]
    if not rows:
        return
    clock = step_clock(events)
    ends = [clock[r["step"]][1] for r in rows]
    result["elapsed_s"] = ends  # seconds since the first step began, at each step's end
    # Each step's own timer against its span in the event log; the rest of the elapsed time is
    # what happens between steps (metrics logging).
    spans = [clock[r["step"]][1] - clock[r["step"]][0] for r in rows]
    step_s = [float(r["time/step"]) for r in rows]
    result["clock_check"] = {
        "max_abs_step_vs_log_s": max(abs(a - b) for a, b in zip(step_s, spans, strict=True)),
        "sum_step_s": sum(step_s),
        "sum_span_s": sum(spans),
        "elapsed_s": ends[-1],
        "between_steps_s": ends[-1] - sum(spans),
    }
    steady = rows[1:] if len(rows) > 1 else rows  # the first step compiles and warms caches
    mean = statistics.fmean
    result["step_s_mean"] = mean(float(r["time/step"]) for r in steady)
    critic_s = [float(r["critic_s"]) for r in steady]
    result["critic_s_mean"] = mean(critic_s)
    # Medians too: on a shared machine a few steps that others' load slowed move the means.
    result["step_s_median"] = statistics.median(float(r["time/step"]) for r in steady)
    result["critic_s_median"] = statistics.median(critic_s)
    result["critic_share"] = result["critic_s_mean"] / result["step_s_mean"]
    result["samples_per_s"] = result["samples_per_step"] / result["step_s_mean"]
    result["response_tokens_per_s"] = mean(float(r["throughput/tokens_per_s"]) for r in steady)
    all_phases = result.pop("phases", [])
    phases = all_phases[1:] or all_phases
    names = sorted({k for p in phases for k in p})
    result["phase_s_median"] = {k[5:]: statistics.median(p.get(k, 0.0) for p in phases) for k in names}
    rewards = [float(r["reward/mean"]) for r in rows]
    result["reward"] = rewards
    result["reward_trailing"] = [trailing_mean(rewards, i, window) for i in range(len(rows))]
    t0 = min((float(e["t"]) for e in events if e["event"] == "step_begin"), default=None)
    peak = None
    if t0 is not None and getattr(sampler, "samples", None):
        # Widened by one sampling interval, so that steps shorter than it still meet a sample.
        pad = getattr(sampler, "interval_s", 0.0)
        mib = sampler.peak(t0 - pad, t0 + ends[-1] + pad)
        peak = None if mib is None else mib / 1024
    result["peak_memory_gib"] = peak


def compare(runs: dict[str, dict[str, Any]], *, window: int) -> dict[str, Any]:
    """Reward (trailing mean) at fixed steps and at fixed seconds of every run, on one grid."""
    done = {n: r for n, r in runs.items() if r.get("reward_trailing")}
    if not done:
        return {}
    steps = min(len(r["reward"]) for r in done.values())
    step_marks = sorted({max(1, steps // 4), max(1, steps // 2), steps})
    shortest = min(r["elapsed_s"][steps - 1] for r in done.values())
    second_marks = [round(shortest * f, 1) for f in (0.25, 0.5, 1.0)]
    table: dict[str, Any] = {
        "window": window,
        "step_marks": step_marks,
        "second_marks": second_marks,
        "runs": {},
    }
    for name, r in done.items():
        at_seconds = {}
        for s in second_marks:
            # The last step finished by `s` seconds (the runs share s; the faster one has done more steps).
            k = max((i for i, e in enumerate(r["elapsed_s"]) if e <= s + 1e-9), default=None)
            at_seconds[str(s)] = (
                None if k is None else {"reward": r["reward_trailing"][k], "steps_done": k + 1}
            )
        table["runs"][name] = {
            "at_steps": {str(m): r["reward_trailing"][m - 1] for m in step_marks},
            "at_seconds": at_seconds,
        }
    return table


def plot(runs: dict[str, dict[str, Any]], path: Path, *, window: int) -> None:
    """Reward against step and against wall-clock seconds, every run overlaid (raw thin, trailing mean bold)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(fig)
    by_step, by_time = fig.subplots(1, 2)
    for i, (name, r) in enumerate(runs.items()):
        if not r.get("reward"):
            continue
        color = f"C{i}"
        steps = [row["step"] + 1 for row in r["steps"]]
        for ax, x in ((by_step, steps), (by_time, r["elapsed_s"])):
            ax.plot(x, r["reward"], color=color, alpha=0.3, linewidth=1)
            ax.plot(x, r["reward_trailing"], color=color, linewidth=2, label=f"{name} (mean of {window})")
    by_step.set_xlabel("steps done")
    by_time.set_xlabel("wall-clock seconds since the first step began")
    for ax in (by_step, by_time):
        ax.set_ylabel("reward/mean")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def fmt(x: Any, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(report: dict[str, Any]) -> str:
    runs, table = report["runs"], report.get("comparison") or {}
    names = list(runs)
    lines = [f"| {report['task']} | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("steps", [str(len(runs[n]["steps"])) for n in names])
    row("step time (s, mean after the first)", [fmt(runs[n].get("step_s_mean")) for n in names])
    row("of which the critic (s)", [fmt(runs[n].get("critic_s_mean")) for n in names])
    row("step time (s, median after the first)", [fmt(runs[n].get("step_s_median")) for n in names])
    row("of which the critic (s, median)", [fmt(runs[n].get("critic_s_median")) for n in names])
    row("samples/s (mean step)", [fmt(runs[n].get("samples_per_s"), ".1f") for n in names])
    row("response tokens/s", [fmt(runs[n].get("response_tokens_per_s"), ".0f") for n in names])
    row(
        f"peak memory (GiB, {report.get('memory_source')})",
        [fmt(runs[n].get("peak_memory_gib")) for n in names],
    )
    row("setup (s)", [fmt(runs[n].get("setup_s"), ".1f") for n in names])
    row(
        "machine load at the end (1-min load average / cores)",
        [f"{fmt(runs[n].get('load_avg_1m'), '.1f')} / {runs[n].get('cpu_count', '–')}" for n in names],
    )
    for m in table.get("step_marks", []):
        row(
            f"reward after {m} steps",
            [fmt(table["runs"].get(n, {}).get("at_steps", {}).get(str(m)), ".3f") for n in names],
        )
    for s in table.get("second_marks", []):
        cells = []
        for n in names:
            hit = table["runs"].get(n, {}).get("at_seconds", {}).get(str(s))
            cells.append("–" if hit is None else f"{hit['reward']:.3f} ({hit['steps_done']} steps)")
        row(f"reward after {s} s", cells)
    lines.append("")
    lines.append(
        f"Reward: `reward/mean`, mean of the last {table.get('window')} steps. Command: `{report['command']}`"
    )
    return "\n".join(lines)


def write_report(report: dict[str, Any], paths: dict[str, Path]) -> None:
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, paths["json"])


# --- main ----------------------------------------------------------------------------------------------------
def _set_value(text: str) -> tuple[str, Any]:
    import yaml

    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set {text!r}: write it as field=value")
    return key.replace("-", "_"), yaml.safe_load(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON, PNG, table and runs")
    parser.add_argument("--task", default="demo", help=f"{', '.join(TASKS)} or package.module:function")
    parser.add_argument("--estimators", nargs="+", default=["ppo", "grpo"], choices=list(ESTIMATORS))
    parser.add_argument(
        "--steps", type=int, default=None, help="steps of every run (demo 80, smollm2 12, qwen05b 10)"
    )
    parser.add_argument("--window", type=int, default=5, help="steps of the reward's trailing mean")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="qwen05b: the harness's tiny model, on the CPU")
    parser.add_argument("--prompts", type=int, default=None, help="qwen05b: prompts a step (32; quick 4)")
    parser.add_argument("--n-samples", type=int, default=8, help="qwen05b: samples per prompt")
    parser.add_argument("--response-len", type=int, default=None, help="qwen05b: the cap (512; quick 16)")
    parser.add_argument("--hf-checkpoint", default=None, help="hf: the model folder")
    parser.add_argument("--prompt-data", default=None, help="hf: the prompts (JSONL)")
    parser.add_argument("--set", type=_set_value, action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="the whole bench's seconds: each run gets an equal share of what is left; a run cut short "
        "sets the step count of the runs after it",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="models, data and run dirs (a temp dir)")
    args = parser.parse_args(argv)
    args.set = dict(args.set)
    if args.steps is None:
        args.steps = {"demo": 80, "smollm2": 12, "qwen05b": 2 if args.quick else 10}.get(args.task, 20)
    if args.steps < 1 or args.window < 1:
        parser.error("--steps and --window must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="estimators-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    budget = args.time_budget_s if args.time_budget_s is not None else float("inf")
    paths = {"out": args.out, "json": args.out / "estimators.json", "work": work}
    command = "python bench/estimators.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report: dict[str, Any] = {"bench": "estimators", "task": args.task, "command": command, "runs": {}}
    try:
        task_values = load_task(args.task)(args, work)
        report["task_config"] = _jsonable({**task_values, **args.set})
        report["memory_source"] = memory_sampler_name(task_values)
        steps = args.steps
        for i, name in enumerate(args.estimators):
            # Each run gets an equal share of the budget left, so that the last is not starved.
            deadline = time.time() + (started + budget - time.time()) / (len(args.estimators) - i)
            run = run_estimator(name, task_values, args, paths, steps, deadline)
            report["runs"][name] = run
            if run.get("stopped_early") and run["steps"]:
                steps = len(run["steps"])  # the same step count for every run that follows
            write_report(report, paths)
        report["steps"] = steps
        report["comparison"] = compare(report["runs"], window=args.window)
        plot(report["runs"], args.out / "estimators.png", window=args.window)
        report["png"] = str(args.out / "estimators.png")
    except Exception:
        report["error"] = traceback.format_exc()[-6000:]
        print(report["error"], file=sys.stderr)
    report["elapsed_s"] = time.time() - started
    write_report(report, paths)
    table = markdown(report)
    (args.out / "estimators.md").write_text(table + "\n")
    print("\n" + table + f"\n\nJSON: {paths['json']}")
    failed = report.get("error") or any(r.get("error") for r in report["runs"].values())
    return 1 if failed else 0


def memory_sampler_name(values: dict[str, Any]) -> str:
    return HostMemory.source if values.get("device") == "cpu" else "device used, NVML or nvidia-smi"


if __name__ == "__main__":
    sys.exit(main())
