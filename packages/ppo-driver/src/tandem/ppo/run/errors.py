"""How a command that fails ends: one line naming what failed and the fix, an exit status, no traceback.

Exit statuses of `ppo-driver`:

- 0: done, also for a run found complete already;
- 1: a failure of the machinery (a worker or an engine that died, Ray that does not start, a full disk);
- 2: bad input (a flag, the config file, a data file, a model folder, the reward function);
- 130: Ctrl-C (`run_log.INTERRUPTED_EXIT_CODE`); 143: SIGTERM (`run_log.TERMINATED_EXIT_CODE`);
- 141: stdout closed before the output was written (`ppo-driver demo --help | head`), as for
  any command that a SIGPIPE ends.

`failure_line` maps an exception to its status and line; an exception it does not
know is a bug of ours, and keeps its traceback. `dead_worker` turns Ray's
`ActorDiedError` about a train worker into a `WorkerDied` that names the role, the
rank, the process and its log.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tandem.megatron.group import TrainWorkerHost
from tandem.megatron.runtime.checkpoint_folder import DiskFull
from tandem.ppo.rollout.rewards import RewardError

__all__ = [
    "BROKEN_PIPE_EXIT_CODE",
    "FAILURE_EXIT_CODE",
    "INPUT_ERROR_EXIT_CODE",
    "RayStartError",
    "WorkerDied",
    "dead_worker",
    "failure_line",
    "worker_log",
]

FAILURE_EXIT_CODE = 1
INPUT_ERROR_EXIT_CODE = 2
BROKEN_PIPE_EXIT_CODE = 128 + 13  # 128 + SIGPIPE, what a shell reports for a command a pipe ended


class WorkerDied(RuntimeError):
    """A train worker's process died (killed, out of memory, a crash in native code)."""

    def __init__(self, role: str, rank: int | None, pid: int | None, reason: str, log: Path | None) -> None:
        who = f"{role} rank {rank}" if rank is not None else role
        where = f"; its log: {log}" if log is not None else ""
        super().__init__(f"{who} (pid {pid if pid is not None else '?'}) died: {reason}{where}")
        self.role, self.rank, self.pid, self.log = role, rank, pid, log


class RayStartError(RuntimeError):
    """Ray did not start (a local cluster that timed out starting)."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _notes(exc: BaseException) -> str:
    notes = getattr(exc, "__notes__", None) or []
    return "".join(f" ({_one_line(n)})" for n in notes)


def failure_line(exc: BaseException) -> tuple[int, str] | None:
    """(exit status, one line) for a failure the user can act on; None for one that is a bug (a traceback)."""
    from ray.exceptions import RayActorError, RayTaskError

    from tandem.ppo.engines import EngineError  # torch: the engines' package loads it, `--help` must not

    if isinstance(exc, RayTaskError):
        # An exception raised inside a worker: its own message, without the remote traceback.
        cause = exc.cause if exc.cause is not None else exc
        line = _one_line(str(cause)) if cause is not exc else _one_line(str(exc).splitlines()[-1])
        status = INPUT_ERROR_EXIT_CODE if isinstance(cause, ValueError) else FAILURE_EXIT_CODE
        return status, f"{_worker_name(exc)}: {line}{_notes(exc)}"
    if isinstance(exc, ValueError | RewardError):
        return INPUT_ERROR_EXIT_CODE, _one_line(str(exc)) + _notes(exc)
    if isinstance(exc, WorkerDied | EngineError | RayStartError | DiskFull):
        return FAILURE_EXIT_CODE, _one_line(str(exc)) + _notes(exc)
    if isinstance(exc, RayActorError):
        return FAILURE_EXIT_CODE, f"a Ray worker died: {_death_reason(exc)}{_notes(exc)}"
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        return FAILURE_EXIT_CODE, f"{exc.strerror}: {exc.filename}"
    return None


_TASK_HEADER = re.compile(r"ray::([\w.]+)\(\)\S*\s+\(pid=(\d+)")
"""The header Ray writes over a worker's traceback: "ray::TrainWorkerHost.run() (pid=4242, ip=...)"."""


def _worker_name(exc: Any) -> str:
    name = getattr(exc, "proctitle", "") or ""
    pid = getattr(exc, "pid", None)
    if not name:  # Ray's error of the cause's class (`as_instanceof_cause`) keeps these only in its text
        header = _TASK_HEADER.search(str(exc))
        if header:
            name, pid = header.group(1), int(header.group(2))
    kind = (
        "a rollout engine"
        if "Engine" in name
        else "a train worker"
        if TrainWorkerHost.__name__ in name
        else "a Ray worker"
    )
    return f"{kind} (pid {pid})" if pid else kind


_PID = re.compile(r"^\s*pid: (\d+)\s*$", re.MULTILINE)


def _death_reason(exc: BaseException) -> str:
    """The cause of an actor's death, in one line (Ray's last line of its message)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = _one_line(lines[-1]) if lines else type(exc).__name__
    return reason.split(" Some common causes include:", 1)[0]


def dead_worker(
    exc: BaseException,
    groups: Iterable[Any],
    *,
    run_dir: str | os.PathLike[str],
    pids: dict[tuple[str, int], int] | None = None,
) -> WorkerDied | None:
    """The `WorkerDied` for Ray's error about a dead actor of one of `groups` (train groups); else None.

    `pids`: each (role, rank)'s process id, recorded when the groups started (Ray's
    message carries it too, when the actor died while running a call).
    """
    actor_id = getattr(exc, "actor_id", None)
    if actor_id is None:
        return None
    for group in groups:
        for rank, handle in enumerate(getattr(group, "workers", ())):
            if handle._actor_id.hex() != actor_id:
                continue
            match = _PID.search(str(exc))
            pid = int(match.group(1)) if match else (pids or {}).get((group.role, rank))
            reason = _death_reason(exc)
            return WorkerDied(group.role, rank, pid, reason, worker_log(run_dir, group.role, rank, pid))
    return None


def worker_log(run_dir: str | os.PathLike[str], role: str, rank: int, pid: int | None) -> Path | None:
    """Where the worker `role` `rank` (process `pid`) wrote its output, if we can find it.

    The run's own log of that worker (`RUN_DIR/logs/<role>-<rank>.log`) when there is one,
    else Ray's log of that process in the session folder on this machine.
    """
    own = Path(run_dir) / "logs" / f"{role}-{rank}.log"
    if own.is_file():
        return own
    if pid is None:
        return None
    try:
        import ray

        node: Any = ray._private.worker._global_node
        logs = Path(node.get_logs_dir_path())
    except Exception:  # Ray gone, or a driver without a local node: no file to point at
        return None
    for suffix in (".err", ".out"):
        found = sorted(logs.glob(f"worker-*-{pid}{suffix}"))
        if found:
            return found[-1]
    return None
