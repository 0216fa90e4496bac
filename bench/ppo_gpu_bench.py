"""Shared PPO end to end on one GPU: per-phase seconds and peak memory, the cost of sharing, and MFU.

Everything is built here (`ppo_harness.py`; the modes' runs `ppo_modes.py`, the report `ppo_report.py`),
nothing comes from a hub: a random model of one of the harness's shapes (`--shape`: the
Qwen2.5 family, 0.5B by default, or SmolLM2-135M's), bf16, with a tokenizer of exactly its ids (byte-level
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
   **With a distillation teacher** (`--teacher SHAPE`, e.g. qwen2.5-1.5b beside the 0.5B
   policy): a random causal LM of that shape on the policy's tokenizer joins both modes
   (`--teacher-hf-checkpoint`, `--opd-coef 1`: its reverse KL in the rewards beside the rule's,
   so the critic's step takes the KL-first plan). Shared, it wakes after the engine's
   release, gives every response token's log-prob and sleeps before the actor's log-probs;
   resident, it stays on the GPU. Its phases (`teacher_wake` / `_log_probs` / `_sleep`,
   `teacher`, the whole turn) and `kl_first` join the table.
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
mode's steps early, after at least `--min-steps` (2 by default), so that the whole bench fits in about that):

    source .gpu-kit/setup.sh && python3 bench/ppo_gpu_bench.py --out "$OUT"
    source .gpu-kit/setup.sh && python3 bench/ppo_gpu_bench.py --reward-model --skip-probe --out "$OUT"
    source .gpu-kit/setup.sh && python3 bench/ppo_gpu_bench.py --teacher qwen2.5-1.5b --skip-probe --steps 3 --time-budget-s 200 --out "$OUT/ppo_gpu_bench_teacher.json"

The weight sync's count of changed weights (`policy/changed_fraction`, `..._since_start`, in every
mode's steps and summary): `--ab-policy-change-count` runs the shared mode again with it off
(`shared_no_count`) and reports the sync's seconds with and without it (`policy_change_count`);
`--no-policy-change-count` turns it off in every mode.

    source .gpu-kit/setup.sh && python3 bench/ppo_gpu_bench.py --ab-policy-change-count --skip-resident --skip-probe --out "$OUT"

The memory plan (`--memory-plan fit`): `--ab-memory-plan` runs the shared mode again with it
(`shared_fit`: its first step sleeps whole roles and measures, the later ones sleep only the tags each
turn needs room for) and reports its step against shared and resident (`memory_plan`: each mode's
warm step, `fit_over_resident`, and the bytes its steps moved, `moved_gib`); with `--quick` (no GPU to
ask) the plan's capacity is 64 GiB, so the models stay resident.

    source .gpu-kit/setup.sh && python3 bench/ppo_gpu_bench.py --ab-memory-plan --skip-probe --out "$OUT"

The plan's moves at once (`--overlap-moves`, on by default with `fit`): `--ab-overlap-moves` runs the
plan's mode twice, its moves at once where the plan has room (`shared_fit`) and one after the other
(`shared_fit_serial`), and reports each one's step and the seconds of its moves (`overlap_moves`). The
lever shows only where the plan moves tags of both models, as it may at 3B with 2048-token responses:

    source .gpu-kit/setup.sh && python3 bench/ppo_gpu_bench.py --shape qwen2.5-3b --response-len 2048 --ab-overlap-moves --skip-shared --skip-resident --skip-probe --out "$OUT"

The optimizer's tags in quarters (`--optimizer-pieces`, 4 by default with `fit`): `--ab-optimizer-pieces`
runs the plan's mode with them (`shared_fit`) and with whole tags (`shared_fit_whole_tags`), and reports
each one's step and the GiB each moved (`optimizer_pieces`); both A/Bs go in one run:

    source .gpu-kit/setup.sh && python3 bench/ppo_gpu_bench.py --shape qwen2.5-3b --response-len 2048 --ab-overlap-moves --ab-optimizer-pieces --skip-shared --skip-resident --skip-probe --out "$OUT"

A model's copied wakes in the background of the turn before (`--prefetch-wakes`, on by default with
`fit`): `--ab-prefetch` runs the plan's mode with them (`shared_fit`) and with each wake at its turn
(`shared_fit_no_prefetch`), and reports each one's step and the seconds its steps waited for the wakes
(`prefetch_wakes`):

    source .gpu-kit/setup.sh && python3 bench/ppo_gpu_bench.py --shape qwen2.5-3b --response-len 2048 --prompts 64 --global-batch-size 64 --ab-prefetch --skip-shared --skip-resident --skip-probe --steps 3 --out "$OUT"

These 3B commands with 2048-token responses fit an H200's 141 GB at the default micro batch; on an
80 GB card add `--micro-batch-size 1`: at 2 the plan refuses the second step (76.7 GiB needed, 74.6
available; docs/benchmarks.md, "3B with 2048-token responses and its memory plan").

The engine's KV cache at fixed addresses (`--rollout-kv-cache-backend torch_memory_saver`, off by
default): `--ab-kv-saver` runs the plan's mode with the KV cache on torch's allocator (`shared_fit`) and in
a torch_memory_saver region (`shared_fit_kv_saver`), and reports each one's step and the phases the lever
changes (`kv_saver`: the engines' release and resume, and the generation, which captures the decode's
CUDA graphs again after each release on torch's allocator). It shows where the plan releases the KV cache
alone, as at 1.5B in 96 GiB:

    source .gpu-kit/setup.sh && python3 bench/ppo_gpu_bench.py --shape qwen2.5-1.5b --set gpu_memory_gib=96 --ab-kv-saver --skip-shared --skip-resident --skip-probe --steps 3 --out "$OUT"

CPU smoke run (tiny model, 2 steps a mode, a tiny probe; the second with a reward model):

    ./uvw run python bench/ppo_gpu_bench.py --quick --out /tmp/ppo-bench
    ./uvw run python bench/ppo_gpu_bench.py --quick --reward-model --skip-probe --out /tmp/ppo-bench-rm
    ./uvw run python bench/ppo_gpu_bench.py --quick --teacher qwen2.5-1.5b --skip-probe --out /tmp/ppo-bench-teacher
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_harness import (
    QUICK_MODEL,
    REWARD_SOURCE,
    SHAPES,
    WORK,
    GpuMemory,
    HostMemory,
    build_policy,
    build_reward_model,
    check_prompts,
    run_probe,
    stop_ids_for_median,
    write_prompts,
    write_report,
)
from ppo_modes import (
    FIT_KV_SAVER_MODE,
    FIT_MODE,
    FIT_NO_PREFETCH_MODE,
    FIT_SERIAL_MODE,
    FIT_WHOLE_TAGS_MODE,
    NO_COUNT_MODE,
    ppo_values,
    run_mode,
)
from ppo_report import compare, new_report, plot, print_summary

__all__ = ["main", "parse_args", "ppo_values"]


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
    parser.add_argument(
        "--min-steps",
        type=int,
        default=2,
        help="steps a mode takes before --time-budget-s may end it (the first is the warm-up: 3 keeps two to "
        "average)",
    )
    parser.add_argument("--skip-resident", action="store_true", help="run only the shared mode")
    parser.add_argument("--skip-shared", action="store_true", help="run only the resident mode")
    parser.add_argument("--skip-probe", action="store_true", help="no training-speed probe")
    parser.add_argument(
        "--no-policy-change-count",
        action="store_true",
        help="every mode's weight sync without the count of changed weights (policy_change_count=False)",
    )
    parser.add_argument(
        "--ab-policy-change-count",
        action="store_true",
        help="after the shared mode, the same run with the count off (mode shared_no_count): the weight "
        "sync's seconds with and without it",
    )
    parser.add_argument(
        "--ab-memory-plan",
        action="store_true",
        help="after the shared mode, the same run with --memory-plan fit (mode shared_fit: the models sleep "
        "only the tags each turn needs room for, from the second step): its step against shared and resident",
    )
    parser.add_argument(
        "--ab-overlap-moves",
        action="store_true",
        help="the plan's mode twice (implies --ab-memory-plan): its moves at once where it has room (shared_fit) "
        "and one after the other (shared_fit_serial, --no-overlap-moves); the report's overlap_moves",
    )
    parser.add_argument(
        "--ab-optimizer-pieces",
        action="store_true",
        help="the plan's mode twice (implies --ab-memory-plan): its optimizer tags in quarters (shared_fit) and "
        "whole (shared_fit_whole_tags, --optimizer-pieces 1); the report's optimizer_pieces",
    )
    parser.add_argument(
        "--ab-prefetch",
        action="store_true",
        help="the plan's mode twice (implies --ab-memory-plan): its copied wakes in the background of the turn "
        "before (shared_fit) and each at its turn (shared_fit_no_prefetch, --no-prefetch-wakes); the report's "
        "prefetch_wakes",
    )
    parser.add_argument(
        "--ab-kv-saver",
        action="store_true",
        help="the plan's mode twice (implies --ab-memory-plan): the engine's KV cache on torch's allocator "
        "(shared_fit) and in a torch_memory_saver region, its CUDA graphs kept through a KV release "
        "(shared_fit_kv_saver, --rollout-kv-cache-backend torch_memory_saver); the report's kv_saver",
    )
    parser.add_argument(
        "--reward-model",
        action="store_true",
        help="add a random reward model of the policy's shape (one-label Qwen2 sequence classifier) to "
        "both modes: its score + the dense rule is the reward",
    )
    parser.add_argument(
        "--teacher",
        choices=sorted(SHAPES),
        default=None,
        help="on-policy distillation in both modes from a random teacher of this shape on the policy's "
        "tokenizer (e.g. qwen2.5-1.5b for the 0.5B policy; --quick: the quick model, twice as deep), "
        "--opd-coef 1 beside the rule reward",
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
        help="stop a mode's steps early (after --min-steps) so that the whole bench ends within this many seconds",
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
    if args.min_steps < 2:
        parser.error(f"--min-steps {args.min_steps}: give at least 2 (the first step is the warm-up)")
    if not args.scaling and args.min_steps > args.steps:
        parser.error(f"--min-steps {args.min_steps}: more than --steps {args.steps}; give at most that")
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
    if args.no_policy_change_count:
        if args.ab_policy_change_count:
            parser.error("--no-policy-change-count: the A/B (--ab-policy-change-count) needs the count on")
        args.overrides["policy_change_count"] = False
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

    shape = QUICK_MODEL if args.quick else SHAPES[args.shape]
    if args.alloc_conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf  # before Ray: every worker inherits it
    args.stop_token_ids = (
        stop_ids_for_median(shape["vocab_size"], args.target_median_len)
        if args.lengths == "realistic"
        else ()
    )
    report = new_report(args, sys.argv[1:] if argv is None else argv, started)
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
        if args.teacher:
            paths["teacher"] = work / f"teacher-{'quick' if args.quick else args.teacher}"
            teacher_shape = (
                {**shape, "num_hidden_layers": 2 * shape["num_hidden_layers"]}
                if args.quick
                else SHAPES[args.teacher]
            )
            teacher_params = build_policy(
                paths["teacher"],
                teacher_shape,
                dtype="float32" if args.quick else "bfloat16",
                seed=args.seed + 1,
            )
            report["teacher"] = {
                "shape": "the quick model, twice as deep" if args.quick else args.teacher,
                **teacher_shape,
                "params": teacher_params,
            }
        report["build_s"] = time.time() - t0
        write_report(report, json_path)

        modes = [
            m for m, skip in (("shared", args.skip_shared), ("resident", args.skip_resident)) if not skip
        ]
        if args.ab_policy_change_count:
            modes.insert(modes.index("shared") + 1 if "shared" in modes else 0, NO_COUNT_MODE)
        fit_ab = (args.ab_overlap_moves, args.ab_optimizer_pieces, args.ab_prefetch, args.ab_kv_saver)
        if args.ab_memory_plan or any(fit_ab):
            modes.insert(modes.index("shared") + 1 if "shared" in modes else 0, FIT_MODE)
        if args.ab_kv_saver:
            modes.insert(modes.index(FIT_MODE) + 1, FIT_KV_SAVER_MODE)
        if args.ab_prefetch:
            modes.insert(modes.index(FIT_MODE) + 1, FIT_NO_PREFETCH_MODE)
        if args.ab_overlap_moves:
            modes.insert(modes.index(FIT_MODE) + 1, FIT_SERIAL_MODE)
        if args.ab_optimizer_pieces:
            modes.insert(modes.index(FIT_MODE) + 1, FIT_WHOLE_TAGS_MODE)
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
