"""How the run's loop stops on a signal: SIGINT and SIGTERM finish the step and save, within a grace period.

The loop (`loop.run_loop`) runs here on stand-in steps, in this process, and the
signals are real ones sent to this process from inside a step: no Ray, no workers.
`tests/ppo/test_faults_e2e.py` sends SIGTERM to a real run.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.ppo.loop.run_loop import run_loop
from tandem.ppo.run.log import Interrupted


class Steps:
    """The loop's view of a driver (`loop.Steps`): `during(rollout_id)` runs inside each step."""

    def __init__(self, tmp_path: Path, during: Callable[[int], None], **config: Any) -> None:
        defaults = {
            "num_rollout": 10,
            "async_mode": False,
            "eval_interval": None,
            "eval_before_train": False,
            "save_interval": None,
            "save_on_interrupt": True,
            "export_hf": False,
            "sigterm_grace_s": 25.0,
        }
        self.config = SimpleNamespace(**(defaults | config))
        self.run_dir = tmp_path
        self.start_rollout_id = 0
        self.eval_dataset = None
        self.logger = SimpleNamespace(log=lambda step, metrics: None)
        self.metrics_so_far: list[dict[str, Any]] = []
        self.eval_before = None
        self.generating = None
        self.last_sampled: Any = None
        self.during = during
        self.stepped: list[int] = []
        self.saved: list[int] = []

    def step(self, rollout_id: int, sampled: Any = None, *, start_next: Any = None) -> dict[str, Any]:
        self.during(rollout_id)
        self.stepped.append(rollout_id)
        self.last_sampled = SimpleNamespace(data_state={"cursor": rollout_id})
        return {"reward/mean": 0.0}

    def save(self, rollout_id: int, data_state: dict[str, Any] | None = None) -> None:
        self.saved.append(rollout_id)


def _signal_at(rollout: int, signum: int) -> Callable[[int], None]:
    def during(rollout_id: int) -> None:
        if rollout_id == rollout:
            os.kill(os.getpid(), signum)

    return during


@pytest.mark.parametrize(
    ("signum", "by", "status"), [(signal.SIGTERM, "SIGTERM", 143), (signal.SIGINT, "Ctrl-C", 130)]
)
def test_a_signal_finishes_the_step_saves_it_and_says_what_was_saved(
    tmp_path: Path, signum: int, by: str, status: int
) -> None:
    steps = Steps(tmp_path, _signal_at(2, signum), save_interval=2)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as info:
        run_loop(steps)  # type: ignore[arg-type]
    assert steps.stepped == [0, 1, 2] and steps.saved == [1, 2]
    assert (info.value.by, info.value.exit_code) == (by, status)
    assert (
        str(info.value)
        == f"interrupted after rollout 2 (saved: rollout 2, in {tmp_path}; the same command resumes it)"
    )
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


def test_a_step_that_outlasts_the_grace_period_stops_at_once_keeping_the_last_save(tmp_path: Path) -> None:
    """SIGTERM in step 1, whose work never ends: once the grace period has passed, the loop stops where it
    is; the save of rollout 0 is the last complete one, and the message says so."""
    never = threading.Event()

    def during(rollout_id: int) -> None:
        if rollout_id == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            never.wait(600)

    steps = Steps(tmp_path, during, save_interval=1, sigterm_grace_s=0.2)
    with pytest.raises(KeyboardInterrupt) as info:
        run_loop(steps)  # type: ignore[arg-type]
    assert steps.stepped == [0] and steps.saved == [0]
    assert (getattr(info.value, "by", None), getattr(info.value, "exit_code", None)) == ("SIGTERM", 143)
    assert str(info.value) == (
        "the step under way did not finish within --sigterm-grace-s 0.2 s of SIGTERM: stopped at once (saved: "
        f"rollout 0, in {tmp_path}; the same command resumes it)"
    )


def test_a_signal_before_anything_was_saved_says_so(tmp_path: Path) -> None:
    steps = Steps(tmp_path, _signal_at(0, signal.SIGTERM), save_on_interrupt=False)
    with pytest.raises(
        Interrupted, match=r"^interrupted after rollout 0 \(saved: nothing yet; the same command starts"
    ):
        run_loop(steps)  # type: ignore[arg-type]
    assert steps.saved == []
