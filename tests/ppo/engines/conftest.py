"""Tiny random causal LMs saved as Hugging Face folders, for the engine tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

VOCAB = 48
EOS = 1


def make_tiny_model(kind: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """A 2-layer random model with grouped-query attention (4 heads, 2 KV heads), vocab 48, EOS 1.

    `overrides` replace config fields (e.g. `attention_bias=True`, `num_attention_heads=14`).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "eos_token_id": EOS,
        "bos_token_id": 0,
    }
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**{**common, **overrides}))
    # Random init gives near-uniform logits; sharper ones make greedy and stop tokens meaningful.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def save_model(model: Any, path: Path) -> str:
    model.save_pretrained(str(path))
    return str(path)


def gpu_engines() -> Any:
    """`tandem.ppo.engines`, also on the GPU host, which may lack the driver's CLI packages (then the engines
    subpackage alone, as bench/engine_bench.py imports it)."""
    import importlib.util
    import sys

    bench = Path(__file__).resolve().parents[3] / "bench" / "engine_bench.py"
    spec = importlib.util.spec_from_file_location("engine_bench", bench)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("engine_bench", module)
    spec.loader.exec_module(module)
    return module.import_engines()


def medium_model(folder: Path) -> str:
    """A ~0.2 B Qwen2-shaped random model (big enough that its memory shows), bf16, saved under `folder`/medium."""
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
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    return save_model(model, Path(folder) / "medium")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """(HF folder, the same model in memory) of a tiny random Llama or Qwen2."""
    model = make_tiny_model(request.param)
    return save_model(model, tmp_path_factory.mktemp(f"tiny-{request.param}")), model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """HF folder of the tiny random Llama."""
    return save_model(make_tiny_model("llama"), tmp_path_factory.mktemp("tiny-llama"))


def random_prompts(n: int, *, seed: int = 0, min_len: int = 2, max_len: int = 10) -> list[list[int]]:
    """`n` prompts of random lengths, tokens in [2, VOCAB) (never EOS)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(2, VOCAB, (k,), generator=g).tolist() for k in lengths]


def reference_log_probs(
    model: Any, prompt: list[int], response: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / T) of a plain forward pass over prompt + response, at each response token."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logps = torch.log_softmax(logits / temperature, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
    return logps[positions, torch.tensor(response)]
