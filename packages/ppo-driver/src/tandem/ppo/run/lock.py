"""The lock of a run folder: one run at a time in RUN_DIR, released on exit, a dead holder's lock taken over.

`RUN_DIR/run.lock` holds the holder's PID, host and start time, and the holder
keeps an exclusive `flock` on it for as long as it runs. The kernel drops a
flock when its process dies, however it dies (kill -9 included), so a lock file
that nobody holds is stale: the next run takes it over and says whose it was. A
second run while the holder lives is refused at once, naming the holder.
Where the file system has no flock (`ENOLCK`, some network mounts) the PID is
checked instead, on the same host.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

__all__ = ["LOCK_FILE", "RunLock"]

# The name its lines show on the terminal, kept from before the layers.
logger = logging.getLogger("tandem.ppo.run_lock")

LOCK_FILE = "run.lock"
"""The lock's file name inside RUN_DIR."""


def _holder_text(info: dict[str, Any]) -> str:
    started = info.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        if isinstance(started, int | float)
        else "?"
    )
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')} (since {when})"


def _read(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 4096):
        raw += chunk
    try:
        info = json.loads(raw.decode() or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return info if isinstance(info, dict) else {}


def _alive_here(info: dict[str, Any]) -> bool:
    """Whether the lock's holder is a running process on this host (the check without flock)."""
    pid, host = info.get("pid"), info.get("host")
    if not isinstance(pid, int):
        return False
    if host != socket.gethostname():
        return True  # another host's process: no way to tell from here, so it may be running
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """An acquired lock of one run folder; `release()` (or the process's death) gives it back."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike[str]) -> RunLock:
        """Lock `run_dir` (which must exist) for this process; ValueError naming `--run-dir` when it is in use."""
        path = Path(run_dir) / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                locked = cls._flock(fd, path)
                # The holder may have released (unlinked) the file between our open and our
                # flock: then we hold a lock on a file nobody else will see; open again.
                if locked and os.fstat(fd).st_ino != _inode(path):
                    os.close(fd)
                    continue
                previous = _read(fd)
                if not locked and previous and _alive_here(previous):
                    cls._refuse(run_dir, previous)
                if previous.get("pid") is not None:
                    logger.warning(
                        "%s: taking over the lock of %s, which is no longer running",
                        path,
                        _holder_text(previous),
                    )
                info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
                os.fsync(fd)
                return cls(path, fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise

    @staticmethod
    def _flock(fd: int, path: Path) -> bool:
        """Take the flock (True); False where the file system has none; refuse when another process holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            RunLock._refuse(path.parent, _read(fd))
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return False
            raise
        raise AssertionError("unreachable")

    @staticmethod
    def _refuse(run_dir: str | os.PathLike[str], holder: dict[str, Any]) -> None:
        raise ValueError(
            f"--run-dir: {run_dir} is in use by another run, {_holder_text(holder)}; wait for it to end "
            "(or stop it), or give this run another --run-dir"
        )

    def release(self) -> None:
        """Remove the lock file and drop the lock; idempotent."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(self._fd).st_ino == _inode(self.path):
                self.path.unlink()
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None
