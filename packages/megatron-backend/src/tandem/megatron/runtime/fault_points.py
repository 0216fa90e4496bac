"""Named points where a test kills the process (SIGKILL), to check what a crash at that point leaves behind.

A save, a generation or a worker's step calls `fault_point("checkpoint.written")`;
nothing happens unless the environment names that point:

    TANDEM_FAULT_POINT="checkpoint.written:role=critic,rollout_id=2"

names the point and, optionally, what its context must hold (the keyword
arguments of the call, and the process's own context from `set_context`, such
as the worker's role). The matching call kills its own process with SIGKILL, as
`kill -9` or the OOM killer would: no `finally`, no `atexit`, no flush. With
`TANDEM_FAULT_ONCE=/path/file` it fires only where it can create that file, so
once across every process of a run (a restarted engine does not die again).

With `TANDEM_FAULT_ACTION=enospc` the point raises the OSError of a full disk
(ENOSPC) instead, as a write there would on a full filesystem.

Ray's workers inherit the environment of the driver that starts a local cluster,
so a point set for `ppo-driver train` reaches the train workers and the engines.
Unset (always, outside tests) a point costs one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal
from typing import Any

__all__ = ["FAULT_ACTION_ENV", "FAULT_ENV", "FAULT_ONCE_ENV", "fault_point", "set_context"]

FAULT_ENV = "TANDEM_FAULT_POINT"
"""The environment variable naming the point (and context) to kill the process at."""

FAULT_ONCE_ENV = "TANDEM_FAULT_ONCE"
"""A file path: the point fires only in the process that creates this file first."""

FAULT_ACTION_ENV = "TANDEM_FAULT_ACTION"
"""What the point does: `kill` (SIGKILL, the default) or `enospc` (raise a full disk's OSError)."""

_context: dict[str, str] = {}


def set_context(**values: Any) -> None:
    """Context that every point of this process carries (e.g. the worker's `role`, `rank`)."""
    _context.update({k: str(v) for k, v in values.items()})


def _matches(spec: str, name: str, context: dict[str, str]) -> bool:
    point, _, conditions = spec.partition(":")
    if point.strip() != name:
        return False
    for condition in filter(None, (c.strip() for c in conditions.split(","))):
        key, _, value = condition.partition("=")
        if context.get(key.strip()) != value.strip():
            return False
    return True


def fault_point(name: str, **context: Any) -> None:
    """Kill this process with SIGKILL if `TANDEM_FAULT_POINT` names this point and its context (or raise
    ENOSPC's OSError, with `TANDEM_FAULT_ACTION=enospc`)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    merged = {**_context, **{k: str(v) for k, v in context.items()}}
    if not _matches(spec, name, merged):
        return
    once = os.environ.get(FAULT_ONCE_ENV)
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    if os.environ.get(FAULT_ACTION_ENV) == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"(fault point {name})")
    os.kill(os.getpid(), signal.SIGKILL)
