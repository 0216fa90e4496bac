"""Reloadable process groups under gloo with 2 processes: collectives before sleep, after wake, many cycles."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "_scripts" / "process_group_worker.py"
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_groups_work_before_sleep_after_wake_and_after_many_cycles() -> None:
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"
        assert f"OK {rank}" in out
