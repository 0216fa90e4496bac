"""The suite's exit status survives a crash in the interpreter's teardown (tests/_clean_exit.py).

Each case runs a pytest of its own in a subprocess (the plugin ends its process, so it cannot run in
this one) on a probe file whose module holds an object that segfaults when the interpreter tears the
module down, as a native library's destructor can. About a second a case: no torch, no Ray.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

PROBE = """
import atexit
import faulthandler
from pathlib import Path


class CrashesInTeardown:
    # Kept by the module: deleted only when the interpreter clears the module's namespace at exit.
    sigsegv = staticmethod(faulthandler._sigsegv)

    def __del__(self):
        self.sigsegv()


CRASH = CrashesInTeardown()
atexit.register(lambda: Path("atexit-ran").write_text("yes"))


def test_passes():
    assert True


def test_{outcome}():
    assert {outcome!r} == "passes_too"
"""


def _pytest(folder: Path, outcome: str, *, plugin: bool) -> subprocess.CompletedProcess[str]:
    (folder / "test_probe.py").write_text(PROBE.format(outcome=outcome))
    (folder / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PYTHONFAULTHANDLER": ""}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:faulthandler"]
    command += ["-p", "_clean_exit"] if plugin else []
    command += ["--rootdir", str(folder), "-c", str(folder / "pytest.ini"), "test_probe.py"]
    return subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_probe_crashes_in_teardown_without_the_plugin(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "passes_too", plugin=False)
    assert "2 passed" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr)


@pytest.mark.parametrize(("outcome", "status"), [("passes_too", 0), ("fails", 1)])
def test_the_exit_status_is_the_suites(tmp_path: Path, outcome: str, status: int) -> None:
    proc = _pytest(tmp_path, outcome, plugin=True)
    assert proc.returncode == status, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    # pytest's report came out whole, and the process's atexit handlers ran before it left.
    last = proc.stdout.strip().splitlines()[-1]
    assert ("1 failed, 1 passed" if status else "2 passed") in last, proc.stdout
    assert (tmp_path / "atexit-ran").read_text() == "yes"
