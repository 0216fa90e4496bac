"""tests/megatron/_scripts/launch.py: a launch whose ranks lost their rendezvous port to another process is run
again on new ports; any other failure is not. Its own processes: two tiny scripts a launch, no torch (about 12 s
in all: the launcher waits 2 s after a rank fails, for the others to end)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LAUNCH = Path(__file__).parent / "_scripts" / "launch.py"

SCRIPT = """
import os, sys
from pathlib import Path
marks = Path(sys.argv[1])
attempt = len(list(marks.glob(f"rank{os.environ['RANK']}.*"))) + 1
(marks / f"rank{os.environ['RANK']}.{attempt}.{os.environ['MASTER_PORT']}").touch()
if attempt <= int(sys.argv[2]):
    if os.environ["RANK"] == "0":
        print("DistNetworkError: ... EADDRINUSE, message: address already in use", file=sys.stderr)
    sys.exit(1 if os.environ["RANK"] == "0" else 0)
if sys.argv[3] == "fail":
    print("a real failure", file=sys.stderr)
    sys.exit(2)
"""


def _launch(
    tmp_path: Path, taken: int, then: str = "pass"
) -> tuple[subprocess.CompletedProcess[str], list[Path]]:
    script, marks = tmp_path / "script.py", tmp_path / "marks"
    script.write_text(SCRIPT)
    marks.mkdir()
    proc = subprocess.run(
        [sys.executable, str(LAUNCH), "2", str(script), str(marks), str(taken), then],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, sorted(marks.glob("rank0.*"))


def test_a_port_taken_before_the_rendezvous_is_launched_again_on_a_new_port(tmp_path: Path) -> None:
    proc, rank0 = _launch(tmp_path, taken=1)
    assert proc.returncode == 0, proc.stderr
    assert len(rank0) == 2 and rank0[0].suffix != rank0[1].suffix, "two launches, each on its own port"
    assert "launching again on new ports (2 of 3)" in proc.stderr
    assert "EADDRINUSE" in proc.stderr, "the ranks' own stderr is passed on"


def test_other_failures_and_a_port_lost_every_time_fail(tmp_path: Path) -> None:
    proc, rank0 = _launch(tmp_path, taken=0, then="fail")
    assert proc.returncode == 1 and len(rank0) == 1, "a failure that is not the port's is not launched again"
    assert (
        "a real failure" in proc.stderr and "ranks failed (rank, exit code): [(0, 2), (1, 2)]" in proc.stderr
    )
    (tmp_path / "again").mkdir()
    lost, tries = _launch(tmp_path / "again", taken=5)
    assert lost.returncode == 1 and len(tries) == 3 and lost.stderr.count("launching again") == 2
