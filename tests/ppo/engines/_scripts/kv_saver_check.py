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

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[4]


def _engines() -> Any:
    spec = importlib.util.spec_from_file_location("engine_bench", REPO / "bench" / "engine_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("engine_bench", module)
    spec.loader.exec_module(module)
    return module.import_engines()


def _model(folder: Path) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=1,
    )
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _graphs(engine: Any) -> dict[Any, Any]:
    """The engine's captured graphs by key (held here, so that no new one can take an old one's place)."""
    return {key: entry[0] for key, entry in engine._graphs.items()}


def _same(now: dict[Any, Any], then: dict[Any, Any]) -> bool:
    return now.keys() == then.keys() and all(now[k] is then[k] for k in now)


def main() -> None:
    engines = _engines()
    folder = _model(Path(sys.argv[1]) / "medium")
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
