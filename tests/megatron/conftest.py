"""Shared fixtures of the Megatron backend's tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

SaveRandomLlama = Callable[..., None]


def save_random_llama(
    path: Path,
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    max_position_embeddings: int,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Save a seeded random Llama (untied embeddings, grouped-query attention) with `save_pretrained`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
    )
    model: Any = LlamaForCausalLM(config)
    model.to(dtype).save_pretrained(path)


@pytest.fixture(scope="session")
def random_llama() -> SaveRandomLlama:
    """`random_llama(path, vocab_size=..., ...)`: a Hugging Face checkpoint to start workers from."""
    return save_random_llama


SCRIPTS = Path(__file__).parent / "_scripts"


@pytest.fixture(scope="session")
def model_checks(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    """What `_scripts/rope_check.py` saved: a tiny Llama built with and without the fused RoPE hooks, and (under
    "swiglu", `_scripts/swiglu_check.py`) with and without the SwiGLU hook, on CUDA where torch sees a GPU.

    Its own process, once a session: Megatron's world (`init_distributed`) and its models are per process, and
    building them in this one would leave the hooks installed for every later test; both checks share it
    (tests/megatron/test_rope.py, tests/megatron/test_swiglu.py)."""
    root = tmp_path_factory.mktemp("model-checks")
    save_random_llama(
        root / "hf",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    out = root / "checks.pt"
    command = [sys.executable, str(SCRIPTS / "launch.py"), "1", str(SCRIPTS / "rope_check.py")]
    proc = subprocess.run([*command, str(root / "hf"), str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result: dict[Any, Any] = torch.load(out, weights_only=False)
    return result
