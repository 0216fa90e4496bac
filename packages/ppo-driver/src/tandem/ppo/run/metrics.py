"""Per-step metrics of a run: `RUN_DIR/metrics.jsonl`, TensorBoard event files, and a progress bar.

`metrics.jsonl` has one JSON object per `log` call, `{"step": step, **metrics}`,
written and flushed at once, so a crash loses no line already logged. A resumed
run (`start_step=k`) first drops the lines of steps `>= k`: the killed run logged
them after its last checkpoint and the resumed run redoes them. TensorBoard is
told the same through `purge_step`. The file is strict JSON: a metric whose value is
undefined at that step (NaN or infinite, e.g. the critic's explained variance when every
return is the same) is written as `null`, read back as None, and not written to
TensorBoard. A metric that was not computed at all (the entropy with no entropy bonus,
the actor's losses during critic-only steps) is absent from the line.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PHASE_WORDS = {
    "generate": "generating responses",
    "eval": "eval, generating and scoring",
    "kl_first": "reference log-probs",
    "save": "saving the checkpoint",
    "export_hf": "writing the Hugging Face folder",
    "weight_sync": "weights to the engines",
    **{f"{role}_{work}": f"{role} {ing}" for role in ("actor", "critic") for work, ing in (
        ("train", "training"), ("wake", "waking"), ("sleep", "going to sleep"))},
}  # fmt: skip
"""How the progress bar names a phase (`MetricsLogger.status`); any other: its name, in words."""

METRIC_NAME = re.compile(r"^[A-Za-z0-9_./-]+$")
"""What a metric's name may hold: the characters that TensorBoard, wandb and MLflow all take as a tag."""


def _parse_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Rows of `path` and how many lines were torn (not JSON objects); only the last line may be torn."""
    rows: list[dict[str, Any]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    torn = 0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            if lineno == len(lines):  # a crash while this line was being written
                torn += 1
                continue
            raise ValueError(
                f"{path}, line {lineno}: not a metrics line ({line[:80]!r}); fix or remove that line"
            )
        rows.append(row)
    return rows, torn


def _json_number(value: float) -> float | None:
    """`value` as strict JSON takes it: None (`null`) for NaN and infinities."""
    return value if math.isfinite(value) else None


def _strict(row: dict[str, Any]) -> dict[str, Any]:
    """A row read back, with any NaN that an older file held as null."""
    return {k: _json_number(v) if isinstance(v, float) else v for k, v in row.items()}


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of `RUN_DIR/metrics.jsonl`, in the order logged (a torn last line is skipped; null is None)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist; pass a run directory (one that a training run wrote)")
    return _parse_lines(path)[0]


def _truncate(path: Path, start_step: int) -> None:
    """Drop the lines of steps >= `start_step` (and a torn last line), atomically."""
    if not path.is_file():
        return
    rows, torn = _parse_lines(path)
    kept = [row for row in rows if row["step"] < start_step]
    if len(kept) == len(rows) and not torn:
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(_strict(row), allow_nan=False) + "\n" for row in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class MetricsLogger:
    """Writes each step's metrics to `metrics.jsonl`, TensorBoard and a tqdm progress bar.

    Steps count from 0; after `log(step, ...)` the bar shows `step + 1` of
    `total_steps` done. Several `log` calls may share a step (e.g. train and
    eval metrics); each is its own line. Use it as a context manager, or call `close()`.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        progress: bool = True,
        keys_on_bar: Sequence[str] = ("reward/mean", "loss/policy", "loss/value"),
        sinks: Sequence[Any] = (),
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        """`RUN_DIR/metrics.jsonl`."""
        self.tensorboard_dir: Path | None = self.run_dir / TENSORBOARD_DIR if tensorboard else None
        """Where the TensorBoard event files go (None when TensorBoard is off)."""
        self.keys_on_bar = tuple(keys_on_bar)
        self.sinks = list(sinks)
        """Experiment trackers (`tandem.ppo.run.trackers`) that get every logged line, closed with this logger."""
        _truncate(self.path, start_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._writer: Any = None
        if self.tensorboard_dir is not None:
            from tensorboardX import SummaryWriter

            # purge_step makes TensorBoard discard the killed run's events of steps >= start_step.
            self._writer = SummaryWriter(
                logdir=str(self.tensorboard_dir), purge_step=start_step if start_step > 0 else None
            )
        from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type stubs

        self._bar = tqdm(
            total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, disable=not progress
        )
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Append `{"step": step, **metrics}` to metrics.jsonl, write each scalar to TensorBoard, move the bar."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log after close()")
        if "step" in metrics:
            raise ValueError('a metric may not be named "step": that key holds the step number')
        for key, value in metrics.items():
            if not METRIC_NAME.match(key):
                raise ValueError(
                    f"metric {key!r}: a name holds letters, digits and _ . - / only (a legal tag of "
                    "TensorBoard, wandb and MLflow); rename it"
                )
            if not isinstance(value, numbers.Real):
                raise TypeError(f"metric {key!r} is {value!r}, not a number; log float(...)")
        row = {"step": step, **{k: _json_number(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._writer is not None:
            for key, value in metrics.items():
                if math.isfinite(value):
                    self._writer.add_scalar(key, float(value), step)
            self._writer.flush()
        for sink in self.sinks:
            sink.log(step, metrics)
        shown = {key: f"{metrics[key]:.4g}" for key in self.keys_on_bar if key in metrics}
        if shown:
            self._bar.set_postfix(shown, refresh=False)
        self._bar.update(max(0, step + 1 - self._bar.n))

    def status(self, phase: str) -> None:
        """Name the phase under way on the bar (`step 3: critic training`), at once: a phase may take
        minutes (a first step on a CPU), and a bar that does not move says nothing of why."""
        words = PHASE_WORDS.get(phase, phase.replace("_", " "))
        # A save and the export follow the step's line in the log: they belong to the step logged last.
        step = self._bar.n - 1 if phase in ("save", "export_hf") and self._bar.n > 0 else self._bar.n
        self._bar.set_description_str(f"step {step}: {words}", refresh=True)

    def close(self) -> None:
        """Close the file, the TensorBoard writer and the bar; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._bar.close()
        for sink in self.sinks:
            sink.close()
        if self._writer is not None:
            self._writer.close()
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
