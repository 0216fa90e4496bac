"""The run's loop: one step per rollout, from the resumed one to `num_rollout`; eval, checkpoints, the HF export.

With `--async`, rollout k+1 is generated (on the engines' own GPUs, with the
weights of before step k) while the models train on rollout k; the weights reach
the engines once that generation is done, so every rollout but the first is one
step off-policy. Ctrl-C, and SIGTERM (a scheduler's preemption), finish the step under way
and save (`--save-on-interrupt`), skipping an eval that would be due; a second signal stops
at once, and so does SIGTERM's grace period when it runs out first (`--sigterm-grace-s`):
the last complete checkpoint stays, and the message says which it is.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tandem.ppo.run.log import Interrupted, RunSummary, StoppedNow

if TYPE_CHECKING:
    from tandem.ppo.config.ppo_config import PPOConfig
    from tandem.ppo.rollout.samples import Sampled
    from tandem.ppo.run.metrics import MetricsLogger

__all__ = ["Steps", "due", "run_loop"]

# The name its lines show on the terminal, kept from before the layers.
logger = logging.getLogger("tandem.ppo.loop")


class Steps(Protocol):
    """What the loop needs of the driver (`PPODriver`): its steps, eval, checkpoints and export."""

    config: PPOConfig
    run_dir: Path
    start_rollout_id: int
    eval_dataset: Any
    logger: MetricsLogger
    metrics_so_far: list[dict[str, Any]]
    eval_before: dict[str, float] | None
    generating: Future[Sampled] | None
    last_sampled: Sampled | None

    def step(
        self,
        rollout_id: int,
        sampled: Sampled | None = None,
        *,
        start_next: Callable[[], Future[Sampled]] | None = None,
    ) -> dict[str, Any]:
        """One PPO step; its metrics."""
        ...

    def draw(self, rollout_id: int, background: bool = False) -> Sampled:
        """Step 1 alone: rollout `rollout_id`, sampled, scored and split."""
        ...

    def evaluate(self) -> dict[str, float]:
        """The eval metrics."""
        ...

    def save(self, rollout_id: int, data_state: dict[str, Any] | None = None) -> None:
        """The run's checkpoint of `rollout_id`."""
        ...

    def export_hf(self) -> Path:
        """The actor as a Hugging Face folder."""
        ...


def due(interval: int | None, rollout_id: int) -> bool:
    """Whether something done every `interval` steps is due after `rollout_id` (None: never)."""
    return interval is not None and (rollout_id + 1) % interval == 0


def run_loop(steps: Steps) -> RunSummary:
    """Run from the resumed rollout to `num_rollout`; checkpoints, eval, the HF export at the end."""
    config = steps.config
    stop = _StopOnSignal(steps.run_dir, config.sigterm_grace_s)
    stop.saved = steps.start_rollout_id - 1
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    last = steps.start_rollout_id - 1
    pending: Future[Sampled] | None = None
    try:
        if (
            steps.eval_dataset is not None
            and config.eval_interval is not None
            and config.eval_before_train
            and steps.start_rollout_id == 0
        ):
            # The starting weights' eval, "after step -1" as every eval is after its step. A resumed
            # run has logged its step start - 1 already: no second record of that step.
            steps.eval_before = steps.evaluate()
            steps.logger.log(-1, steps.eval_before)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") as generation:
            for rollout_id in range(steps.start_rollout_id, config.num_rollout):
                # Sync loop: step() draws its own rollout (inside its clock). Async: the
                # rollout was generated in the background; step() starts the next one as
                # soon as this one is in hand.
                sampled = pending.result() if pending is not None else None
                pending = None
                ahead = None
                if config.async_mode and rollout_id + 1 < config.num_rollout:
                    ahead = functools.partial(generation.submit, steps.draw, rollout_id + 1, True)
                metrics = steps.step(rollout_id, sampled, start_next=ahead)
                pending, drawn = steps.generating, steps.last_sampled
                assert drawn is not None
                last = rollout_id
                final = rollout_id == config.num_rollout - 1
                evaluate = final or due(config.eval_interval, rollout_id)
                if steps.eval_dataset is not None and evaluate and not stop.requested:
                    metrics.update(steps.evaluate())
                steps.metrics_so_far.append(metrics)
                steps.logger.log(rollout_id, metrics)
                if (
                    final
                    or due(config.save_interval, rollout_id)
                    or (stop.requested and config.save_on_interrupt)
                ):
                    steps.save(rollout_id, drawn.data_state)
                    stop.saved = rollout_id
                if stop.requested:
                    raise Interrupted(
                        f"interrupted after rollout {rollout_id} ({stop.what_is_saved()})", by=stop.requested
                    )
        hf_dir = steps.export_hf() if config.export_hf and last >= 0 else None
        return RunSummary(steps.run_dir, last, steps.metrics_so_far, hf_dir, eval_before=steps.eval_before)
    finally:
        stop.cancel()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _StopOnSignal:
    """The loop's SIGINT and SIGTERM handler: the first signal asks to stop after the step (and its save),
    a second stops now; after SIGTERM, so does the end of the grace period (`grace_s`, None: none).

    `saved`: the last rollout saved (the loop keeps it up to date), for the messages.
    """

    def __init__(self, run_dir: Path, grace_s: float | None) -> None:
        self.run_dir = run_dir
        self.grace_s = grace_s
        self.requested: str | None = None
        """What asked to stop: "Ctrl-C" or "SIGTERM" (None: nothing yet)."""
        self.saved = -1
        self._expired = False
        self._timer: threading.Timer | None = None

    def what_is_saved(self) -> str:
        """ "saved: rollout K, in RUN_DIR; ..." for the messages."""
        if self.saved < 0:
            return "saved: nothing yet; the same command starts the run again"
        return f"saved: rollout {self.saved}, in {self.run_dir}; the same command resumes it"

    def __call__(self, signum: int, frame: Any) -> None:
        by = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        if self._expired:
            raise StoppedNow(
                f"the step under way did not finish within --sigterm-grace-s {self.grace_s:g} s of SIGTERM: "
                f"stopped at once ({self.what_is_saved()})",
                by="SIGTERM",
            )
        if self.requested is not None:
            raise StoppedNow(f"a second {by}: stopped at once ({self.what_is_saved()})", by=by)
        self.requested = by
        if by == "SIGTERM" and self.grace_s is not None:
            # Past the grace period the scheduler's SIGKILL is near: stop in the middle of the step instead.
            self._timer = threading.Timer(self.grace_s, self._expire)
            self._timer.daemon = True
            self._timer.start()
            within = f" within {self.grace_s:g} s (--sigterm-grace-s), else stopping at once"
        else:
            within = ""
        logger.warning(
            "%s: finishing the step under way and saving%s, then stopping (%s again: stop now)",
            by,
            within,
            "Ctrl-C" if by == "Ctrl-C" else "SIGTERM",
        )

    def _expire(self) -> None:
        self._expired = True
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in the main thread, where the step is

    def cancel(self) -> None:
        """Stop the grace period's timer (the loop is over)."""
        if self._timer is not None:
            self._timer.cancel()
