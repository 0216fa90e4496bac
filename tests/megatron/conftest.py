"""Shared fixtures of the Megatron backend's tests."""

from __future__ import annotations

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
