"""A pytest plugin that ends the process with the suite's own exit status, past the interpreter's teardown.

A suite that passed can still end the process with a signal: after pytest's last line, the interpreter
tears down its modules, and native libraries' destructors (torch's, Ray's, gloo's threads) can crash in
whatever order that teardown meets them. CI once read exit status 139 (SIGSEGV) from a run whose 2,297
tests had all passed. So, once pytest has reported and unconfigured, the process runs its `atexit`
handlers (pytest's lock files of the temp folders, Ray's shutdown, flushed logs), flushes the standard
streams, and leaves with `os._exit(status)`: the status says what the tests did, never how the teardown
went.

The conftest of tests/ re-exports the two hooks; tests/test_clean_exit.py loads this module as a plugin
(`-p _clean_exit`) into a pytest of its own.
"""

from __future__ import annotations

import atexit
import os
import sys

import pytest

EXIT_STATUS = pytest.StashKey[int]()
"""The session's exit status, kept from `pytest_sessionfinish` for the exit at `pytest_unconfigure`."""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """After every other plugin's unconfigure (the terminal's last line included): exit with the status."""
    status = config.stash.get(EXIT_STATUS, None)
    if status is None:  # no session ran (a usage error, `--help`): pytest's own exit is left alone
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
