"""The pure name and shape mapping between Hugging Face and Megatron weights (no torch.distributed).

One Megatron parameter maps to one or more HF tensors (`ParamMap`):

| Megatron (per stage, local layer i)           | Hugging Face (global layer i + offset)          | TP split   |
|-----------------------------------------------|-------------------------------------------------|------------|
| embedding.word_embeddings.weight              | model.embed_tokens.weight                       | rows       |
| decoder.layers.i.input_layernorm.weight       | model.layers.L.input_layernorm.weight           | replicated |
| decoder.layers.i.self_attention.linear_qkv.*  | model.layers.L.self_attn.{q,k,v}_proj.*         | rows       |
| decoder.layers.i.self_attention.q_layernorm   | model.layers.L.self_attn.q_norm.weight (Qwen3)  | replicated |
| decoder.layers.i.self_attention.k_layernorm   | model.layers.L.self_attn.k_norm.weight (Qwen3)  | replicated |
| decoder.layers.i.self_attention.linear_proj   | model.layers.L.self_attn.o_proj.weight          | columns    |
| decoder.layers.i.pre_mlp_layernorm.weight     | model.layers.L.post_attention_layernorm.weight  | replicated |
| decoder.layers.i.mlp.linear_fc1.weight        | model.layers.L.mlp.{gate,up}_proj.weight        | gated rows |
| decoder.layers.i.mlp.linear_fc2.weight        | model.layers.L.mlp.down_proj.weight             | columns    |
| decoder.final_layernorm.weight                | model.norm.weight                               | replicated |
| output_layer.weight (actor)                   | lm_head.weight (embed_tokens when tied)         | rows       |
| output_layer.{weight,bias} (critic ValueHead) | score.{weight,bias}                             | replicated |

Fused q/k/v: Megatron's `linear_qkv` is grouped by key/value head: for each of
the `num_kv_heads` groups, that group's query heads, then its key head, then
its value head. Splitting that tensor's rows evenly over TP ranks hands each
rank whole groups, which is what Megatron expects.

Fused gate/up: Megatron's `linear_fc1` on one TP rank is `[gate_r; up_r]`
(that rank's slice of each), so the TP shard of fc1 is not a plain row slice
of `[gate; up]`; `shard`/`unshard` handle the "gated_rows" split.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tandem.megatron.models.hf_config import ModelSpec

Split = Literal["replicated", "rows", "columns", "gated_rows"]
Fuse = Literal["identity", "qkv", "gate_up"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron suffix within a layer -> (HF suffixes within `model.layers.L.`, split, fuse).
_LAYER_MAP: dict[str, tuple[tuple[str, ...], Split, Fuse]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated", "identity"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "rows",
        "qkv",
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "rows",
        "qkv",
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated", "identity"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated", "identity"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "columns", "identity"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated", "identity"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gated_rows", "gate_up"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "columns", "identity"),
}


@dataclass(frozen=True)
class ParamMap:
    """How one Megatron parameter of this stage relates to HF tensors.

    Attributes:
        megatron: the parameter's name in this stage's `GPTModel` (local layer numbers).
        hf: the HF tensor names it is made of (global layer numbers), in fusion order.
        split: how tensor-parallel ranks split it.
        fuse: how the HF tensors combine into the full (unsplit) Megatron tensor.
        exported: False for a copy that the HF checkpoint does not hold on its own
            (the tied output head of the last pipeline stage).
    """

    megatron: str
    hf: tuple[str, ...]
    split: Split
    fuse: Fuse = "identity"
    exported: bool = True


def layer_names(spec: ModelSpec) -> list[str]:
    """The Megatron parameter suffixes of one decoder layer of `spec`, in a fixed order."""
    names = list(_LAYER_MAP)
    if not spec.qkv_bias:
        names.remove("self_attention.linear_qkv.bias")
    if not spec.qk_norm:
        names.remove("self_attention.q_layernorm.weight")
        names.remove("self_attention.k_layernorm.weight")
    return names


def param_map(spec: ModelSpec, name: str, *, layer_offset: int, role: str) -> ParamMap:
    """The `ParamMap` of Megatron parameter `name` on a stage whose first layer is `layer_offset`."""
    m = _LAYER.match(name)
    if m:
        layer = int(m.group(1)) + layer_offset
        hf_suffixes, split, fuse = _LAYER_MAP[m.group(2)]
        return ParamMap(name, tuple(f"model.layers.{layer}.{s}" for s in hf_suffixes), split, fuse)
    if name == "embedding.word_embeddings.weight":
        return ParamMap(name, ("model.embed_tokens.weight",), "rows")
    if name == "decoder.final_layernorm.weight":
        return ParamMap(name, ("model.norm.weight",), "replicated")
    if name in ("output_layer.weight", "output_layer.bias") and role == "critic":
        return ParamMap(name, ("score." + name.rsplit(".", 1)[1],), "replicated")
    if name == "output_layer.weight":
        if spec.tie_word_embeddings:
            # The last stage's copy of the embedding (pipeline-parallel tied head).
            return ParamMap(name, ("model.embed_tokens.weight",), "rows", exported=False)
        return ParamMap(name, ("lm_head.weight",), "rows")
    raise KeyError(f"no Hugging Face counterpart known for Megatron parameter {name!r}")


def stage_param_names(
    spec: ModelSpec,
    *,
    role: str,
    num_local_layers: int,
    pre_process: bool,
    post_process: bool,
    tied_copy: bool,
) -> list[str]:
    """The Megatron parameter names one pipeline stage holds, in export order.

    `tied_copy`: the stage holds its own `output_layer.weight` although the
    head is tied (the last stage when the first stage is another one).
    """
    names: list[str] = []
    if pre_process:
        names.append("embedding.word_embeddings.weight")
    for i in range(num_local_layers):
        names.extend(f"decoder.layers.{i}.{s}" for s in layer_names(spec))
    if post_process:
        names.append("decoder.final_layernorm.weight")
        if role == "critic":
            names.extend(["output_layer.weight", "output_layer.bias"])
        elif not spec.tie_word_embeddings or tied_copy:
            names.append("output_layer.weight")
    return names


def _groups(spec: ModelSpec) -> tuple[int, int]:
    return spec.num_kv_heads, spec.num_attention_heads // spec.num_kv_heads


def to_megatron(spec: ModelSpec, pm: ParamMap, hf: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full (unsplit) Megatron tensor of `pm` from its HF tensors (in `pm.hf` order)."""
    if pm.fuse == "identity":
        return hf[0]
    if pm.fuse == "gate_up":
        return torch.cat([hf[0], hf[1]], dim=0)
    q, k, v = hf
    groups, per_group = _groups(spec)
    rest = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(groups, per_group * spec.head_dim, *rest),
            k.reshape(groups, spec.head_dim, *rest),
            v.reshape(groups, spec.head_dim, *rest),
        ],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def to_hf(spec: ModelSpec, pm: ParamMap, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of `pm` from its full (unsplit) Megatron tensor; inverse of `to_megatron`."""
    if pm.fuse == "identity":
        return [(pm.hf[0], full)]
    if pm.fuse == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return [(pm.hf[0], gate), (pm.hf[1], up)]
    groups, per_group = _groups(spec)
    rest = full.shape[1:]
    grouped = full.reshape(groups, (per_group + 2) * spec.head_dim, *rest)
    q, k, v = grouped.split([per_group * spec.head_dim, spec.head_dim, spec.head_dim], dim=1)
    return [(name, t.reshape(-1, *rest)) for name, t in zip(pm.hf, (q, k, v), strict=True)]


def shard(split: Split, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Tensor-parallel rank `tp_rank`'s part of the full Megatron tensor."""
    if split == "replicated":
        return full
    if split == "rows":
        return full.chunk(tp_size, dim=0)[tp_rank]
    if split == "columns":
        return full.chunk(tp_size, dim=1)[tp_rank]
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)


def unshard(split: Split, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from every tensor-parallel rank's part (in rank order)."""
    if split == "replicated":
        return parts[0]
    if split == "rows":
        return torch.cat(list(parts), dim=0)
    if split == "columns":
        return torch.cat(list(parts), dim=1)
    halves = [p.chunk(2, dim=0) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def hf_shape(spec: ModelSpec, hf_name: str) -> tuple[int, ...]:
    """Shape of HF tensor `hf_name` in a checkpoint of shape `spec`."""
    h, hd = spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_attention_heads * hd, spec.num_kv_heads * hd
    suffix_shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q_rows, h),
        "self_attn.k_proj.weight": (kv_rows, h),
        "self_attn.v_proj.weight": (kv_rows, h),
        "self_attn.q_proj.bias": (q_rows,),
        "self_attn.k_proj.bias": (kv_rows,),
        "self_attn.v_proj.bias": (kv_rows,),
        "self_attn.o_proj.weight": (h, q_rows),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (spec.ffn_hidden_size, h),
        "mlp.up_proj.weight": (spec.ffn_hidden_size, h),
        "mlp.down_proj.weight": (h, spec.ffn_hidden_size),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "lm_head.weight": (spec.vocab_size, h),
        "score.weight": (1, h),
        "score.bias": (1,),
    }
    for suffix, shape in suffix_shapes.items():
        if hf_name == suffix or hf_name.endswith("." + suffix):
            return shape
    raise KeyError(f"unknown Hugging Face tensor name {hf_name!r}")
