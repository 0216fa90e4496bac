"""The PPO GPU bench's report: the two modes compared, against verl's anchor, plotted and printed.

`new_report` starts `OUT/ppo_gpu_bench.json` (the command, the host, the versions, the
work); `compare` adds the overhead of sharing, the figures against verl's and the goals;
`plot` the curves; `print_summary` the markdown summary.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_harness import fmt, gpu_name
from ppo_modes import (
    FIT_KV_SAVER_MODE,
    FIT_MODE,
    FIT_NO_PREFETCH_MODE,
    FIT_SERIAL_MODE,
    FIT_WHOLE_TAGS_MODE,
    NO_COUNT_MODE,
    PHASES,
)

from tandem.ppo.app.plot import plot_run

VERL_ANCHOR_S = {
    "generate": 17.5,
    "reference": 5.3,
    "values": 5.6,
    "critic_update": 16.5,
    "actor_update": 20.8,
    "step": 66.0,
}
"""verl's PPO example (Qwen2.5-0.5B, GSM8K) on one GPU: seconds per phase of a step."""


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
    report["policy_change_count"] = count_cost(shared, report["modes"].get(NO_COUNT_MODE) or {})
    report["memory_plan"] = plan_cost(shared, resident, report["modes"].get(FIT_MODE) or {})
    fit = report["modes"].get(FIT_MODE) or {}
    report["overlap_moves"] = overlap_cost(fit, report["modes"].get(FIT_SERIAL_MODE) or {})
    report["optimizer_pieces"] = pieces_cost(fit, report["modes"].get(FIT_WHOLE_TAGS_MODE) or {})
    report["prefetch_wakes"] = prefetch_cost(fit, report["modes"].get(FIT_NO_PREFETCH_MODE) or {})
    report["kv_saver"] = kv_saver_cost(fit, report["modes"].get(FIT_KV_SAVER_MODE) or {})
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


def plan_cost(shared: dict[str, Any], resident: dict[str, Any], fit: dict[str, Any]) -> dict[str, Any] | None:
    """The memory plan's mode against whole-role sharing and resident: each mode's warm step, the plan's step
    over resident's less one, and the GiB its planned steps moved (`memory/moved_gib`); None without it."""
    step = fit.get("step_s_mean")
    if step is None:
        return None
    r_step, s_step = resident.get("step_s_mean"), shared.get("step_s_mean")
    return {
        "fit_step_s": step,
        "shared_step_s": s_step,
        "resident_step_s": r_step,
        "fit_over_resident": step / r_step - 1 if r_step else None,
        "fit_over_shared": step / s_step - 1 if s_step else None,
        "moved_gib": fit.get("moved_gib"),
        "gpu_peak_gib": (fit.get("gpu_peak_gib") or {}).get("overall"),
    }


def overlap_cost(at_once: dict[str, Any], serial: dict[str, Any]) -> dict[str, Any] | None:
    """The memory plan's moves at once against one after the other (`--ab-overlap-moves`): each mode's warm
    step, the seconds of its tag moves (`handover`, the train roles' sleeps and wakes), and the GiB its
    steps moved (the same plan: equal); None without both."""
    if at_once.get("step_s_mean") is None or serial.get("step_s_mean") is None:
        return None
    moves = ("handover", "actor_sleep", "actor_wake", "critic_sleep", "critic_wake")

    def moving(mode: dict[str, Any]) -> float:
        return sum((mode.get("phase_s_mean") or {}).get(p) or 0.0 for p in moves)

    return {
        "step_s": {"at_once": at_once["step_s_mean"], "serial": serial["step_s_mean"]},
        "moves_s": {"at_once": moving(at_once), "serial": moving(serial)},
        "handover_s": (at_once.get("phase_s_mean") or {}).get("handover"),
        "at_once_over_serial": at_once["step_s_mean"] / serial["step_s_mean"] - 1,
        "moved_gib": {"at_once": at_once.get("moved_gib"), "serial": serial.get("moved_gib")},
    }


KV_SAVER_PHASES = ("engine_release", "engine_resume", "engine_resume_kv_cache", "generate")
"""The phases a KV cache at fixed addresses changes: its release and resume, and the generation that
captured the decode's CUDA graphs again after each release."""


def kv_saver_cost(torch_kv: dict[str, Any], saver_kv: dict[str, Any]) -> dict[str, Any] | None:
    """The memory plan with the engine's KV cache on torch's allocator against in a torch_memory_saver region
    (`--ab-kv-saver`): each mode's warm step and the phases the lever changes (`KV_SAVER_PHASES`); None
    without both."""
    if torch_kv.get("step_s_mean") is None or saver_kv.get("step_s_mean") is None:
        return None

    def phases(mode: dict[str, Any]) -> dict[str, float | None]:
        means = mode.get("phase_s_mean") or {}
        return {p: means.get(p) for p in KV_SAVER_PHASES}

    return {
        "step_s": {"torch": torch_kv["step_s_mean"], "torch_memory_saver": saver_kv["step_s_mean"]},
        "phase_s": {"torch": phases(torch_kv), "torch_memory_saver": phases(saver_kv)},
        "saver_over_torch": saver_kv["step_s_mean"] / torch_kv["step_s_mean"] - 1,
    }


def prefetch_cost(ahead: dict[str, Any], at_turn: dict[str, Any]) -> dict[str, Any] | None:
    """The memory plan with its copied wakes in the background of the turn before against each wake as its
    turn is entered (`--ab-prefetch`): each mode's warm step, the seconds its steps waited for the train roles'
    wakes (`actor_wake`, `critic_wake`: in the background, only what the turn before left), and the GiB
    its steps moved; None without both."""
    if ahead.get("step_s_mean") is None or at_turn.get("step_s_mean") is None:
        return None

    def waking(mode: dict[str, Any]) -> float:
        return sum((mode.get("phase_s_mean") or {}).get(p) or 0.0 for p in ("actor_wake", "critic_wake"))

    return {
        "step_s": {"prefetch": ahead["step_s_mean"], "at_turn": at_turn["step_s_mean"]},
        "wakes_s": {"prefetch": waking(ahead), "at_turn": waking(at_turn)},
        "prefetch_over_at_turn": ahead["step_s_mean"] / at_turn["step_s_mean"] - 1,
        "moved_gib": {"prefetch": ahead.get("moved_gib"), "at_turn": at_turn.get("moved_gib")},
    }


def pieces_cost(pieces: dict[str, Any], whole: dict[str, Any]) -> dict[str, Any] | None:
    """The memory plan with its optimizer tags in quarters against whole (`--ab-optimizer-pieces`): each mode's
    warm step, and the GiB each step moved; None without both."""
    if pieces.get("step_s_mean") is None or whole.get("step_s_mean") is None:
        return None
    return {
        "step_s": {"pieces": pieces["step_s_mean"], "whole_tags": whole["step_s_mean"]},
        "pieces_over_whole_tags": pieces["step_s_mean"] / whole["step_s_mean"] - 1,
        "moved_gib": {"pieces": pieces.get("moved_gib"), "whole_tags": whole.get("moved_gib")},
    }


def count_cost(counted: dict[str, Any], uncounted: dict[str, Any]) -> dict[str, Any] | None:
    """The weight sync with and without the count of changed weights (`--ab-policy-change-count`): the
    sync's seconds (`time/weight_sync`) and the engine's own (`time/engine_weight_update`) in each
    shared run, and what the count adds as a share of the uncounted sync (goal: under 5 %)."""
    if not counted.get("phase_s_mean") or not uncounted.get("phase_s_mean"):
        return None
    sync = (counted["phase_s_mean"].get("weight_sync"), uncounted["phase_s_mean"].get("weight_sync"))
    engine = (counted.get("engine_weight_update_s"), uncounted.get("engine_weight_update_s"))
    return {
        "weight_sync_s": {"count": sync[0], "no_count": sync[1]},
        "engine_weight_update_s": {"count": engine[0], "no_count": engine[1]},
        "count_share_of_sync": sync[0] / sync[1] - 1 if sync[0] and sync[1] else None,
        "engine_count_share_of_sync": (engine[0] - engine[1]) / sync[1]
        if engine[0] is not None and engine[1] is not None and sync[1]
        else None,
    }


def plot(report: dict[str, Any], paths: dict[str, Path]) -> None:
    runs = [(m, Path(r["run_dir"])) for m, r in report["modes"].items() if r.get("steps")]
    if not runs:
        return
    try:
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
    inside = sorted({k for m in names for k in modes[m].get("train_time_s_mean") or {}})
    for key in inside:  # inside each train's phase: its seconds by part on the worker
        cells = [(modes[m].get("train_time_s_mean") or {}).get(key) for m in names]
        print(f"| in the train: {key} | " + " | ".join(fmt(c) for c in cells) + " |")
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
        "engine's own seconds in the weight sync (ms)": [
            None
            if modes[m].get("engine_weight_update_s") is None
            else 1000 * modes[m]["engine_weight_update_s"]
            for m in names
        ],
        "weights changed by the last sync (%)": [
            _last_percent(modes[m].get("changed_fraction")) for m in names
        ],
        "weights changed since the start (%)": [
            _last_percent(modes[m].get("changed_fraction_since_start")) for m in names
        ],
        "sampler vs trainer |log-prob gap| (nats x 1000)": [
            None if modes[m].get("sampler_log_prob_gap") is None else 1000 * modes[m]["sampler_log_prob_gap"]
            for m in names
        ],
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
    cost = report.get("policy_change_count")
    if cost:
        print(
            f"\nweight sync with / without the count of changed weights: {fmt(cost['weight_sync_s']['count'], '.3f')}"
            f" / {fmt(cost['weight_sync_s']['no_count'], '.3f')} s ({fmt(cost['count_share_of_sync'], '+.1%')}); "
            f"the engine's own: {fmt(cost['engine_weight_update_s']['count'], '.4f')} / "
            f"{fmt(cost['engine_weight_update_s']['no_count'], '.4f')} s "
            f"({fmt(cost['engine_count_share_of_sync'], '+.1%')} of the sync)"
        )
    for label, key in (
        ("the memory plan (--ab-memory-plan)", "memory_plan"),
        ("its moves at once against one after the other (--ab-overlap-moves)", "overlap_moves"),
        ("its optimizer tags in quarters against whole (--ab-optimizer-pieces)", "optimizer_pieces"),
        (
            "its wakes in the background of the turn before against at their turn (--ab-prefetch)",
            "prefetch_wakes",
        ),
        ("the engine's KV cache in a torch_memory_saver region against torch's (--ab-kv-saver)", "kv_saver"),
    ):
        if report.get(key):
            print(f"\n{label}: {report[key]}")
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


def _last_percent(values: list[float | None] | None) -> float | None:
    known = [v for v in values or [] if v is not None]
    return 100 * known[-1] if known else None


def new_report(args: argparse.Namespace, argv: list[str], started: float) -> dict[str, Any]:
    """The bench's report before any mode ran: the command, the host, the versions and the work."""
    import torch
    import transformers

    return {
        "_started": started,
        "bench": "ppo_gpu_bench",
        "command": "python3 bench/ppo_gpu_bench.py " + " ".join(argv),
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
            + (
                f", + a {args.teacher} teacher (on-policy distillation)"
                if getattr(args, "teacher", None)
                else ""
            )
        ),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "verl_anchor_s": VERL_ANCHOR_S,
        "modes": {},
    }
