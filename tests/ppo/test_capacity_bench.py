"""bench/capacity_bench.py: its parameter arithmetic is transformers' own, it names why a run failed,
and each run gets its row (over a stand-in for the PPO bench; the real runs are on an H200).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
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


STAND_IN = """
import argparse, json, sys
p = argparse.ArgumentParser()
p.add_argument("--out"); p.add_argument("--workdir"); p.add_argument("--shape"); p.add_argument("--steps", type=int)
p.add_argument("--time-budget-s"); p.add_argument("--quick", action="store_true")
p.add_argument("--skip-probe", action="store_true"); p.add_argument("--skip-shared", action="store_true")
p.add_argument("--skip-resident", action="store_true")
a = p.parse_args()
mode = "resident" if a.skip_shared else "shared"
steps = [{"step": i, "time/step": 2.0 + i} for i in range(a.steps)]
result = {"steps": steps, "error": None, "step_s_mean": 3.0, "gpu_peak_gib": {"overall": 40.0},
          "host_used_peak_gib": 20.0, "host_buffer_gib": {"actor": 6.0, "critic": 6.5}}
if mode == "resident":  # out of GPU memory in its first step, as the bench records it
    result = {"steps": [], "error": "Traceback ...\\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate"}
json.dump({"model": {"params": 1543714304}, "modes": {mode: result}}, open(a.out, "w"))
sys.exit(1 if result["error"] else 0)
"""


def test_each_run_gets_its_row_and_a_failure_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The capacity bench's own logic, over a stand-in for ppo_gpu_bench.py that writes the bench's
    JSON fields (tests/ppo/test_ppo_gpu_bench.py checks the real bench writes them)."""
    import capacity_bench

    stand_in = tmp_path / "bench.py"
    stand_in.write_text(STAND_IN)
    monkeypatch.setattr(capacity_bench, "BENCH", stand_in)
    out = tmp_path / "capacity.json"
    argv = ["--shapes", "qwen2.5-1.5b", "--modes", "shared,resident", "--out", str(out)]
    argv += ["--workdir", str(tmp_path / "work"), "--estimate", "qwen2.5-1.5b,qwen2.5-7b"]
    assert capacity_bench.main(argv) == 0
    report = json.loads(out.read_text())
    shared, resident = report["runs"]
    assert (shared["mode"], shared["trained"], shared["why_not"]) == ("shared", True, None)
    assert shared["step_s"] == 3.0 and shared["gpu_peak_gib"] == 40.0 and shared["params"] == 1543714304
    assert shared["host_buffer_gib"] == {"actor": 6.0, "critic": 6.5}
    assert (resident["mode"], resident["trained"]) == ("resident", False)
    assert resident["why_not"] == "CUDA out of memory" and resident["step_s"] is None
    assert report["not_run"] == ["qwen2.5-7b"]
    seven = next(e for e in report["estimates"] if e["shape"] == "qwen2.5-7b")
    assert seven["state_gib_per_model"] > 100  # 7.6 B parameters x 18 bytes
    table = capsys.readouterr().out
    assert "| qwen2.5-1.5b | 1.54 B |" in table and "| 12.5 |" in table and "CUDA out of memory |" in table
    assert "| qwen2.5-7b |" in table and "arithmetic only |" in table
