"""What a run records: its events, each phase's seconds and memory, its end summary, and how Ctrl-C or SIGTERM ends it."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.megatron.runtime.gpu_memory import all_devices_used_bytes

__all__ = [
    "INTERRUPTED_EXIT_CODE",
    "TERMINATED_EXIT_CODE",
    "EventLog",
    "Interrupted",
    "PhaseClock",
    "RunSummary",
    "StoppedNow",
]

INTERRUPTED_EXIT_CODE = 130
"""Exit status after Ctrl-C (128 + SIGINT, as a shell reports it)."""

TERMINATED_EXIT_CODE = 143
"""Exit status after SIGTERM (128 + SIGTERM): a scheduler's preemption (Slurm, Kubernetes, Ray's autoscaler)."""


class Interrupted(Exception):
    """A signal stopped the run after the step under way (and its save when configured).

    `by`: "Ctrl-C" or "SIGTERM"; `exit_code`: the command's exit status for it.
    """

    def __init__(self, message: str, *, by: str = "Ctrl-C") -> None:
        super().__init__(message)
        self.by = by
        self.exit_code = TERMINATED_EXIT_CODE if by == "SIGTERM" else INTERRUPTED_EXIT_CODE


class StoppedNow(KeyboardInterrupt):
    """A signal stopped the run at once, in the middle of a step (a second signal, or SIGTERM's grace
    period over): the last complete checkpoint stays. A KeyboardInterrupt, so that no `except Exception`
    on its way holds it up; `by` and `exit_code` as `Interrupted`'s."""

    def __init__(self, message: str, *, by: str) -> None:
        super().__init__(message)
        self.by = by
        self.exit_code = TERMINATED_EXIT_CODE if by == "SIGTERM" else INTERRUPTED_EXIT_CODE


@dataclass
class RunSummary:
    """Where a finished (or interrupted) run put its results."""

    run_dir: Path
    last_rollout_id: int
    metrics: list[dict[str, Any]] = field(default_factory=list)
    hf_dir: Path | None = None
    interrupted: bool = False
    eval_before: dict[str, float] | None = None
    """The eval of the starting weights (`eval_before_train`), when one ran."""
    already_complete: bool = False
    """The run folder held every rollout already: this start trained nothing."""

    def describe(self) -> str:
        """The lines printed at the end of a run."""
        lines = []
        if self.already_complete:
            lines.append(
                f"run complete: {self.run_dir} holds every rollout (0..{self.last_rollout_id}); nothing to do "
                "(raise --num-rollout to train on, or give another --run-dir)"
            )
        lines += [f"run dir:      {self.run_dir}", f"metrics:      {self.run_dir / 'metrics.jsonl'}"]
        if (self.run_dir / "tensorboard").is_dir():  # not with --no-tensorboard
            lines.append(
                f"tensorboard:  tensorboard --logdir {self.run_dir / 'tensorboard'}{_tensorboard_hint()}"
            )
        lines += [
            f"plots:        ppo-driver plot {self.run_dir}  (PNG files in {self.run_dir / 'plots'})",
            "checkpoints:  "
            + ", ".join(str(self.run_dir / m) for m in ("actor", "critic") if (self.run_dir / m).is_dir()),
        ]
        logs = self.run_dir / "logs"
        if logs.is_dir():
            names = sorted(p.name for p in logs.glob("*.log"))
            lines.append(f"logs:         {logs}  ({', '.join(names)})")
        if self.hf_dir is not None:
            lines.append(f"hf model:     {self.hf_dir}")
        if self.metrics:
            last = self.metrics[-1]
            figures = ", ".join(f"{k}={last[k]:.3f}" for k in ("reward/mean", "reward/accuracy") if k in last)
            lines.append(f"last step:    {self.last_rollout_id} ({figures})")
            if self.eval_before is not None and "eval/mean" in last and "eval/mean" in self.eval_before:
                lines.append(
                    f"eval reward:  {self.eval_before['eval/mean']:.3f} before training, "
                    f"{last['eval/mean']:.3f} after"
                )
        return "\n".join(lines)


def _tensorboard_hint() -> str:
    """How to get the `tensorboard` command, where it is not installed."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        return ""
    return "  (needs: pip install tensorboard)"


class EventLog:
    """Timestamped driver events (`RUN_DIR/events.jsonl`): phases, sleeps and wakes, in order.

    With `defer`, events are kept in memory until `start()` (the run has started for
    good), so that a start that fails writes nothing into the run folder.
    """

    def __init__(self, path: Path, *, defer: bool = False) -> None:
        self.path = path
        self._pending: list[str] = []
        self._file: Any = None
        if not defer:
            self.start()

    def start(self) -> None:
        """Open the file and write the events kept so far; idempotent."""
        if self._file is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._file.writelines(self._pending)
        self._file.flush()
        self._pending = []

    def record(self, event: str, **fields: Any) -> None:
        """Append one event."""
        line = json.dumps({"t": time.time(), "event": event, **fields}) + "\n"
        if self._file is None:
            self._pending.append(line)
            return
        self._file.write(line)
        self._file.flush()

    def close(self) -> None:
        """Close the file (events not yet started are dropped)."""
        if self._file is not None:
            self._file.close()


class PhaseClock:
    """Seconds of each phase of a step (`time/<phase>`, added up when a phase recurs) and, on GPUs,
    the device memory in use at its end (`memory/<phase>_gib`); lifecycle steps' seconds too."""

    def __init__(self, *, track_gpu_memory: bool) -> None:
        self.track_gpu_memory = track_gpu_memory
        self.values: dict[str, float] = {}
        self.on_phase: Callable[[str, float, float], None] | None = None
        """Called with each phase's name and wall-clock start and end (`time.time()`), as it ends (a
        bench matches its GPU memory samples to the phases with it)."""
        self.on_begin: Callable[[str], None] | None = None
        """Told each phase's name as it begins (the progress bar's `MetricsLogger.status`); not the phases
        inside another (a save's wakes and sleeps are the save's)."""
        self._depth = 0

    def announce(self, name: str) -> None:
        """Tell `on_begin` that `name` begins (a phase's own `phase` does; work timed elsewhere calls it)."""
        if self.on_begin is not None:
            self.on_begin(name)

    def reset(self) -> None:
        """Forget the last step's figures."""
        self.values = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the `with` block as phase `name`."""
        if self._depth == 0:
            self.announce(name)
        self._depth += 1
        start, wall = time.perf_counter(), time.time()
        try:
            yield
        finally:
            self._depth -= 1
            key = f"time/{name}"
            self.values[key] = self.values.get(key, 0.0) + time.perf_counter() - start
            if self.track_gpu_memory:
                self._record_gpu_memory(name)
            if self.on_phase is not None:
                self.on_phase(name, wall, time.time())

    def record_lifecycle(self, name: str, per_rank: list[dict[str, float]]) -> None:
        """Each lifecycle step's seconds (the slowest rank's) as `lifecycle/<name>/<step>`.

        A step's `:` (`pause:weights`) becomes `_`, so that the name is a legal tag of every writer
        (TensorBoard, wandb, MLflow) and the same in metrics.jsonl: `lifecycle/actor_sleep/pause_weights`.
        """
        for timings in per_rank:
            for step, seconds in (timings or {}).items():
                key = f"lifecycle/{name}/{step.replace(':', '_')}"
                self.values[key] = max(self.values.get(key, 0.0), float(seconds))

    def _record_gpu_memory(self, phase: str) -> None:
        """`memory/<phase>_gib`: the most memory in use on any GPU at the end of the phase.

        nvidia-smi's figure includes what torch's caching allocators keep, so it is close
        to the phase's peak; on a machine without GPUs this turns itself off.
        """

        used = all_devices_used_bytes()
        if used is None:
            self.track_gpu_memory = False
            return
        key = f"memory/{phase}_gib"
        self.values[key] = max(self.values.get(key, 0.0), max(used) / 1024**3)
