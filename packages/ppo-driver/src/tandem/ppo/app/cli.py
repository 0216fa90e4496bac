"""The `ppo-driver` command: `train`, `demo`, `eval`, `export`, `plot`, `fetch-model`, `memory-plan`.

Each subcommand's options come from a typed dataclass through tyro, so
`--help` shows every field's docstring. A bad value ends the command with a
one-line error that names the flag (exit 2); Ctrl-C during a run exits 130
after the step under way (and its save, when configured), SIGTERM 143 the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from tandem.ppo import __version__
from tandem.ppo._demo import DEMO_DEFAULTS, prepare_demo
from tandem.ppo._recall import RECALL_DEFAULTS, prepare_recall_demo
from tandem.ppo._sums import SUMS_DEFAULTS, prepare_sums_demo
from tandem.ppo.app.dry_run import dry_run_report, split_dry_run
from tandem.ppo.app.machine import adapt_to_machine, announce
from tandem.ppo.app.memory_report import MemoryPlanArgs, memory_report
from tandem.ppo.app.plot import plot_run
from tandem.ppo.app.pretrained import FetchModelArgs, fetch_model_command
from tandem.ppo.app.run_memory import start_warning
from tandem.ppo.config.file import parse_config, unvalidated
from tandem.ppo.config.ppo_config import PPOConfig
from tandem.ppo.run.errors import BROKEN_PIPE_EXIT_CODE, failure_line
from tandem.ppo.run.log import INTERRUPTED_EXIT_CODE, Interrupted
from tandem.ppo.run.terminal import terminal_output

logger = logging.getLogger("tandem.ppo.capacity")

PROG = "ppo-driver"


@dataclass(frozen=True)
class EvalArgs:
    """Options of `ppo-driver eval`."""

    model: Annotated[str, tyro.conf.Positional]
    """A Hugging Face folder, or a run dir (its `hf/` folder, and its own settings from config.yaml)."""
    data: str
    """Eval JSONL: a `prompt` string or chat `messages` per line, and a `label`."""
    rm_type: str | None = None
    """Built-in reward: exact_match or math; None: the run's reward (else exact_match)."""
    custom_rm_path: str | None = None
    """Your reward, `module:function` or `/path/file.py:function`; None: the run's (if it had one)."""
    n_samples_per_prompt: int | None = None
    """Responses per prompt; None: the run's `n_samples_per_eval_prompt` (else 1)."""
    temperature: float | None = None
    """Sampling temperature (0: greedy); None: the run's `eval_temperature` (else 0)."""
    max_response_len: int | None = None
    """Most tokens per response; None: the run's `rollout_max_response_len` (else 128)."""
    max_prompt_len: int | None = None
    """Longer prompts are dropped (and counted); None: the run's (else 512)."""
    accuracy_threshold: float | None = None
    """A response counts as correct when its reward is at least this; None: the run's (else 1)."""
    apply_chat_template: bool | None = None
    """Wrap prompts in the tokenizer's chat template; None: as the run did (else yes)."""
    local_gpus: int | None = None
    """Logical GPUs of a local Ray cluster; None: what Ray detects, or 1 on a machine without GPUs."""
    seed: int = 1234
    """Sampling seed."""
    base: str | None = None
    """A Hugging Face folder to compare the model's weights with, in the dtype the engine samples in:
    prints `policy/changed_fraction_since_start`, the share of weight elements that differ from it (0:
    the model samples as its base did); None: the run's `--hf-checkpoint` when MODEL is a run dir."""


@dataclass(frozen=True)
class ExportArgs:
    """Options of `ppo-driver export`."""

    run_dir: Annotated[str, tyro.conf.Positional]
    """The run whose latest actor checkpoint is exported (its config.yaml is read)."""
    out: str | None = None
    """Output folder (replaced, and said so, if it exists); None: RUN_DIR/hf, or RUN_DIR/hf-rollout-K beside
    it where the run has exported already (RUN_DIR/hf is never overwritten)."""


@dataclass(frozen=True)
class PlotArgs:
    """Options of `ppo-driver plot`."""

    run_dirs: Annotated[tuple[str, ...], tyro.conf.Positional]
    """One or more run dirs; several are overlaid in each figure (e.g. shared vs resident)."""
    out: str | None = None
    """Folder of the PNG files; None: the first run dir's `plots/`."""


def _train(argv: Sequence[str]) -> int:

    dry_run, argv = split_dry_run(argv)
    return _start(parse_config(argv, prog=f"{PROG} train", validate=False), dry_run)


DEMO_MODELS = ("tiny", "smollm2")
"""`ppo-driver demo --model`: the tiny local model (the default), or SmolLM2-135M-Instruct from PyPI."""

DEMO_TASKS = ("digits", "recall")
"""`ppo-driver demo --task`: the tiny model's single-turn digits (the default), or the multi-turn recall
task (`tandem.ppo._recall`: episodes of two turns with an environment)."""


def _demo(argv: Sequence[str]) -> int:

    dry_run, argv = split_dry_run(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="tiny")
    pre.add_argument("--task", default="digits")
    known, rest = pre.parse_known_args(list(argv))
    if known.model not in DEMO_MODELS:
        raise ValueError(f"--model: got {known.model!r}; choose one of {', '.join(DEMO_MODELS)}")
    if known.task not in DEMO_TASKS:
        raise ValueError(f"--task: got {known.task!r}; choose one of {', '.join(DEMO_TASKS)}")
    if known.task == "recall" and known.model != "tiny":
        raise ValueError("--task recall: runs on the tiny model; leave --model out")
    base, prepare = (
        (DEMO_DEFAULTS, prepare_demo) if known.model == "tiny" else (SUMS_DEFAULTS, prepare_sums_demo)
    )
    if known.task == "recall":
        base, prepare = RECALL_DEFAULTS, prepare_recall_demo
    parsed = parse_config(rest, prog=f"{PROG} demo", base=base, validate=False)
    if not dry_run:
        return _start(unvalidated(prepare(dataclasses.asdict(parsed))), dry_run)
    # A dry run writes nothing under RUN_DIR: the demo's model and task are built in a scratch folder,
    # where the config is validated, and the report names where a run builds them.
    with tempfile.TemporaryDirectory(prefix="tandem-dry-run-") as scratch:
        planned = unvalidated(prepare(dataclasses.asdict(parsed), write=False))
        built = unvalidated(prepare(dataclasses.asdict(parsed), root=scratch))
        return _start(planned, dry_run, checked_as=built)


def _start(config: PPOConfig, dry_run: bool, *, checked_as: PPOConfig | None = None) -> int:
    """Adapt `config` to this machine, validate it, then train (or, with --dry-run, print it).

    `checked_as`: validate this config in `config`'s place (the demo's dry run: its inputs built elsewhere).
    """

    config, changes = adapt_to_machine(config)
    adapt_to_machine(checked_as)[0].validate() if checked_as is not None else config.validate()
    announce(changes)  # after validating: a bad flag's error is the only line
    if dry_run:
        print(dry_run_report(config), end="")
        return 0
    for line in start_warning(
        config
    ):  # a run the arithmetic says will run out of memory, and the flags that fit
        logger.warning("%s", line.strip())
    from tandem.ppo.loop.training import train  # torch and Ray: loaded once a run starts, never for --help

    print(train(config).describe())
    return 0


def _eval(argv: Sequence[str]) -> int:
    from tandem.ppo.app.evaluate import evaluate_model  # torch and Ray: loaded for this command alone

    args = tyro.cli(EvalArgs, args=list(argv), prog=f"{PROG} eval")
    metrics = evaluate_model(args)
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}")
    return 0


def _export(argv: Sequence[str]) -> int:
    from tandem.ppo.app.evaluate import export_run  # torch and Ray: loaded for this command alone

    args = tyro.cli(ExportArgs, args=list(argv), prog=f"{PROG} export")
    print(export_run(args.run_dir, args.out))
    return 0


def _plot(argv: Sequence[str]) -> int:

    args = tyro.cli(PlotArgs, args=list(argv), prog=f"{PROG} plot")
    if not args.run_dirs:
        print(
            f"usage: {PROG} plot [-h] [--out DIR] RUN_DIR [RUN_DIR ...]\n"
            f"{PROG} plot: error: give at least one RUN_DIR (a folder with metrics.jsonl)",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "plots"
    for path in plot_run(list(args.run_dirs), out):
        print(path)
    return 0


def _fetch_model(argv: Sequence[str]) -> int:

    args = tyro.cli(FetchModelArgs, args=list(argv), prog=f"{PROG} fetch-model")
    print(fetch_model_command(args))
    return 0


def _memory_plan(argv: Sequence[str]) -> int:

    args = tyro.cli(MemoryPlanArgs, args=list(argv), prog=f"{PROG} memory-plan")
    print(memory_report(args))
    return 0


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (_train, "train a model with PPO (YAML --config plus flags)"),
    "demo": (
        _demo,
        "PPO on a tiny local model that learns on the CPU in minutes (no downloads); "
        "--model smollm2: on the pretrained SmolLM2-135M-Instruct; --task recall: episodes of two turns",
    ),
    "eval": (_eval, "run a saved actor on an eval JSONL and print the metrics"),
    "export": (_export, "write a run's latest actor checkpoint as a Hugging Face folder"),
    "plot": (_plot, "write PNG curves of one or more runs' metrics"),
    "fetch-model": (
        _fetch_model,
        "fetch a pretrained model (smollm2) into the cache as a Hugging Face folder",
    ),
    "memory-plan": (
        _memory_plan,
        "what a --memory-plan fit run's plan moves, on its GPU or on one of another size",
    ),
}


def _version() -> str:

    return f"{PROG} {__version__}"


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `ppo-driver`; exits with the command's status."""
    # Ray reads this when it is imported: workers run this interpreter, instead of Ray shipping
    # the project as a runtime env and starting every worker through `uv run` again.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

    try:
        try:
            status = run(sys.argv[1:] if argv is None else argv)
        except (
            SystemExit
        ) as exit_:  # --help, --version, a usage error: their output too may meet a closed pipe
            status = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`| head`): the rest of the output has nowhere to go, and
        # Python must not complain about it when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = BROKEN_PIPE_EXIT_CODE
    sys.exit(status)


def run(argv: Sequence[str]) -> int:
    """Run one subcommand; its exit status (0 ok, 1 a failure, 2 bad input, 130 Ctrl-C, 143 SIGTERM; `errors`)."""

    parser = argparse.ArgumentParser(prog=PROG, description="Tandem's PPO trainer.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    argv = list(argv)
    command_index = next((i for i, a in enumerate(argv) if a in COMMANDS), None)
    if command_index is None:
        parser.parse_args(argv)  # prints help / version / the usage error, and exits
        return 2
    parser.parse_args(argv[: command_index + 1])
    command, rest = argv[command_index], argv[command_index + 1 :]

    try:
        with terminal_output():
            return COMMANDS[command][0](rest)
    except (Interrupted, KeyboardInterrupt) as exc:
        # Interrupted and StoppedNow say which signal it was (Ctrl-C, SIGTERM) and what was saved.
        print(f"{PROG} {command}: stopped by {getattr(exc, 'by', 'Ctrl-C')}. {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_code", INTERRUPTED_EXIT_CODE))
    except Exception as exc:
        failure = failure_line(exc)
        if failure is None:
            raise  # not an input error or a known failure: a bug, with its traceback
        status, line = failure
        print(f"{PROG} {command}: error: {line}", file=sys.stderr)
        return status


if __name__ == "__main__":
    main()
