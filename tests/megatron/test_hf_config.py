"""ModelSpec.from_hf against transformers' configs, and its errors (no Megatron import)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.megatron.models.hf_config import ModelSpec

SMALL: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _config(family: str, **extra: Any) -> Any:
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    return cls[family](**(SMALL | extra))


def _rotary(family: str, config: Any) -> Any:
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen2.modeling_qwen2 as qwen2
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    cls = {
        "llama": llama.LlamaRotaryEmbedding,
        "qwen2": qwen2.Qwen2RotaryEmbedding,
        "qwen3": qwen3.Qwen3RotaryEmbedding,
    }
    return cls[family](config)


@pytest.mark.parametrize(
    ("family", "rope"),
    [
        ("llama", {"rope_type": "default", "rope_theta": 500000.0}),
        (
            "llama",
            {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        ("llama", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
        ("qwen2", {"rope_theta": 1000000.0}),
        ("qwen3", {"rope_theta": 1000000.0}),
    ],
)
def test_rope_frequencies_equal_transformers(family: str, rope: dict[str, Any], tmp_path: Path) -> None:
    config = _config(family, rope_parameters=dict(rope), **({"head_dim": 12} if family == "qwen3" else {}))
    config.save_pretrained(tmp_path)
    spec = ModelSpec.from_hf(tmp_path)
    expected = _rotary(family, config).inv_freq
    assert spec.rope_inv_freq().shape == expected.shape
    assert torch.equal(spec.rope_inv_freq(), expected)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_spec_reads_saved_config(family: str, tmp_path: Path) -> None:
    extra = {"head_dim": 12, "tie_word_embeddings": True} if family == "qwen3" else {}
    config = _config(family, rms_norm_eps=3e-6, **extra)
    config.save_pretrained(tmp_path)
    spec = ModelSpec.from_hf(tmp_path / "config.json")
    assert spec.family == family
    assert (spec.vocab_size, spec.hidden_size, spec.num_layers) == (96, 48, 2)
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.ffn_hidden_size) == (6, 2, 80)
    assert spec.head_dim == (12 if family == "qwen3" else 8)
    assert spec.rms_norm_eps == 3e-6
    assert spec.qkv_bias == (family == "qwen2")
    assert spec.qk_norm == (family == "qwen3")
    assert spec.tie_word_embeddings == config.tie_word_embeddings
    # The dict form gives the same spec as the folder.
    assert ModelSpec.from_hf(json.loads((tmp_path / "config.json").read_text())) == spec


def test_old_style_rope_fields_are_read() -> None:
    cfg = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 12345.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    spec = ModelSpec.from_hf(cfg)
    assert (spec.rope_theta, spec.rope_type, dict(spec.rope_params)) == (12345.0, "linear", {"factor": 2.0})
    assert spec.num_kv_heads == 2 and spec.head_dim == 8


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0}}, "yarn"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_configs_raise_naming_the_field(change: dict[str, Any], field: str) -> None:
    cfg = {"model_type": "llama"} | {k: v for k, v in SMALL.items()} | change
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ValueError, match=field):
        ModelSpec.from_hf(cfg)


def test_missing_folder_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        ModelSpec.from_hf(tmp_path)


def test_parallel_sizes_that_do_not_divide_raise() -> None:
    spec = ModelSpec.from_hf({"model_type": "qwen2"} | SMALL)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        spec.transformer_config(tensor_parallel_size=4)  # 6 heads
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        spec.transformer_config(pipeline_parallel_size=3)  # 2 layers


@pytest.mark.parametrize("jit_fusions", [False, True])
def test_jit_fusions_off_unless_asked_for(jit_fusions: bool, tmp_path: Path) -> None:
    """`WorkerConfig.jit_fusions` False turns Megatron's compiled SwiGLU and residual add off;
    True leaves the spec's own choice (on with CUDA, off on the CPU)."""
    from tandem.megatron.worker._trainee import _jit_fusion_overrides

    _config("llama").save_pretrained(tmp_path)
    spec = ModelSpec.from_hf(tmp_path)
    default = spec.transformer_config()
    config = spec.transformer_config(**_jit_fusion_overrides(jit_fusions))
    for name in ("bias_activation_fusion", "bias_dropout_fusion"):
        assert getattr(config, name) == (getattr(default, name) if jit_fusions else False)
