"""The PPO GPU bench's two modes: one mode's run in a fresh Ray, and its figures.

`run_mode` runs one mode (`shared`, the models time-sharing the GPU; `resident`, everything
on it) through `PPODriver.step`, with the driver's phase intervals on a `Timeline` for the
GPU memory samples (`ppo_harness.traced_driver_class`); `summarize_mode` turns its steps
into the figures of `OUT/ppo_gpu_bench.json` (`ppo_report` compares the modes).
`bench/ppo_gpu_bench.py` is the command; `bench/estimators.py` builds its task from
`ppo_values`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_harness import (
    GpuMemory,
    HostMemory,
    Timeline,
    mean,
    traced_driver_class,
    write_report,
)

from tandem.ppo.config.file import unvalidated


def ppo_values(
    args: argparse.Namespace,
    mode: str,
    hf_dir: Path,
    data: Path,
    reward: Path,
    run_dir: Path,
    reward_model: Path | None = None,
    teacher: Path | None = None,
) -> dict:
    """The PPOConfig fields of one mode (with `reward_model`: its score joins the reward; with `teacher`:
    on-policy distillation from it beside the reward, `--opd-coef 1`, its reverse KL in the rewards)."""
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
        "offload_train": mode in SHARED_MODES,
        # `shared` is whole-role sharing, the reference the plan's modes are measured against
        "memory_plan": "fit" if mode in FIT_MODES else "whole",
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
    if mode == NO_COUNT_MODE:
        values["policy_change_count"] = False
    if mode in FIT_MODES:
        values["overlap_moves"] = mode != FIT_SERIAL_MODE
        if mode == FIT_NO_PREFETCH_MODE:
            values["prefetch_wakes"] = False
        if mode == FIT_WHOLE_TAGS_MODE:
            values["optimizer_pieces"] = 1
        if mode == FIT_KV_SAVER_MODE:
            values["rollout_kv_cache_backend"] = "torch_memory_saver"
        if args.quick:  # no GPU to ask: room for everything, so the plan's moves are the engines' alone
            values.update(gpu_memory_gib=64.0, memory_margin_gib=0.0)
    if reward_model is not None:
        # The model's term first: the rollout's timeline is generate, reward model, rule.
        values.update(rm_type="model", reward_model=str(reward_model), reward_weights="model=1.0,custom=1.0")
    if teacher is not None:
        values.update(teacher_hf_checkpoint=str(teacher), opd_coef=1.0)
    values.update(args.overrides)
    return values


NO_COUNT_MODE = "shared_no_count"
"""The shared mode with the weight sync's count of changed weights off (`--ab-policy-change-count`)."""

FIT_MODE = "shared_fit"
"""The shared mode with the memory plan (`--memory-plan fit`, `--ab-memory-plan`): from its second step the
actor and the critic sleep only the tags each turn needs room for."""

FIT_SERIAL_MODE = "shared_fit_serial"
"""The memory plan's mode with each turn's moves one after the other (`--no-overlap-moves`,
`--ab-overlap-moves`): the same plan, without its moves at once."""

FIT_WHOLE_TAGS_MODE = "shared_fit_whole_tags"
"""The memory plan's mode with each optimizer tag whole (`--optimizer-pieces 1`, `--ab-optimizer-pieces`):
the plan sleeps whole tags where `shared_fit` may sleep quarters of them."""

FIT_NO_PREFETCH_MODE = "shared_fit_no_prefetch"
"""The memory plan's mode with each wake made as its turn is entered (`--no-prefetch-wakes`, `--ab-prefetch`),
where `shared_fit` starts a model's copied wakes in the background of the turn before."""

FIT_KV_SAVER_MODE = "shared_fit_kv_saver"
"""The memory plan's mode with the embedded engine's KV cache in a torch_memory_saver region
(`--rollout-kv-cache-backend torch_memory_saver`, `--ab-kv-saver`): a release of the KV cache alone keeps its
addresses and the decode's CUDA graphs, where `shared_fit` frees it and captures the graphs again."""

FIT_MODES = (FIT_MODE, FIT_SERIAL_MODE, FIT_WHOLE_TAGS_MODE, FIT_NO_PREFETCH_MODE, FIT_KV_SAVER_MODE)
"""The modes with the memory plan."""

SHARED_MODES = ("shared", NO_COUNT_MODE, *FIT_MODES)
"""The modes whose models time-share the GPU."""

SHARING_PHASES = (
    "engine_release",
    "critic_wake",
    "critic_sleep",
    "actor_wake",
    "actor_sleep",
    "handover",
    "engine_resume_weights",
    "weight_sync",
    "engine_resume_kv_cache",
    "engine_resume",
    "reward_model_wake",
    "reward_model_sleep",
    "teacher_wake",
    "teacher_sleep",
)
"""Phases that sharing adds (weight sync included, though it runs in both modes)."""


PHASES = (
    "rollout",
    "generate",
    "reward",
    "reward_model",
    "reward_model_score",
    "teacher",
    "teacher_log_probs",
    "kl_first",
    *SHARING_PHASES,
    "critic_train",
    "actor_train",
    "step",
)
"""The driver's `time/<phase>` keys, in step order."""


def summarize_mode(
    result: dict[str, Any], sampler: GpuMemory, timeline: Timeline, host: HostMemory | None = None
) -> None:
    """Steady-state means, sharing share, tokens/s and per-phase GPU peaks, into `result`."""
    steps = result["steps"]
    # The first step warms up; in the plan's mode the second measures the memory and moves from the
    # whole-role state to the plan's, so the steady steps start after it (where there are more).
    warm_up = 2 if result.get("mode") in FIT_MODES and len(steps) > 2 else 1
    steady = steps[warm_up:] if len(steps) > warm_up else steps
    result["steady_steps"] = [s["step"] for s in steady]
    keys = sorted({k for s in steady for k in s if k.startswith("time/")})
    phase_s = {k[5:]: mean([float(s.get(k, 0.0)) for s in steady]) for k in keys}
    result["phase_s_mean"] = phase_s
    # Inside each train's phase, where its seconds went on the worker (`train_time/<role>/<part>`).
    inside = sorted({k for s in steady for k in s if k.startswith("train_time/")})
    result["train_time_s_mean"] = {
        k.removeprefix("train_time/"): mean([float(s.get(k, 0.0)) for s in steady]) for k in inside
    }
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
    # What each weight sync changed in the engine's weights, and the engine's own seconds in the sync.
    result["changed_fraction"] = [s.get("policy/changed_fraction") for s in steps]
    result["changed_fraction_since_start"] = [s.get("policy/changed_fraction_since_start") for s in steps]
    result["engine_weight_update_s"] = mean(
        [float(s["time/engine_weight_update"]) for s in steady if "time/engine_weight_update" in s]
    )
    result["sampler_log_prob_gap"] = mean(
        [float(s["actor/sampler_log_prob_gap"]) for s in steady if "actor/sampler_log_prob_gap" in s]
    )
    result["truncated_share"] = mean([float(s["reward/truncated"]) for s in steady])
    result["moved_gib"] = [s.get("memory/moved_gib") for s in steps]  # the memory plan's (None: whole roles)
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
    import ray  # after the bench set Ray's environment (main)

    run_dir = paths["work"] / f"run-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    values = ppo_values(
        args,
        mode,
        paths["hf"],
        paths["data"],
        paths["reward"],
        run_dir,
        paths.get("rm"),
        paths.get("teacher"),
    )
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
                len(result["steps"]) >= max(2, args.min_steps)
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
