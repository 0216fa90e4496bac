"""`train(config)`: one start of a run, as the command runs it: the driver set up and run, its errors named.

The driver (`driver.PPODriver`) is the run; this is what wraps it for a command: SIGTERM before
the loop stops the start at once (the loop itself finishes its step on one), a train worker's
death is named (role, rank, pid, log), refused input found by the driver is marked for exit 2, and
the workers and the run folder's empty logs are cleaned up whatever happened.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from ray.exceptions import RayActorError

from tandem.ppo.config.ppo_config import PPOConfig
from tandem.ppo.loop.driver import PPODriver
from tandem.ppo.run.errors import dead_worker
from tandem.ppo.run.log import RunSummary, StoppedNow
from tandem.ppo.run.worker_logs import from_a_worker, note_worker_logs, remove_empty_logs

__all__ = ["train"]


def train(config: PPOConfig) -> RunSummary:
    """Run PPO with `config` (validated first); the summary. Raises `Interrupted` on Ctrl-C, and
    `errors.WorkerDied` naming the worker when a train worker's process dies. The driver's log
    lines also go to `RUN_DIR/logs/driver.log` once the run folder is locked and its inputs checked."""
    driver = PPODriver(config)
    # SIGTERM before the loop (which finishes its step on one): stop at once, nothing trained yet.
    previous = _on_sigterm(_stop_during_start_up)
    try:
        driver.setup()
        if driver.complete:
            return driver.complete_summary()
        return driver.run()
    except KeyboardInterrupt:
        driver.stopping_now = True  # the workers are not asked to finish what they are doing
        raise
    except RayActorError as exc:
        # A train worker's process died: name its role, rank, pid and log (the last complete
        # checkpoint stays, and the next start resumes from it).
        models = driver.gpus.models() if hasattr(driver, "gpus") else []  # none before they start
        died = dead_worker(exc, models, run_dir=config.run_dir)
        if died is None:
            note_worker_logs(exc, config.run_dir)
            raise
        raise died from exc
    except Exception as exc:
        # Refused input (exit 2) found by the driver itself, not a worker's failure with a log to read.
        driver.refused = isinstance(exc, ValueError) and not from_a_worker(exc)
        note_worker_logs(exc, config.run_dir)  # an error from a worker names its log file
        raise
    finally:
        driver.close()
        _on_sigterm(previous)
        if driver.started_logs:
            remove_empty_logs(config.run_dir)


def _stop_during_start_up(signum: int, frame: Any) -> None:
    raise StoppedNow("during start-up: nothing trained by this start, the run folder as it was", by="SIGTERM")


def _on_sigterm(handler: Any) -> Any:
    """Install `handler` for SIGTERM (in the main thread only, where Python runs handlers); the one before."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)
