"""bench/capacity_bench.py: its parameter arithmetic is transformers' own, it names why a run failed,
and its CPU smoke run writes a row for each run (the real runs are on an H200; nothing is timed here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "capacity_bench.py"
sys.path.insert(0, str(ROOT / "bench"))

from capacity_bench import shape_params, why_it_failed  # noqa: E402
from ppo_harness import SHAPES  # noqa: E402


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b"])
def test_the_parameter_count_is_transformers_own(name: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(SHAPES[name])
    tied = bool(shape.pop("tie_word_embeddings", True))
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=tied))
    assert shape_params(SHAPES[name]) == sum(p.numel() for p in model.parameters())


def test_a_failure_is_named() -> None:
    cuda = {"modes": {"shared": {"error": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"}}}
    assert why_it_failed(cuda, "") == "CUDA out of memory"
    ray_oom = "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory."
    assert why_it_failed(None, ray_oom) == "host memory (a process killed)"
    other = {"modes": {"shared": {"error": "Traceback ...\nValueError: something else"}}}
    assert why_it_failed(other, "") == "ValueError: something else"


@pytest.mark.slow
def test_the_quick_run_writes_a_row_for_each_run(tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--modes", "shared", "--out", str(out)]
    cmd += ["--workdir", str(tmp_path / "work"), "--estimate", "qwen2.5-0.5b,qwen2.5-7b"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["runs"]
    assert row["mode"] == "shared" and row["trained"] and row["why_not"] is None, row
    assert row["steps"] == 2 and row["step_s"] > 0
    # a sleeping model's state is on the host: the backend's buffers hold both models
    assert set(row["host_buffer_gib"]) == {"actor", "critic"}
    assert all(v > 0 for v in row["host_buffer_gib"].values()), row
    assert report["not_run"] == ["qwen2.5-0.5b", "qwen2.5-7b"]
    seven = next(e for e in report["estimates"] if e["shape"] == "qwen2.5-7b")
    assert seven["state_gib_per_model"] > 100  # 7.6 B parameters x 18 bytes
    assert "| quick |" in done.stdout and "| qwen2.5-7b |" in done.stdout
