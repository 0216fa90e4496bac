"""The pure HF <-> Megatron name/shape mapping: round trips and the grouped q/k/v layout (no Megatron import)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.models.conversion import (
    hf_shape,
    layer_names,
    param_map,
    shard,
    stage_param_names,
    to_hf,
    to_megatron,
    unshard,
)
from tandem.megatron.models.hf_config import ModelSpec


def _spec(family: str, heads: int, kv_heads: int, head_dim: int, tie: bool = False) -> ModelSpec:
    return ModelSpec.from_hf(
        {
            "model_type": family,
            "vocab_size": 32,
            "hidden_size": 24,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "intermediate_size": 40,
            "tie_word_embeddings": tie,
        }
    )


def _hf_tensor(name: str, spec: ModelSpec, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*hf_shape(spec, name), generator=gen)


@settings(max_examples=40, deadline=None)
@given(
    family=st.sampled_from(["llama", "qwen2", "qwen3"]),
    kv_heads=st.sampled_from([1, 2, 4]),
    per_group=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([2, 4, 6]),
    tp_size=st.sampled_from([1, 2, 4]),
    tie=st.booleans(),
    role=st.sampled_from(["actor", "critic"]),
)
def test_round_trip_through_tp_shards_returns_identical_tensors(
    family: str, kv_heads: int, per_group: int, head_dim: int, tp_size: int, tie: bool, role: str
) -> None:
    if kv_heads % tp_size:
        tp_size = 1
    spec = _spec(family, kv_heads * per_group, kv_heads, head_dim, tie)
    gen = torch.Generator().manual_seed(0)
    names = stage_param_names(
        spec, role=role, num_local_layers=2, pre_process=True, post_process=True, tied_copy=False
    )
    hf: dict[str, torch.Tensor] = {}
    back: dict[str, torch.Tensor] = {}
    for name in names:
        pm = param_map(spec, name, layer_offset=0, role=role)
        tensors = [hf.setdefault(n, _hf_tensor(n, spec, gen)) for n in pm.hf]
        full = to_megatron(spec, pm, tensors)
        parts = [shard(pm.split, full, r, tp_size) for r in range(tp_size)]
        back.update(to_hf(spec, pm, unshard(pm.split, parts)))
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    # Everything an HF checkpoint of this shape holds, and nothing more.
    expected_head = {"actor": set() if tie else {"lm_head.weight"}, "critic": {"score.weight", "score.bias"}}
    assert {n for n in hf if not n.startswith("model.")} == expected_head[role]


@settings(max_examples=30, deadline=None)
@given(
    kv_heads=st.sampled_from([1, 2, 4]),
    per_group=st.sampled_from([1, 2, 4]),
    tp_size=st.sampled_from([1, 2, 4]),
    with_bias=st.booleans(),
)
def test_qkv_shard_holds_whole_query_groups_with_their_kv_head(
    kv_heads: int, per_group: int, tp_size: int, with_bias: bool
) -> None:
    # Tag each HF row with (kind, head) so the fused layout can be read back:
    # Megatron's attention views a rank's rows as [groups, per_group+2, head_dim]
    # and takes q = the first per_group heads, k, v the last two of each group.
    # HF (repeat_kv) pairs query head j with kv head j // per_group.
    if kv_heads % tp_size:
        tp_size = 1
    head_dim = 3
    spec = _spec("qwen2", kv_heads * per_group, kv_heads, head_dim)
    heads = kv_heads * per_group

    def tagged(kind: int, n_heads: int) -> torch.Tensor:
        rows = torch.tensor([[kind * 1000 + h] * 2 for h in range(n_heads) for _ in range(head_dim)])
        return rows[:, 0] if with_bias else rows

    name = "decoder.layers.0.self_attention.linear_qkv." + ("bias" if with_bias else "weight")
    pm = param_map(spec, name, layer_offset=0, role="actor")
    full = to_megatron(spec, pm, [tagged(0, heads), tagged(1, kv_heads), tagged(2, kv_heads)])
    groups_per_rank = kv_heads // tp_size
    for rank in range(tp_size):
        local = shard(pm.split, full, rank, tp_size)
        view = local.reshape(groups_per_rank, per_group + 2, head_dim, *local.shape[1:])
        for g in range(groups_per_rank):
            group = rank * groups_per_rank + g
            tags = view[g].reshape(per_group + 2, -1)[:, 0].tolist()
            assert tags == [group * per_group + j for j in range(per_group)] + [1000 + group, 2000 + group]


def test_gated_fc1_shard_is_gate_slice_then_up_slice() -> None:
    # Megatron's MLP chunks a rank's fc1 output in two halves: gate, then up.
    spec = _spec("llama", 4, 2, 4)
    gate = torch.arange(40.0)[:, None].expand(40, 3)
    up = 100 + torch.arange(40.0)[:, None].expand(40, 3)
    pm = param_map(spec, "decoder.layers.0.mlp.linear_fc1.weight", layer_offset=0, role="actor")
    full = to_megatron(spec, pm, [gate, up])
    local = shard(pm.split, full, 1, 2)
    assert torch.equal(local[:20], gate[20:]) and torch.equal(local[20:], up[20:])


def test_layer_offset_and_family_specific_names() -> None:
    qwen3 = _spec("qwen3", 4, 2, 4)
    llama = _spec("llama", 4, 2, 4)
    pm = param_map(qwen3, "decoder.layers.1.self_attention.q_layernorm.weight", layer_offset=6, role="actor")
    assert pm.hf == ("model.layers.7.self_attn.q_norm.weight",)
    assert "self_attention.q_layernorm.weight" not in layer_names(llama)
    assert "self_attention.linear_qkv.bias" in layer_names(_spec("qwen2", 4, 2, 4))
    assert "self_attention.linear_qkv.bias" not in layer_names(qwen3)
    tied = _spec("llama", 4, 2, 4, tie=True)
    pm = param_map(tied, "output_layer.weight", layer_offset=0, role="actor")
    assert pm.hf == ("model.embed_tokens.weight",) and not pm.exported
    with pytest.raises(KeyError):
        param_map(llama, "decoder.layers.0.unknown.weight", layer_offset=0, role="actor")


def test_conversion_does_not_import_megatron() -> None:
    # The pure mapping must stay usable (and testable) without megatron-core's 30 s import.
    code = "import sys, tandem.megatron.models.conversion; print('megatron.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
