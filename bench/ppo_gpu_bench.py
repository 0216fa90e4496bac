"""Shared PPO end to end on one GPU: per-phase seconds and peak memory, the cost of sharing, and MFU.

Everything is built here (`ppo_harness.py`), nothing comes from a hub: a random
model of one of the harness's shapes (`--shape`: the Qwen2.5 family, 0.5B by
default, or SmolLM2-135M's), bf16, with a tokenizer of exactly its ids (byte-level
BPE built the way Qwen2's is; words "Ġabc" one token each; any sampled id decodes),
and a JSONL of prompts of an exact token length. The reward is dense (the fraction
of response words starting with a..m), so the curves move.

1. **PPO, two modes**, the same seed and data, each its own `PPODriver` in a
   fresh Ray: `shared` (actor, critic and the embedded engine time-share the GPU:
   sleep/wake, engine release/resume) and `resident` (`offload_train=False`:
   everything stays on the GPU; the engine's KV-cache budget lowered with
   `rollout_kv_cache_memory_fraction`). Default work (0.5B): 256 prompts a step x
   128 tokens, one response each, KL loss on (so the reference log-probs are
   computed, as verl's example does); SmolLM2-135M: 512 prompts x 32 tokens, 48-token
   responses, micro batch 32. Responses (`--lengths`): `fixed`, exactly
   `--response-len` tokens (EOS ignored), or `realistic`, EOS on with lengths of a
   median near verl's Qwen2.5-0.5B GSM8K log (276 of 512; stop ids of a matching
   hazard, `ppo_harness.stop_ids_for_median`) and sequence packing on. Per step: the
   driver's `time/<phase>` seconds (`time/step` is the step's own wall clock, checked
   against this bench's span around each `driver.step()`: `clock_gap_s`), device-wide
   peak GPU memory per phase (NVML or `nvidia-smi -lms`, samples matched to the
   driver's phase intervals), the host's memory in use, the CUDA allocator's
   cudaMalloc / cudaFree calls in each model's train (`alloc/<role>_train/...`), and
   tokens/s. Then: overhead of sharing = shared step / resident step - 1; what sharing
   adds (sleeps, wakes, engine release/resume, weight sync) as a share of the step;
   verl's anchor (66 s a step on one GPU) next to ours. The steps loop calls
   `PPODriver.step` (as `run()` does) but saves no checkpoint and exports no HF
   folder: those are not part of a step.
2. **Scaling** (`--scaling 64x512,256x1024,...`): one driver per mode runs
   `--scaling-steps` steps of each cell of work (prompts x response tokens), the
   first of each cell its warm-up; the table gives each cell's step, shared against
   resident. A cell that fails (out of GPU memory, say) is kept as failed with its
   error (`cell_errors`), and a fresh driver takes the next cell.
3. **With a reward model** (`--reward-model`): a random one-label Qwen2 sequence
   classifier of the policy's shape (`ppo_harness.build_reward_model`, bf16, the
   policy's tokenizer) joins both modes (`--rm-type model`, reward = its score + the
   dense rule, `--reward-weights model=1.0,custom=1.0`): shared, it wakes after the
   engine releases its memory, scores and sleeps before the critic wakes; resident,
   it stays on the GPU. Its phases (`reward_model_wake` / `_score` / `_sleep`, and
   `reward_model`, the whole term) join the table, the wake and sleep counted in
   what sharing adds; the peaks and step times are those of the three models.
4. **Training-speed probe**: one actor `TrainWorker` trains on synthetic
   rollouts of the 1.2 B Llama-like probe shape (hidden 2048, 24 layers, seq
   2048, bf16); tokens/s of `train()` and MFU = 6 * params * tokens/s / 989e12
   (H200 dense bf16). `train()` also runs the old-log-prob forward, so the MFU
   counting it (8 * params) is given too.

Results go to `OUT/ppo_gpu_bench.json` (rewritten after every step, so a run
cut short keeps what it measured; `--out X.json` names the file) and
`OUT/ppo_gpu_bench_reward.png` (both modes' reward curves; the other metric groups
under `OUT/ppo_gpu_bench_plots/`), plus each run's metrics.jsonl and events.jsonl
under `OUT/ppo_gpu_bench_runs/<mode>/` (where the host lacks matplotlib:
`ppo-driver plot OUT/ppo_gpu_bench_runs/shared OUT/ppo_gpu_bench_runs/resident --out
DIR` redraws the curves anywhere). A markdown summary is printed.

GPU host, from the repo root (one device call; `--time-budget-s`, 500 by default, ends a
mode's steps early, after at least 2, so that the whole bench fits in about that):

    source .gpu-kit/setup.sh && python3 bench/ppo_gpu_bench.py --out "$OUT"
    source .gpu-kit/setup.sh && python3 bench/ppo_gpu_bench.py --reward-model --skip-probe --out "$OUT"

CPU smoke run (tiny model, 2 steps a mode, a tiny probe; the second with a reward model):

    ./uvw run python bench/ppo_gpu_bench.py --quick --out /tmp/ppo-bench
    ./uvw run python bench/ppo_gpu_bench.py --quick --reward-model --skip-probe --out /tmp/ppo-bench-rm
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_harness import (
    H200_BF16_PEAK_FLOPS,
    PROBE_MODEL,
    QUICK_MODEL,
    QUICK_PROBE_MODEL,
    REWARD_SOURCE,
    SHAPES,
    WORK,
    GpuMemory,
    HostMemory,
    Timeline,
    build_policy,
    build_probe_model,
    build_reward_model,
    check_prompts,
    fmt,
    gpu_name,
    make_probe_batch,
    mean,
    stop_ids_for_median,
    traced_driver_class,
    write_prompts,
    write_report,
)

VERL_ANCHOR_S = {
    "generate": 17.5,
    "reference": 5.3,
    "values": 5.6,
    "critic_update": 16.5,
    "actor_update": 20.8,
    "step": 66.0,
}
"""verl's PPO example (Qwen2.5-0.5B, GSM8K) on one GPU: seconds per phase of a step."""

SHARING_PHASES = (
    "engine_release",
    "critic_wake",
    "critic_sleep",
    "actor_wake",
    "actor_sleep",
    "engine_resume_weights",
    "weight_sync",
    "engine_resume_kv_cache",
    "engine_resume",
    "reward_model_wake",
    "reward_model_sleep",
)
"""Phases that sharing adds (weight sync included, though it runs in both modes)."""

PHASES = (
    "rollout",
    "generate",
    "reward",
    "reward_model",
    "reward_model_score",
    *SHARING_PHASES,
    "critic_train",
    "actor_train",
    "step",
)
"""The driver's `time/<phase>` keys, in step order."""


def ppo_values(
    args: argparse.Namespace,
    mode: str,
    hf_dir: Path,
    data: Path,
    reward: Path,
    run_dir: Path,
    reward_model: Path | None = None,
) -> dict:
    """The PPOConfig fields of one mode (with `reward_model`: its score joins the reward)."""
    values: dict[str, Any] = {
        "hf_checkpoint": str(hf_dir),
        "prompt_data": str(data),
        "input_key": "prompt",
        "apply_chat_template": False,
        "max_prompt_len": args.prompt_len,
        "run_dir": str(run_dir),
        "num_rollout": args.steps,
        "rollout_batch_size": args.prompts,
        "n_samples_per_prompt": 1,
        "global_batch_size": args.global_batch_size,
        "micro_batch_size": args.micro_batch_size,
        "rollout_max_response_len": args.response_len,
        "rollout_ignore_eos": args.lengths == "fixed",
        "rollout_stop_token_ids": args.stop_token_ids,
        "use_sequence_packing": args.packing,
        "custom_rm_path": f"{reward}:first_half_letters",
        "lr": args.lr,
        "critic_lr": args.critic_lr,
        "use_kl_loss": not args.no_kl,
        "kl_loss_coef": 0.0 if args.no_kl else 0.001,
        "seed": args.seed,
        "device": "cpu" if args.quick else "cuda",
        "params_dtype": "float32" if args.quick else "bfloat16",
        "offload_backend": "pinned_host",
        "local_gpus": 1 if args.quick else None,
        "offload_train": mode == "shared",
        "local_single_rank_groups": args.local_single_rank_groups,
        "keep_single_rank_groups": args.keep_single_rank_groups,
        "export_hf": False,
        "tensorboard": False,
        "progress": False,
        "save_interval": None,
        "eval_interval": None,
    }
    if mode == "resident":
        values["rollout_kv_cache_memory_fraction"] = args.resident_kv_fraction
    if reward_model is not None:
        # The model's term first: the rollout's timeline is generate, reward model, rule.
        values.update(rm_type="model", reward_model=str(reward_model), reward_weights="model=1.0,custom=1.0")
    values.update(args.overrides)
    return values


def summarize_mode(
    result: dict[str, Any], sampler: GpuMemory, timeline: Timeline, host: HostMemory | None = None
) -> None:
    """Steady-state means, sharing share, tokens/s and per-phase GPU peaks, into `result`."""
    steps = result["steps"]
    steady = steps[1:] if len(steps) > 1 else steps
    result["steady_steps"] = [s["step"] for s in steady]
    keys = sorted({k for s in steady for k in s if k.startswith("time/")})
    phase_s = {k[5:]: mean([float(s.get(k, 0.0)) for s in steady]) for k in keys}
    result["phase_s_mean"] = phase_s
    step_s = phase_s.get("step")
    result["step_s_mean"] = step_s
    adds = sum(phase_s.get(p) or 0.0 for p in SHARING_PHASES)
    result["sharing_adds_s"] = adds
    result["sharing_adds_share"] = adds / step_s if step_s else None
    result["sharing_adds_excl_weight_sync_s"] = adds - (phase_s.get("weight_sync") or 0.0)
    result["tokens_per_s"] = mean([float(s["throughput/tokens_per_s"]) for s in steady])
    result["all_tokens_per_s"] = (
        result["tokens_per_s"] * (result["prompt_len"] + result["response_len"]) / result["response_len"]
        if result["tokens_per_s"]
        else None
    )
    result["reward_mean"] = [s.get("reward/mean") for s in steps]
    # The driver's time/step against this bench's own clock around each driver.step() call.
    spans = {step: t1 - t0 for name, t0, t1, step in timeline.intervals if name == "step_total"}
    gaps = [abs(float(s["time/step"]) - spans[s["step"]]) for s in steps if s["step"] in spans]
    result["clock_gap_s"] = max(gaps) if gaps else None
    cells: dict[str, list[float]] = {}
    failed = result.get("cell_errors") or {}
    for row in steps:
        if row["cell"] in failed:
            continue  # a cell that failed has no step figure, even where one of its steps ran
        if row.get("cell_step", 0) > 0 or sum(r["cell"] == row["cell"] for r in steps) == 1:
            cells.setdefault(row["cell"], []).append(float(row["time/step"]))
    result["step_s_by_cell"] = {cell: mean(xs) for cell, xs in cells.items()}
    result["response_length_mean"] = mean([float(s["reward/response_length"]) for s in steady])
    result["truncated_share"] = mean([float(s["reward/truncated"]) for s in steady])
    allocs = sorted({k for s in steps for k in s if k.startswith("alloc/")})
    result["allocator_calls"] = {k: [s.get(k) for s in steps] for k in allocs}
    if host is not None:
        spans = [(t0, t1) for name, t0, t1, _ in timeline.intervals if name == "step_total"]
        peaks = [x for x in (host.peak(a, b) for a, b in spans) if x is not None]
        result["host_used_peak_gib"] = max(peaks) if peaks else None
    if not sampler.available:
        result["gpu_peak_gib"] = None
        return
    per_phase: dict[str, float] = {}
    per_step: dict[int, dict[str, float | None]] = {}
    for name, t0, t1, step in _with_rollout_parts(timeline, steps):
        mib = sampler.peak(t0, t1)
        if mib is None:
            continue
        gib = mib / 1024
        per_phase[name] = max(per_phase.get(name, 0.0), gib)
        if step is not None:
            per_step.setdefault(step, {})[name] = max(per_step.get(step, {}).get(name) or 0.0, gib)
    # The floor: the least the GPU held during the steps (CUDA contexts, whatever stays when asleep).
    # Were the phases' memory not shared, the peak would be the floor plus each big phase's own rise.
    lows = [sampler.low(t0, t1) for name, t0, t1, _ in timeline.intervals if name == "step_total"]
    known = [x for x in lows if x is not None]
    floor = min(known) / 1024 if known else None
    overall = max(per_phase.values()) if per_phase else None
    big = [
        per_phase[p]
        for p in ("generate", "reward_model_score", "critic_train", "actor_train")
        if p in per_phase
    ]
    unshared = floor + sum(x - floor for x in big) if floor is not None and big else None
    result["gpu_peak_gib"] = {
        "per_phase": per_phase,
        "per_step": {str(k): v for k, v in sorted(per_step.items())},
        "overall": overall,
        "floor_during_steps": floor,
        "largest_big_phase": max(big) if big else None,
        "floor_plus_big_phase_rises": unshared,
        "overall_over_floor_plus_rises": overall / unshared if overall and unshared else None,
    }


def _with_rollout_parts(
    timeline: Timeline, steps: list[dict[str, Any]]
) -> list[tuple[str, float, float, int | None]]:
    """The timeline plus `generate`, `reward_model` and `reward` windows cut from each `rollout` by
    their seconds (in that order: the reward model's term comes first, then the rule)."""
    by_step = {s["step"]: s for s in steps}
    out = list(timeline.intervals)
    for name, t0, t1, step in timeline.intervals:
        if name != "rollout" or step not in by_step:
            continue
        gen = float(by_step[step].get("time/generate", 0.0))
        model = float(by_step[step].get("time/reward_model", 0.0))
        rew = float(by_step[step].get("time/reward", 0.0))
        out.append(("generate", t0, min(t1, t0 + gen), step))
        if model:
            out.append(("reward_model", min(t1, t0 + gen), min(t1, t0 + gen + model), step))
        out.append(("reward", min(t1, t0 + gen + model), min(t1, t0 + gen + model + rew), step))
    return out


def run_mode(
    mode: str,
    args: argparse.Namespace,
    paths: dict[str, Path],
    sampler: GpuMemory,
    report: dict[str, Any],
    deadline: float,
    reserve_s: float,
) -> None:
    """One PPO run in a fresh Ray; its figures (or its error) go into `report["modes"][mode]`."""
    import ray

    from tandem.ppo.config.file import unvalidated

    run_dir = paths["work"] / f"run-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    values = ppo_values(args, mode, paths["hf"], paths["data"], paths["reward"], run_dir, paths.get("rm"))
    result: dict[str, Any] = {
        "mode": mode,
        "run_dir": str(run_dir),
        "config": {k: v for k, v in values.items() if k not in ("hf_checkpoint", "prompt_data", "run_dir")},
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "steps": [],
        "error": None,
    }
    report["modes"][mode] = result
    timeline = Timeline()
    driver = None
    started = time.time()
    baseline = sampler.now()
    result["gpu_used_before_gib"] = baseline / 1024 if baseline is not None else None
    try:
        config = unvalidated(values)
        driver = traced_driver_class()(config)
        driver.timeline = timeline
        with timeline.span("setup"):
            driver.setup()
        result["setup_s"] = time.time() - started
        # The scaling sweep: the same driver (and models) for every cell of work, each cell's
        # prompts and response length set on the driver's config for its steps.
        cells = args.scaling or [(config.rollout_batch_size, config.rollout_max_response_len)]
        plan = [
            (cell, k) for cell in cells for k in range(args.steps if not args.scaling else args.scaling_steps)
        ]
        restarts = 0
        for rollout_id, ((prompts, response_len), k) in enumerate(plan):
            cell = f"{prompts}x{response_len}"
            if cell in result.get("cell_errors", {}):
                continue  # the cell failed: its other steps are skipped
            last = result["steps"][-1]["time/step"] if result["steps"] else None
            if (
                len(result["steps"]) >= 2
                and last is not None
                and time.time() + 1.3 * last > deadline - reserve_s
            ):
                result["stopped_early"] = f"time budget: {len(result['steps'])} of {len(plan)} steps"
                print(f"[{mode}] {result['stopped_early']}", flush=True)
                break
            if args.scaling and k == 0:
                driver.config = dataclasses.replace(
                    config, rollout_batch_size=prompts, rollout_max_response_len=response_len
                )
            timeline.step = rollout_id
            try:
                with timeline.span("step_total"):
                    metrics = driver.step(rollout_id)
            except Exception:
                if not args.scaling:
                    raise
                # In a sweep, a cell that fails (out of GPU memory, typically resident at the largest
                # cells) ends its driver, not the sweep: its error is kept, and a fresh driver (its own
                # run folder) takes the next cell, whose first step is its warm-up as always.
                timeline.step = None
                result.setdefault("cell_errors", {})[cell] = traceback.format_exc()[-3000:]
                print(
                    f"[{mode}] cell {cell} FAILED: {traceback.format_exc().strip().splitlines()[-1]}",
                    flush=True,
                )
                with contextlib.suppress(Exception):
                    driver.close()
                with contextlib.suppress(Exception):
                    ray.shutdown()
                restarts += 1
                config = unvalidated({**values, "run_dir": f"{run_dir}-{restarts}"})
                driver = traced_driver_class()(config)
                driver.timeline = timeline
                with timeline.span("setup"):
                    driver.setup()
                write_report(report, paths["json"])
                continue
            timeline.step = None
            driver.metrics_so_far.append(metrics)
            driver.logger.log(rollout_id, metrics)
            row: dict[str, Any] = {"step": rollout_id, "cell": f"{prompts}x{response_len}", "cell_step": k}
            row.update(
                {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            )
            result["steps"].append(row)
            print(
                f"[{mode}] step {rollout_id}: {row['time/step']:.2f} s, generate {row.get('time/generate', 0):.2f} s, "
                f"critic {row.get('time/critic_train', 0):.2f} s, actor {row.get('time/actor_train', 0):.2f} s, "
                f"reward {row.get('reward/mean', float('nan')):.4f}",
                flush=True,
            )
            summarize_mode(result, sampler, timeline, paths.get("_host_sampler"))
            write_report(report, paths["json"])
    except Exception:
        result["error"] = traceback.format_exc()[-6000:]
        print(f"[{mode}] FAILED:\n{result['error']}", file=sys.stderr, flush=True)
    finally:
        if driver is not None:
            # What the sleep backend keeps on the host for each model (pinned buffers, kept between
            # cycles): the host-memory side of sharing, next to the sampled host memory in use.
            with contextlib.suppress(Exception):
                result["host_buffer_gib"] = {
                    role: sum(b or 0 for b in group.run("host_buffer_bytes")) / 1024**3
                    for role, group in (("actor", driver.actor), ("critic", driver.critic))
                    if group is not None
                }
            with contextlib.suppress(Exception):
                driver.close()
        with contextlib.suppress(Exception):
            ray.shutdown()
    result["wall_s"] = time.time() - started
    if result["steps"]:
        with contextlib.suppress(Exception):
            summarize_mode(result, sampler, timeline, paths.get("_host_sampler"))
    result["phase_intervals"] = [
        {"phase": n, "t0": t0 - started, "t1": t1 - started, "step": s} for n, t0, t1, s in timeline.intervals
    ]
    # OUT/ppo_gpu_bench_runs/<mode>/ is a run dir for `ppo-driver plot` (where the host has no matplotlib).
    copy = paths["out"] / "ppo_gpu_bench_runs" / mode
    copy.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "events.jsonl"):
        with contextlib.suppress(Exception):
            shutil.copy(run_dir / name, copy / name)
    write_report(report, paths["json"])
    if baseline is not None:
        sampler.wait_settled(baseline + 1024)


def run_probe(
    args: argparse.Namespace, paths: dict[str, Path], sampler: GpuMemory, report: dict[str, Any]
) -> None:
    """tokens/s and MFU of the actor's `train()` on the probe shape; figures (or error) into report["probe"]."""
    import ray

    shape = QUICK_PROBE_MODEL if args.quick else PROBE_MODEL
    seq_len = args.probe_seq_len
    result: dict[str, Any] = {
        "shape": {**shape, "seq_len": seq_len},
        "samples_per_train": args.probe_samples,
        "micro_batch_size": args.probe_micro_batch_size,
        "error": None,
    }
    report["probe"] = result
    started = time.time()
    group = None
    try:
        from ray.util.placement_group import placement_group

        from tandem.megatron.config import WorkerConfig
        from tandem.megatron.group import create_train_group

        hf = paths["work"] / "probe-hf"
        params = build_probe_model(hf, shape, seq_len=seq_len)
        embedding = shape["vocab_size"] * shape["hidden_size"]
        result["params"] = params
        result["params_without_input_embedding"] = params - embedding
        config = WorkerConfig(
            hf_checkpoint=str(hf),
            rollout_batch_size=args.probe_samples,
            n_samples_per_prompt=1,
            global_batch_size=args.probe_samples,
            micro_batch_size=args.probe_micro_batch_size,
            device="cpu" if args.quick else "cuda",
            params_dtype="float32" if args.quick else "bfloat16",
            offload_backend="pinned_host",
            lr=1e-6,
            seed=args.seed,
            save=str(paths["work"] / "probe-save"),
        )
        ray.init(
            num_gpus=1,
            include_dashboard=False,
            log_to_driver=False,
            **({"num_cpus": 2} if args.quick else {}),
        )
        pg = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK")
        ray.get(pg.ready())
        t0 = time.time()
        group = create_train_group(config, "actor", pg, [0], num_gpus_per_worker=0.4, num_cpus_per_worker=0.4)
        result["setup_s"] = time.time() - t0
        batch_ref = ray.put(
            make_probe_batch(args.probe_samples, seq_len, args.probe_prompt_len, shape["vocab_size"], 0)
        )
        tokens = args.probe_samples * seq_len
        seconds: list[float] = []
        windows: list[tuple[float, float]] = []
        for i in range(args.probe_iters):
            t0 = time.time()
            ray.get(group.train(i, [batch_ref]))
            t1 = time.time()
            seconds.append(t1 - t0)
            windows.append((t0, t1))
            print(f"[probe] train {i}: {t1 - t0:.2f} s, {tokens / (t1 - t0):.0f} tokens/s", flush=True)
        timed = seconds[1:] if len(seconds) > 1 else seconds
        train_s = statistics.median(timed)
        tps = tokens / train_s
        result.update(
            {
                "tokens_per_train": tokens,
                "train_s": seconds,
                "train_s_median_after_first": train_s,
                "tokens_per_s": tps,
                "mfu_6n": 6 * params * tps / H200_BF16_PEAK_FLOPS,
                "mfu_8n_with_logprob_forward": 8 * params * tps / H200_BF16_PEAK_FLOPS,
                "peak_flops": H200_BF16_PEAK_FLOPS,
            }
        )
        if sampler.available:
            peaks = [sampler.peak(a, b) for a, b in windows]
            known = [p for p in peaks if p is not None]
            result["gpu_peak_gib"] = max(known) / 1024 if known else None
    except Exception:
        result["error"] = traceback.format_exc()[-6000:]
        print(f"[probe] FAILED:\n{result['error']}", file=sys.stderr, flush=True)
    finally:
        if group is not None:
            with contextlib.suppress(Exception):
                group.kill()
        with contextlib.suppress(Exception):
            ray.shutdown()
    result["wall_s"] = time.time() - started
    write_report(report, paths["json"])


def compare(report: dict[str, Any]) -> None:
    """Overhead of sharing, vs verl, and the issue's goals."""
    shared = report["modes"].get("shared") or {}
    resident = report["modes"].get("resident") or {}
    s_step, r_step = shared.get("step_s_mean"), resident.get("step_s_mean")
    report["overhead_of_sharing"] = s_step / r_step - 1 if s_step and r_step else None
    phase = shared.get("phase_s_mean") or {}
    ours = {
        "generate": phase.get("generate"),
        "reference + actor update (ours: actor_train: old + ref log-probs, update)": phase.get("actor_train"),
        "values + critic update (ours: critic_train)": phase.get("critic_train"),
        "what sharing adds (ours)": shared.get("sharing_adds_s"),
        "step": s_step,
    }
    verl = {
        "generate": VERL_ANCHOR_S["generate"],
        "reference + actor update (ours: actor_train: old + ref log-probs, update)": VERL_ANCHOR_S[
            "reference"
        ]
        + VERL_ANCHOR_S["actor_update"],
        "values + critic update (ours: critic_train)": VERL_ANCHOR_S["values"]
        + VERL_ANCHOR_S["critic_update"],
        "what sharing adds (ours)": None,
        "step": VERL_ANCHOR_S["step"],
    }
    report["vs_verl"] = {k: {"verl_s": verl[k], "shared_s": ours[k]} for k in ours}
    probe = report.get("probe") or {}
    peaks = shared.get("gpu_peak_gib") or {}
    overhead = report["overhead_of_sharing"]
    report["goals"] = {
        "shared_step_le_5s": None if s_step is None else s_step <= 5.0,
        "shared_over_resident_le_5pct": None if overhead is None else overhead <= 0.05,
        "probe_mfu_ge_50pct": None if probe.get("mfu_6n") is None else probe["mfu_6n"] >= 0.50,
        # ~1 / (number of big phases) when the phases share the memory; ~1 when they add up.
        "shared_peak_over_floor_plus_phase_rises": peaks.get("overall_over_floor_plus_rises"),
        "shared_peak_over_resident_peak": (
            peaks["overall"] / (resident.get("gpu_peak_gib") or {})["overall"]
            if peaks.get("overall") and (resident.get("gpu_peak_gib") or {}).get("overall")
            else None
        ),
    }


def plot(report: dict[str, Any], paths: dict[str, Path]) -> None:
    runs = [(m, Path(r["run_dir"])) for m, r in report["modes"].items() if r.get("steps")]
    if not runs:
        return
    try:
        from tandem.ppo.app.plot import plot_run

        plots = paths["out"] / "ppo_gpu_bench_plots"
        written = plot_run([d for _, d in runs], plots, labels=[m for m, _ in runs])
        report["plots"] = [str(p) for p in written]
        reward = plots / "reward.png"
        if reward.is_file():
            shutil.copy(reward, paths["out"] / "ppo_gpu_bench_reward.png")
            report["reward_png"] = str(paths["out"] / "ppo_gpu_bench_reward.png")
    except Exception:
        report["plot_error"] = traceback.format_exc()[-3000:]


def print_summary(report: dict[str, Any]) -> None:
    modes = report["modes"]
    names = list(modes)
    print(f"\n## PPO on {report.get('gpu') or 'CPU'} ({report['shape']})\n")
    print("| phase (s, mean of steady steps) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for p in PHASES:
        cells = [(modes[m].get("phase_s_mean") or {}).get(p) for m in names]
        if any(c is not None for c in cells):
            print(f"| {p} | " + " | ".join(fmt(c) for c in cells) + " |")
    rows = {
        "sharing adds (s)": [modes[m].get("sharing_adds_s") for m in names],
        "sharing adds (% of step)": [
            None if modes[m].get("sharing_adds_share") is None else 100 * modes[m]["sharing_adds_share"]
            for m in names
        ],
        "response tokens/s": [modes[m].get("tokens_per_s") for m in names],
        "peak GPU GiB": [(modes[m].get("gpu_peak_gib") or {}).get("overall") for m in names],
        "peak host memory in use (GiB)": [modes[m].get("host_used_peak_gib") for m in names],
        "host buffers of the sleep backend (GiB)": [
            sum((modes[m].get("host_buffer_gib") or {}).values()) if modes[m].get("host_buffer_gib") else None
            for m in names
        ],
        "response length (mean tokens)": [modes[m].get("response_length_mean") for m in names],
        "truncated responses (%)": [
            None if modes[m].get("truncated_share") is None else 100 * modes[m]["truncated_share"]
            for m in names
        ],
        "time/step vs the bench's own clock, worst (ms)": [
            None if modes[m].get("clock_gap_s") is None else 1000 * modes[m]["clock_gap_s"] for m in names
        ],
        "setup (s)": [modes[m].get("setup_s") for m in names],
    }
    for label, cells in rows.items():
        print(f"| {label} | " + " | ".join(fmt(c, ".1f") for c in cells) + " |")
    for m in names:
        for key, counts in (modes[m].get("allocator_calls") or {}).items():
            print(f"\n{m} {key} by step: {counts}")
    cells = sorted(
        {
            c
            for m in names
            for c in (modes[m].get("step_s_by_cell") or {}) | (modes[m].get("cell_errors") or {})
        }
    )
    if len(cells) > 1:
        print("\n| prompts x response tokens | " + " | ".join(f"{m} step (s)" for m in names) + " | ratio |")
        print("|---|" + "---|" * (len(names) + 1))
        for cell in sorted(cells, key=lambda c: tuple(int(x) for x in c.split("x"))):
            steps = [(modes[m].get("step_s_by_cell") or {}).get(cell) for m in names]
            ratio = steps[0] / steps[1] - 1 if len(steps) == 2 and steps[0] and steps[1] else None
            shown = [
                fmt(x) if x is not None or cell not in (modes[m].get("cell_errors") or {}) else "failed"
                for m, x in zip(names, steps, strict=True)
            ]
            print(f"| {cell} | " + " | ".join(shown) + f" | {fmt(ratio, '+.1%')} |")
    for m in names:
        peaks = (modes[m].get("gpu_peak_gib") or {}).get("per_phase") or {}
        if peaks:
            text = ", ".join(f"{p} {v:.1f}" for p, v in sorted(peaks.items(), key=lambda kv: -kv[1]))
            print(f"\npeak GPU GiB by phase, {m}: {text}")
        if modes[m].get("error"):
            print(f"\n{m} FAILED: {modes[m]['error'].strip().splitlines()[-1]}")
    print(
        f"\noverhead of sharing (shared step / resident step - 1): {fmt(report.get('overhead_of_sharing'), '.1%')}"
    )
    print("\n| vs verl (one GPU) | verl s | ours (shared) s |\n|---|---|---|")
    for k, v in (report.get("vs_verl") or {}).items():
        print(f"| {k} | {fmt(v['verl_s'], '.1f')} | {fmt(v['shared_s'], '.1f')} |")
    probe = report.get("probe")
    if probe:
        if probe.get("error"):
            print(f"\nprobe FAILED: {probe['error'].strip().splitlines()[-1]}")
        else:
            print(
                f"\nprobe ({probe['params'] / 1e9:.2f} B params, seq {probe['shape']['seq_len']}): "
                f"{fmt(probe.get('tokens_per_s'), '.0f')} tokens/s, MFU {fmt(probe.get('mfu_6n'), '.1%')} "
                f"(6N; {fmt(probe.get('mfu_8n_with_logprob_forward'), '.1%')} counting the log-prob forward), "
                f"peak {fmt(probe.get('gpu_peak_gib'), '.1f')} GiB"
            )
    print(f"\ngoals: {report.get('goals')}")
    print(f"command: {report['command']}")


# --- main --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder (or a .json path) for the results")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, 2 steps a mode")
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b", help="the model's shape (random weights)"
    )
    parser.add_argument(
        "--lengths",
        choices=("fixed", "realistic"),
        default="fixed",
        help="fixed: every response exactly --response-len tokens (EOS ignored); realistic: EOS on and "
        "lengths of median --target-median-len (stop ids of a matching hazard), sequence packing on",
    )
    parser.add_argument(
        "--target-median-len",
        type=int,
        default=None,
        help="realistic lengths: median response tokens (default 276/512 of --response-len, as in verl's "
        "Qwen2.5-0.5B GSM8K log)",
    )
    parser.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence packing (default: on with --lengths realistic, off with fixed)",
    )
    parser.add_argument(
        "--alloc-conf",
        default=None,
        help="PYTORCH_CUDA_ALLOC_CONF for every process of the run (e.g. expandable_segments:True)",
    )
    parser.add_argument(
        "--scaling",
        default=None,
        help="comma-separated PROMPTSxRESPONSE cells (e.g. 64x512,256x1024): one driver per mode runs "
        "--scaling-steps steps of each; the first of a cell is its warm-up",
    )
    parser.add_argument("--scaling-steps", type=int, default=2)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a PPOConfig field for both modes, VALUE read as YAML (e.g. --set use_dynamic_batch_size=true "
        "--set max_tokens_per_gpu=16384); repeatable: the A/B of one lever",
    )
    parser.add_argument("--steps", type=int, default=None, help="PPO steps per mode (default 5; --quick 2)")
    parser.add_argument("--skip-resident", action="store_true", help="run only the shared mode")
    parser.add_argument("--skip-shared", action="store_true", help="run only the resident mode")
    parser.add_argument("--skip-probe", action="store_true", help="no training-speed probe")
    parser.add_argument(
        "--reward-model",
        action="store_true",
        help="add a random reward model of the policy's shape (one-label Qwen2 sequence classifier) to "
        "both modes: its score + the dense rule is the reward",
    )
    parser.add_argument("--prompts", type=int, default=None, help="prompts a step (default 256)")
    parser.add_argument("--prompt-len", type=int, default=None, help="tokens a prompt (default 128)")
    parser.add_argument("--response-len", type=int, default=None, help="tokens a response (default 512)")
    parser.add_argument("--global-batch-size", type=int, default=None, help="default 256")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default 16")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--critic-lr", type=float, default=1e-5)
    parser.add_argument("--no-kl", action="store_true", help="no KL loss (so no reference log-probs)")
    parser.add_argument(
        "--no-local-single-rank-groups",
        dest="local_single_rank_groups",
        action="store_false",
        help="one-rank groups get NCCL communicators (torn down at each sleep) instead of answering in the process",
    )
    parser.add_argument(
        "--keep-single-rank-groups",
        action="store_true",
        help="with --no-local-single-rank-groups: the one-rank communicators stay alive while asleep",
    )
    parser.add_argument(
        "--resident-kv-fraction",
        type=float,
        default=0.1,
        help="engine KV-cache memory fraction, resident mode",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--probe-seq-len", type=int, default=None, help="default 2048")
    parser.add_argument("--probe-prompt-len", type=int, default=None, help="default 128")
    parser.add_argument("--probe-samples", type=int, default=None, help="sequences per train() (default 64)")
    parser.add_argument("--probe-micro-batch-size", type=int, default=None, help="default 4")
    parser.add_argument(
        "--probe-iters", type=int, default=None, help="train() calls, the first not timed (3)"
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=500.0,
        help="stop a mode's steps early (after 2) so that the whole bench ends within this many seconds",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="models, data and run dirs (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "steps": (2, 5),
        "prompts": (8, 256),
        "prompt_len": (16, 128),
        "response_len": (8, 512),
        "global_batch_size": (8, 256),
        "micro_batch_size": (4, 16),
        "probe_seq_len": (64, 2048),
        "probe_prompt_len": (16, 128),
        "probe_samples": (8, 64),
        "probe_micro_batch_size": (4, 4),
        "probe_iters": (2, 3),
    }
    work = WORK.get(args.shape, {})
    for name, (small, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else work.get(name, full))
    args.scaling = (
        [tuple(int(x) for x in cell.split("x")) for cell in args.scaling.split(",")] if args.scaling else []
    )
    if args.scaling:
        args.prompts = max(p for p, _ in args.scaling)
        args.response_len = max(r for _, r in args.scaling)
        # The workers' global batch is fixed at start-up, so every cell must hold a whole one.
        bad = [f"{p}x{r}" for p, r in args.scaling if p % args.global_batch_size]
        if bad:
            parser.error(
                f"--scaling: cell(s) {', '.join(bad)} are not a multiple of --global-batch-size "
                f"{args.global_batch_size} samples; pass --global-batch-size "
                f"{math.gcd(*(p for p, _ in args.scaling))} (each cell then takes prompts / that "
                "optimizer steps a rollout)"
            )
    if args.packing is None:
        args.packing = args.lengths == "realistic"
    import yaml

    pairs = [item.partition("=") for item in args.overrides]
    bad = [item for item, (_, eq, _) in zip(args.overrides, pairs, strict=True) if not eq]
    if bad:
        parser.error(f"--set {bad[0]}: write it as FIELD=VALUE")
    args.overrides = {key.strip(): yaml.safe_load(value) for key, _, value in pairs}
    if args.target_median_len is None:
        args.target_median_len = max(1, round(args.response_len * 276 / 512))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    started = time.time()
    deadline = started + args.time_budget_s
    out = args.out
    json_path = out if out.suffix == ".json" else out / "ppo_gpu_bench.json"
    out_dir = json_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ppo-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    paths = {"out": out_dir, "json": json_path, "work": work}

    import torch
    import transformers

    shape = QUICK_MODEL if args.quick else SHAPES[args.shape]
    if args.alloc_conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf  # before Ray: every worker inherits it
    args.stop_token_ids = (
        stop_ids_for_median(shape["vocab_size"], args.target_median_len)
        if args.lengths == "realistic"
        else ()
    )
    report: dict[str, Any] = {
        "_started": started,
        "bench": "ppo_gpu_bench",
        "command": "python3 bench/ppo_gpu_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "quick": args.quick,
        "gpu": gpu_name(),
        "host": platform.node(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version,
        },
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "shape": (
            f"{'quick' if args.quick else args.shape}: {args.prompts} prompts x {args.prompt_len} tokens, "
            + (
                f"1 response of exactly {args.response_len} tokens"
                if args.lengths == "fixed"
                else f"1 response of up to {args.response_len} tokens (EOS on, median target "
                f"{args.target_median_len})"
            )
            + f", global batch {args.global_batch_size}, micro {args.micro_batch_size}, "
            f"packing {'on' if args.packing else 'off'}, KL loss {'off' if args.no_kl else 'on'}"
            + (f", PYTORCH_CUDA_ALLOC_CONF={args.alloc_conf}" if args.alloc_conf else "")
            + "".join(f", {k}={v}" for k, v in args.overrides.items())
            + (", + a reward model of the same shape" if args.reward_model else "")
        ),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "verl_anchor_s": VERL_ANCHOR_S,
        "modes": {},
    }
    sampler = GpuMemory()
    sampler.start()
    host = HostMemory()
    host.start()
    paths["_host_sampler"] = host  # type: ignore[assignment]
    report["gpu_memory_source"] = sampler.source
    write_report(report, json_path)
    try:
        t0 = time.time()
        paths["hf"] = work / f"policy-{'quick' if args.quick else args.shape}"
        params = build_policy(
            paths["hf"], shape, dtype="float32" if args.quick else "bfloat16", seed=args.seed
        )
        paths["data"] = work / "prompts.jsonl"
        steps = (
            sum(p for p, _ in args.scaling) * args.scaling_steps
            if args.scaling
            else args.prompts * args.steps
        )
        n_prompts = max(steps, args.prompts)
        write_prompts(paths["data"], paths["hf"], n=n_prompts, prompt_len=args.prompt_len, seed=0)
        check_prompts(paths["hf"], paths["data"], args.prompt_len)
        paths["reward"] = work / "bench_reward.py"
        paths["reward"].write_text(REWARD_SOURCE)
        report["model"] = {"family": "qwen2", "tie_word_embeddings": True, **shape, "params": params}
        if args.reward_model:
            paths["rm"] = work / f"reward-model-{'quick' if args.quick else args.shape}"
            rm_params = build_reward_model(
                paths["rm"],
                shape,
                policy_dir=paths["hf"],
                dtype="float32" if args.quick else "bfloat16",
                seed=args.seed,
            )
            report["reward_model"] = {"kind": "sequence classification, num_labels 1", "params": rm_params}
        report["build_s"] = time.time() - t0
        write_report(report, json_path)

        modes = [
            m for m, skip in (("shared", args.skip_shared), ("resident", args.skip_resident)) if not skip
        ]
        for i, mode in enumerate(modes):
            # Keep time for what follows: another mode (about this one's wall time) and the probe.
            reserve = 0.0 if args.skip_probe else 120.0
            if i + 1 < len(modes):
                reserve += 0.5 * (deadline - time.time() - reserve)
            run_mode(mode, args, paths, sampler, report, deadline, reserve)
        compare(report)
        plot(report, paths)
        write_report(report, json_path)
        if not args.skip_probe:
            run_probe(args, paths, sampler, report)
        compare(report)
    except Exception:
        report["error"] = traceback.format_exc()[-6000:]
        print(report["error"], file=sys.stderr)
    finally:
        sampler.stop()
        host.stop()
        write_report(report, json_path)
    print_summary(report)
    print(f"\nJSON: {json_path}")
    failed = [m for m, r in report["modes"].items() if r.get("error")]
    probe_failed = bool((report.get("probe") or {}).get("error"))
    return 1 if report.get("error") or failed or probe_failed else 0


if __name__ == "__main__":
    sys.exit(main())
