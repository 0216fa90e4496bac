"""Each worker's output in a file the user is told about: `RUN_DIR/logs/<role>-<rank>.log`, and the driver's.

The driver starts Ray with `log_to_driver=False` (worker lines would break up the
terminal), so without this a worker's prints, warnings and tracebacks end up only
in Ray's session folder. `ray_runtime_env(run_dir)` gives Ray a worker setup hook
(`redirect_output`, run in every worker process as it starts) that points the
process's stdout and stderr at `RUN_DIR/logs/worker-<pid>.log`; once the train
groups and engines are up, `name_worker_logs` renames each of their files after
its role and rank (`actor-0.log`, `critic-0.log`, `engine-0.log`; the open files
keep being written). `driver.log` gets the driver's own `tandem` log lines. The
run's summary names the folder, and an error raised from a worker gets a note
naming its file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tandem.ppo.run.terminal import DATE_FORMAT, LOG_FORMAT, LOGGER_NAME

__all__ = [
    "LOGS_DIR",
    "LOG_DIR_ENV",
    "driver_log",
    "from_a_worker",
    "logs_dir",
    "name_worker_logs",
    "note_worker_logs",
    "ray_runtime_env",
    "redirect_output",
    "remove_empty_logs",
]

LOGS_DIR = "logs"
"""The folder of a run that holds the logs."""

LOG_DIR_ENV = "TANDEM_WORKER_LOG_DIR"
"""Where `redirect_output` writes, set in the Ray job's environment."""


def logs_dir(run_dir: str | os.PathLike[str]) -> Path:
    """`RUN_DIR/logs`, absolute (the workers' working directory is not the driver's)."""
    return Path(os.path.abspath(Path(run_dir) / LOGS_DIR))


def ray_runtime_env(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The Ray job's runtime env that sends every worker's output to `RUN_DIR/logs/` (made by the
    first worker that starts: a start that fails before any does leaves no folder)."""
    folder = logs_dir(run_dir)
    return {
        "env_vars": {LOG_DIR_ENV: str(folder)},
        "worker_process_setup_hook": f"{__name__}.redirect_output",
    }


def redirect_output() -> None:
    """Point this process's stdout and stderr at `$TANDEM_WORKER_LOG_DIR/worker-<pid>.log` (a worker hook)."""
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(folder) / f"worker-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _pid_of(handle: Any) -> int:
    import ray

    pid: int = ray.get(handle.__ray_call__.remote(lambda _self: os.getpid()))
    return pid


def name_worker_logs(run_dir: str | os.PathLike[str], workers: Sequence[tuple[str, Any]]) -> dict[str, Path]:
    """Rename each `(name, actor handle)`'s `worker-<pid>.log` to `<name>.log`; the files by name.

    A worker whose file is not here (another node without a shared folder) is skipped.
    """
    folder = logs_dir(run_dir)
    named: dict[str, Path] = {}
    for name, handle in workers:
        try:
            pid = _pid_of(handle)
        except Exception:  # a worker that died already: its error says so
            continue
        source, target = folder / f"worker-{pid}.log", folder / f"{name}.log"
        if source.is_file():
            os.replace(source, target)
            named[name] = target
    return named


def group_workers(role: str, group: Any) -> list[tuple[str, Any]]:
    """`(role-rank, handle)` of a train group (`.workers`) or an engine group (`.handles`)."""
    handles = getattr(group, "workers", None) or getattr(group, "handles", None) or []
    return [(f"{role}-{rank}", handle) for rank, handle in enumerate(handles)]


@contextlib.contextmanager
def driver_log(run_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """The `tandem` logger's lines also into `RUN_DIR/logs/driver.log` while the block runs."""

    path = logs_dir(run_dir) / "driver.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    handler.setLevel(logging.INFO)
    tandem = logging.getLogger(LOGGER_NAME)
    tandem.addHandler(handler)
    if tandem.getEffectiveLevel() > logging.INFO:
        tandem.setLevel(logging.INFO)
    try:
        yield path
    finally:
        tandem.removeHandler(handler)
        handler.close()


_RAY_MARKER = re.compile(r"^:(job_id|actor_name|task_name):")
"""The lines Ray writes into every worker's output when a job, actor or task starts there."""


def remove_empty_logs(run_dir: str | os.PathLike[str]) -> None:
    """Drop the logs that hold nothing but Ray's markers (helper processes that printed nothing)."""
    for path in logs_dir(run_dir).glob("*.log"):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            lines = path.read_text(encoding="utf-8").splitlines()
            if all(not line.strip() or _RAY_MARKER.match(line) for line in lines):
                path.unlink()


_RANKED = re.compile(r"\b(?:rollout )?engine rank (\d+)|\b(actor|critic) rank (\d+)")


def note_worker_logs(exc: BaseException, run_dir: str | os.PathLike[str]) -> None:
    """Add a note naming the worker's log file to an error that comes from a worker (else nothing)."""
    folder = logs_dir(run_dir)
    if not folder.is_dir() or not from_a_worker(exc):
        return
    match = _RANKED.search(str(exc))
    named = None
    if match:
        name = (
            f"engine-{match.group(1)}" if match.group(1) is not None else f"{match.group(2)}-{match.group(3)}"
        )
        named = folder / f"{name}.log"
    if named is not None and named.is_file():
        exc.add_note(f"worker log: {named}")
    else:
        exc.add_note(f"worker logs: {folder}")


def from_a_worker(exc: BaseException) -> bool:
    """Whether `exc` came from a Ray worker or an engine (it then has a log of its own)."""
    try:
        from ray.exceptions import RayError
    except ImportError:  # pragma: no cover - Ray is a dependency
        return False
    from tandem.ppo.engines import EngineError  # torch: not in every Ray worker's start-up hook

    return isinstance(exc, RayError | EngineError)
