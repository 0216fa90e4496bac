"""On a CUDA host: both GPU backends really hand memory back and bring the contents back identical,
and an NCCL group is torn down and reloaded.

Each case runs `_scripts/gpu_sleep_worker.py` in a fresh process (torch_memory_saver's
preload hook must be in LD_PRELOAD when the process starts) with a 4 GiB training
state, and checks, for every cycle: while asleep the process holds at most 1 GiB
more than before the state existed, and after the wake every byte is back and
views into the flat parameter buffer still alias it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "_scripts"
WORKER = SCRIPTS / "gpu_sleep_worker.py"
MAX_ASLEEP_EXTRA_GIB = 1.0

pytestmark = pytest.mark.gpu


def _run(backend: str, env: dict[str, str], *extra: str, script: Path = WORKER) -> dict:
    args = ["--backend", backend] if backend else []
    out = subprocess.run(
        [sys.executable, str(script), *args, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, f"worker failed:\n{out.stdout}\n{out.stderr}"
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _check(report: dict) -> None:
    assert report["awake_gib"] - report["baseline_gib"] > 3.5, "the state really was on the GPU"
    assert len(report["cycles"]) == 3
    for i, cycle in enumerate(report["cycles"]):
        assert cycle["asleep_extra_gib"] <= MAX_ASLEEP_EXTRA_GIB, f"cycle {i}: {report}"
        assert cycle["identical"], f"cycle {i}: contents changed"
        assert cycle["views_alias"], f"cycle {i}: views lost the flat buffer"


def test_pinned_host_backend_hands_memory_back() -> None:
    _check(_run("pinned_host", dict(os.environ)))


def test_torch_memory_saver_backend_hands_memory_back_with_its_preload_hook() -> None:
    from tandem.lifecycle import torch_memory_saver_env

    env = dict(os.environ, **torch_memory_saver_env())
    _check(_run("torch_memory_saver", env, "--hook-mode", "preload"))


def test_an_nccl_group_is_torn_down_and_reloaded() -> None:
    report = _run("", dict(os.environ), script=SCRIPTS / "nccl_reload_worker.py")
    assert report["values_ok"]
    cycles = report["cycles"]
    for cycle in cycles:
        assert cycle["refused"], "a collective on a torn-down group must fail clearly"
        assert cycle["torn_down_gib"] <= cycle["with_comm_gib"]
    # Tearing down and rebuilding must not pile communicators up.
    assert cycles[-1]["with_comm_gib"] - cycles[0]["with_comm_gib"] <= 1 / 16, report
    # A local one-rank group computes right, stays through destroy_all and holds no communicator.
    assert report["local_ok"] and report["local_alive_after_destroy_all"], report
    assert report["local_gib"] - report["before_gib"] <= 1 / 32, report
