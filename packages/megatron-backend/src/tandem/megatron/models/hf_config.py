"""The model shape read from a Hugging Face `config.json`, and the Megatron config built from it.

`ModelSpec.from_hf` accepts Llama-family, Mistral (without a sliding window
shorter than the context), Qwen2 and Qwen3 dense decoder configs and rejects, with a `ValueError` naming the field, anything our
Megatron models would not reproduce exactly (sliding windows, biases where
Megatron has none, other activations, unsupported RoPE scaling).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from tandem.megatron.models._cpu_compat import cpu_compat_active

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

Family = Literal["llama", "qwen2", "qwen3", "mistral"]

_FAMILIES: dict[str, Family] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelSpec:
    """Shape and per-family details of a dense decoder, as its Hugging Face config states them.

    Attributes:
        family: "llama", "qwen2", "qwen3" or "mistral" (from `model_type`; Mistral's weights are named
            as Llama's).
        vocab_size: rows of the embedding and of the output head in the HF checkpoint (Megatron's
            are padded: `padded_vocab_size`).
        hidden_size: model width.
        num_layers: number of decoder layers.
        num_attention_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention when fewer than query heads).
        head_dim: width of one head (Qwen3 states it; others use hidden_size / heads).
        ffn_hidden_size: width of the gated MLP (`intermediate_size`).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_type: "default", "linear" or "llama3".
        rope_params: the extra RoPE scaling parameters of `rope_type`.
        tie_word_embeddings: whether the output head is the embedding matrix.
        qkv_bias: whether q/k/v projections have biases (Qwen2; Llama with `attention_bias`).
        qk_norm: whether queries and keys get a per-head RMSNorm (Qwen3).
        max_position_embeddings: longest sequence the checkpoint was built for.
        initializer_range: std of the normal init (used for weights not in a checkpoint).
    """

    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_params: Mapping[str, float] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | Mapping[str, Any]) -> ModelSpec:
        """Read a Hugging Face config: a folder holding `config.json`, the file itself, or its dict."""
        if isinstance(path_or_dict, Mapping):
            cfg = dict(path_or_dict)
        else:
            path = Path(path_or_dict)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ValueError(f"ModelSpec.from_hf: no config.json at {path}; pass a HF model folder")
            cfg = json.loads(path.read_text())
        return _spec_from_dict(cfg)

    def padded_vocab_size(self, tensor_parallel_size: int = 1, multiple: int = 128) -> int:
        """Rows of Megatron's embedding and output head: `vocab_size` rounded up to `multiple * TP`.

        As Megatron's `make_vocab_size_divisible_by`: every tensor-parallel rank holds an
        equal slice whatever the tokenizer's size, and the GEMMs get friendly shapes. The
        extra rows are zeros; their logits never reach a softmax (`forward`), and they are
        cut off again on export.
        """
        if multiple < 1 or tensor_parallel_size < 1:
            raise ValueError(
                f"padded_vocab_size: multiple {multiple} and TP {tensor_parallel_size} must be >= 1"
            )
        step = multiple * tensor_parallel_size
        return -(-self.vocab_size // step) * step

    def rope_inv_freq(self) -> torch.Tensor:
        """Inverse RoPE frequencies, shape `(head_dim / 2,)`, float32, computed as transformers does."""
        dim = self.head_dim
        inv_freq = 1.0 / (
            self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
        )
        if self.rope_type == "linear":
            return inv_freq / float(self.rope_params["factor"])
        if self.rope_type == "llama3":
            return _llama3_inv_freq(inv_freq, self.rope_params)
        return inv_freq

    def transformer_config(
        self,
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        params_dtype: torch.dtype = torch.float32,
        **overrides: Any,
    ) -> TransformerConfig:
        """Megatron's `TransformerConfig` for this model; `overrides` set any other field.

        Fused kernels are off on CPU (the CPU compatibility layer's half of the job)
        and limited to the ones that need neither Apex nor Transformer Engine on GPU.
        """
        for name, count in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_kv_heads", self.num_kv_heads),
        ):
            if count % tensor_parallel_size:
                raise ValueError(
                    f"{name} {count} is not divisible by tensor_parallel_size {tensor_parallel_size}; "
                    "pick a tensor-parallel size that divides the number of heads"
                )
        if self.num_layers % pipeline_parallel_size:
            raise ValueError(
                f"num_layers {self.num_layers} is not divisible by pipeline_parallel_size "
                f"{pipeline_parallel_size}; pick a pipeline-parallel size that divides it"
            )
        from megatron.core.transformer import TransformerConfig

        on_gpu = not cpu_compat_active()
        kwargs: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_kv_heads,
            kv_channels=self.head_dim,
            ffn_hidden_size=self.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=self.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            init_method_std=self.initializer_range,
            attention_softmax_in_fp32=True,
            tensor_model_parallel_size=tensor_parallel_size,
            pipeline_model_parallel_size=pipeline_parallel_size,
            sequence_parallel=False,
            # Micro-batches are padded each to its own longest sample, so pipeline
            # stages exchange tensor shapes before each activation.
            variable_seq_lengths=True,
            # Dense models have no MoE; Megatron still validates this against variable_seq_lengths.
            moe_token_dispatcher_type="alltoall",
            params_dtype=params_dtype,
            pipeline_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            use_cpu_initialization=not on_gpu,
            # Fusions: only the jit ones that need neither Apex nor Transformer Engine, and only on GPU.
            bias_activation_fusion=on_gpu,
            bias_dropout_fusion=on_gpu,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
        )
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: Mapping[str, float]) -> torch.Tensor:
    """Llama 3.1 frequency scaling, the formula of transformers' `_compute_llama3_parameters`."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _require(cfg: Mapping[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"ModelSpec.from_hf: config.json lacks `{key}`; it is required for this family")
    return cfg[key]


def _rope(cfg: Mapping[str, Any]) -> tuple[float, str, dict[str, float]]:
    # transformers 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"ModelSpec.from_hf: rope type {rope_type!r} is not supported (supported: {_ROPE_TYPES}); "
            "use a checkpoint with one of those"
        )
    if float(params.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("ModelSpec.from_hf: `partial_rotary_factor` != 1 is not supported")
    needed: tuple[str, ...] = ()
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    elif rope_type == "linear":
        needed = ("factor",)
    missing = [k for k in needed if k not in params]
    if missing:
        raise ValueError(f"ModelSpec.from_hf: rope type {rope_type!r} needs {missing} in `rope_parameters`")
    return theta, rope_type, {k: float(params[k]) for k in needed}


def _spec_from_dict(cfg: Mapping[str, Any]) -> ModelSpec:
    model_type = cfg.get("model_type")
    family = _FAMILIES.get(str(model_type))
    if family is None:
        raise ValueError(
            f"ModelSpec.from_hf: model_type {model_type!r} is not supported; "
            f"supported: {sorted(_FAMILIES)} (dense decoders)"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"ModelSpec.from_hf: hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
    layer_types = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise ValueError(
            "ModelSpec.from_hf: sliding-window attention is not supported; set use_sliding_window=false"
        )
    window = cfg.get("sliding_window") if family == "mistral" else None
    if window is not None and int(window) < int(cfg.get("max_position_embeddings", 4096)):
        # Mistral applies its window whenever it is set; one as long as the context never bites.
        raise ValueError(
            f"ModelSpec.from_hf: sliding_window={window} is shorter than max_position_embeddings; "
            "sliding-window attention is not supported (use a checkpoint with sliding_window null)"
        )
    if cfg.get("mlp_bias"):
        raise ValueError("ModelSpec.from_hf: `mlp_bias` is not supported (Megatron's MLP here has no biases)")
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if family == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias.
    else:
        qkv_bias = bool(cfg.get("attention_bias", False))
        if qkv_bias:
            # HF puts a bias on o_proj too, which Megatron's add_qkv_bias does not cover.
            raise ValueError(
                f"ModelSpec.from_hf: attention_bias=true is not supported for {family} "
                "(it adds an o_proj bias); use a checkpoint without it"
            )
    theta, rope_type, rope_params = _rope(cfg)
    return ModelSpec(
        family=family,
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_require(cfg, "num_hidden_layers")),
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        ffn_hidden_size=int(_require(cfg, "intermediate_size")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_type=rope_type,
        rope_params=rope_params,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=family == "qwen3",
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
    )
