"""The embedded engine's KV cache in a torch_memory_saver region, on a GPU; run by test_kv_saver.py.

Usage: kv_saver_check.py WORK_DIR, in a process started with `torch_memory_saver_env()`.
A ~0.2 B Qwen2-shaped random model generates 256 responses (its fused decode captures a
CUDA graph per batch bucket); the KV cache alone is released and resumed; the same
generation runs again. Prints `RESULT {json}`: the KV cache's size, the device memory the
release handed back and the resume took again, whether the graphs after are the same
objects (none captured again), whether the tokens are the same; and, for the contrast, an
engine on torch's allocator through the same release (its graphs are captured again).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

# The engine tests' helpers (tests/ppo/engines/conftest.py), imported as a plain module in this process.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import gpu_engines, medium_model


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _graphs(engine: Any) -> dict[Any, Any]:
    """The engine's captured graphs by key (held here, so that no new one can take an old one's place)."""
    return {key: entry[0] for key, entry in engine._graphs.items()}


def _same(now: dict[Any, Any], then: dict[Any, Any]) -> bool:
    return now.keys() == then.keys() and all(now[k] is then[k] for k in now)


def main() -> None:
    engines = gpu_engines()
    folder = medium_model(Path(sys.argv[1]))
    generator = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(2, 32000, (int(n),), generator=generator).tolist()
        for n in torch.randint(80, 128, (256,))
    ]
    params = engines.SamplingParams(max_new_tokens=384, temperature=1.0, seed=5, ignore_eos=True)

    engine = engines.EmbeddedEngine(folder, engines.EngineOptions(kv_cache_backend="torch_memory_saver"))
    first = engine.generate(prompts, params)
    graphs = _graphs(engine)
    kv_bytes = engine._cache.nbytes()
    before = _free()
    engine.release_memory(["kv_cache"])
    released = _free()
    engine.resume_memory(["kv_cache"])
    resumed = _free()
    again = engine.generate(prompts, params)
    same_graphs = _same(_graphs(engine), graphs)
    engine.shutdown()
    del engine

    plain = engines.EmbeddedEngine(folder)
    plain.generate(prompts, params)
    plain_graphs = _graphs(plain)
    plain.release_memory(["kv_cache"])
    plain.resume_memory(["kv_cache"])
    plain.generate(prompts, params)
    report = {
        "kv_cache_gib": kv_bytes / 2**30,
        "freed_at_release_gib": (released - before) / 2**30,
        "taken_at_resume_gib": (released - resumed) / 2**30,
        "graphs": len(graphs),
        "same_graphs": same_graphs,
        "same_tokens": [g.token_ids for g in again] == [g.token_ids for g in first],
        "torch_same_graphs": _same(_graphs(plain), plain_graphs),
    }
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
