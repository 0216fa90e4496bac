"""The driver's own state, saved atomically beside each checkpoint so that a resumed run continues exactly.

`RUN_DIR/driver/iter_XXXXXXX.json` holds what the models' checkpoints do not:
the rollout id, the data cursor (epoch and position in its permutation), the
Python RNG state and the last step's metrics (a resume reads the steps before
from metrics.jsonl: `metrics_before`; a state that held them all grew with the
run, and the run's states with its square). It is written before the models save
(a temporary file, fsync, `os.replace`), so every complete model checkpoint has
its driver state next to it; a resumed run takes the one of the rollout its
models loaded.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tandem.megatron.runtime.fault_points import fault_point
from tandem.ppo.run.metrics import read_metrics


@dataclass
class DriverState:
    """What the driver needs to continue after rollout `rollout_id`.

    Attributes:
        rollout_id: the last complete rollout (the next one is `rollout_id + 1`).
        data: the training dataset's `state_dict()` after that rollout's prompts.
        python_rng: `random.getstate()` of the driver, as a JSON-friendly list.
        metrics: the last step's metrics (a list of one dict; a state written before held every step's).
    """

    rollout_id: int
    data: dict[str, Any]
    python_rng: list[Any] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def capture(cls, rollout_id: int, data: dict[str, Any], metrics: list[dict[str, Any]]) -> DriverState:
        """The state now (RNG included), with the last of `metrics` (every step's, so far)."""
        version, internal, gauss = random.getstate()
        return cls(rollout_id, data, [version, list(internal), gauss], list(metrics[-1:]))

    def restore_rng(self) -> None:
        """Put the driver's Python RNG back where it was."""
        if self.python_rng:
            version, internal, gauss = self.python_rng
            random.setstate((version, tuple(internal), gauss))


def state_dir(run_dir: str | os.PathLike[str]) -> Path:
    """The folder of the driver's states."""
    return Path(run_dir) / "driver"


def state_path(run_dir: str | os.PathLike[str], rollout_id: int) -> Path:
    """Where rollout `rollout_id`'s driver state lives."""
    return state_dir(run_dir) / f"iter_{rollout_id:07d}.json"


def save_state(run_dir: str | os.PathLike[str], state: DriverState) -> Path:
    """Write `state` atomically; returns its path."""
    path = state_path(run_dir, state.rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(state), f)
        f.flush()
        os.fsync(f.fileno())
    fault_point("driver_state.written", rollout_id=state.rollout_id)
    os.replace(tmp, path)
    return path


def load_state(run_dir: str | os.PathLike[str], rollout_id: int) -> DriverState:
    """The driver state of rollout `rollout_id`; ValueError naming the file when it is missing."""
    path = state_path(run_dir, rollout_id)
    if not path.is_file():
        raise ValueError(
            f"--run-dir: the models resumed from rollout {rollout_id} but {path} is missing, so the data "
            "cursor cannot be restored; resume from another run dir, or remove the models' newer checkpoints"
        )
    return DriverState(**json.loads(path.read_text()))


def metrics_before(run_dir: str | os.PathLike[str], start: int, state: DriverState) -> list[dict[str, Any]]:
    """The metrics of steps 0 .. start - 1, for a run that resumes at `start`: metrics.jsonl's lines of
    those steps (a NaN there is None), where it holds each of them, else what `state` holds."""
    try:
        rows = read_metrics(run_dir)
    except ValueError:  # no metrics.jsonl, or a line that is not ours: the state's own
        return list(state.metrics)
    by_step = {
        row["step"]: {k: v for k, v in row.items() if k != "step"} for row in rows if 0 <= row["step"] < start
    }
    if sorted(by_step) != list(range(start)):
        return list(state.metrics)
    return [by_step[k] for k in range(start)]
