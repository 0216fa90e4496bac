"""Small random sequence-classification folders (Llama, Qwen2), the reward models of these tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

VOCAB = 48
EOS = 1
"""EOS is also the pad id of these models (pad = eos, as many checkpoints ship)."""


def save_reward_model(
    path: Path,
    family: str = "llama",
    *,
    vocab_size: int = VOCAB,
    num_labels: int = 1,
    pad_token_id: int | None = EOS,
    eos_token_id: int = EOS,
    seed: int = 0,
    max_position_embeddings: int = 64,
    dtype: torch.dtype = torch.float32,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    device: str = "cpu",
) -> Any:
    """A random `<Family>ForSequenceClassification` saved with `save_pretrained`; the model (fp32, eval).

    Every weight is perturbed (norms away from 1, biases away from 0, a score head of
    scale ~1) so that a dropped bias, a wrong position or a swapped norm shows in the scores.
    `device`: where the model is initialised (a large one is quicker on a GPU); the model is
    returned only from the CPU.
    """
    from transformers import (
        LlamaConfig,
        LlamaForSequenceClassification,
        Qwen2Config,
        Qwen2ForSequenceClassification,
    )

    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": max_position_embeddings,
        "num_labels": num_labels,
        "pad_token_id": pad_token_id,
        "eos_token_id": eos_token_id,
        "bos_token_id": 0,
    }
    with torch.device(device):
        if family == "qwen2":
            config: Any = Qwen2Config(**common, rope_parameters={"rope_theta": 1e6})
            model: Any = Qwen2ForSequenceClassification(config)
        else:
            model = LlamaForSequenceClassification(LlamaConfig(**common))
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if name.startswith("score") else 0.05
            p.add_(torch.randn(p.shape, generator=gen, device=device) * scale)
    model.to(dtype).save_pretrained(str(path))
    return model.float().eval() if device == "cpu" else None


@pytest.fixture(scope="session")
def reward_model_folder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`reward_model_folder(family, **kwargs)`: (folder, model) of a saved random reward model, cached."""
    cache: dict[tuple[Any, ...], tuple[Path, Any]] = {}

    def make(family: str = "llama", **kwargs: Any) -> tuple[Path, Any]:
        key = (family, *sorted(kwargs.items()))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"rm-{family}")
            cache[key] = (path, save_reward_model(path, family, **kwargs))
        return cache[key]

    return make
