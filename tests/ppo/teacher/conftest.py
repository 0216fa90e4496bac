"""Small random causal LMs (Llama with its own head, Qwen2 with tied embeddings), the teachers of these tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

VOCAB = 48


def save_causal_lm(
    path: Path,
    family: str = "llama",
    *,
    vocab_size: int = VOCAB,
    seed: int = 0,
    max_position_embeddings: int = 64,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    tie_word_embeddings: bool = False,
) -> Any:
    """A random `<Family>ForCausalLM` saved with `save_pretrained`; the model (fp32, eval).

    Every weight is perturbed (norms away from 1, biases away from 0) so that a dropped bias or
    a swapped norm shows in the log-probs.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if family == "qwen2":
        model: Any = Qwen2ForCausalLM(Qwen2Config(**common, rope_parameters={"rope_theta": 1e6}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(str(path))
    return model.float().eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """These tiny models on one torch thread: on a busy two-core machine more threads only wait for each other
    (a forward of seven samples took 3 s on the default threads and 4 ms on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def causal_lm_folder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`causal_lm_folder(family, **kwargs)`: (folder, model) of a saved random causal LM, cached."""
    cache: dict[tuple[Any, ...], tuple[Path, Any]] = {}

    def make(family: str = "llama", **kwargs: Any) -> tuple[Path, Any]:
        key = (family, *sorted(kwargs.items()))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"lm-{family}")
            cache[key] = (path, save_causal_lm(path, family, **kwargs))
        return cache[key]

    return make
