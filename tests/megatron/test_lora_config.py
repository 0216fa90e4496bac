"""LoRA's fields in `WorkerConfig` and the pure helpers of `lora_spec`: names, targets, the merge."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.megatron.config import WorkerConfig
from tandem.megatron.models.lora_spec import (
    ALL_LINEAR,
    FUSED_TARGETS,
    HF_LINEARS,
    adapter_name,
    merge_lora,
    resolve_targets,
    split_adapter_name,
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("hf")
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(path)


def make(hf_dir: str, **overrides: Any) -> WorkerConfig:
    fields: dict[str, Any] = {
        "hf_checkpoint": hf_dir,
        "rollout_batch_size": 4,
        "n_samples_per_prompt": 2,
        "global_batch_size": 8,
        "device": "cpu",
        "params_dtype": "float32",
    }
    return WorkerConfig(**(fields | overrides))


def test_each_role_has_its_own_lora(hf_dir: str) -> None:
    config = make(
        hf_dir, lora_rank=8, lora_alpha=16, critic_lora_rank=4, critic_lora_target_modules=("linear_qkv",)
    )
    actor, critic = config.lora_of("actor"), config.lora_of("critic")
    assert actor is not None and critic is not None
    assert (actor.rank, actor.scaling, actor.targets) == (8, 2.0, HF_LINEARS)
    assert (critic.rank, critic.scaling, critic.targets) == (4, 1.0, ("q_proj", "k_proj", "v_proj"))
    assert make(hf_dir, lora_rank=8).lora_of("critic") is None  # the critic's own setting: full by default
    assert make(hf_dir).lora_of("actor") is None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"lora_rank": 0}, r"^lora_rank: got 0; it must be a positive integer"),
        ({"lora_rank": -2}, r"^lora_rank: got -2"),
        ({"critic_lora_rank": 0}, r"^critic_lora_rank: got 0"),
        ({"lora_rank": 8, "lora_alpha": 0.0}, r"^lora_alpha: got 0.0; it must be a finite number > 0"),
        ({"critic_lora_rank": 8, "critic_lora_alpha": -1.0}, r"^critic_lora_alpha: got -1.0"),
        ({"lora_rank": 8, "lora_dropout": 1.0}, r"^lora_dropout: got 1.0; it must lie in \[0, 1\)"),
        ({"lora_alpha": 16.0}, r"^lora_alpha: set, but `lora_rank` is unset"),
        (
            {"critic_lora_target_modules": ("q_proj",)},
            r"^critic_lora_target_modules: set, but `critic_lora_rank`",
        ),
        ({"lora_dropout": 0.1}, r"^lora_dropout: set, but `lora_rank` is unset"),
        (
            {"lora_rank": 8, "reuse_old_log_probs": True, "lora_dropout": 0.1},
            r"^reuse_old_log_probs: .*lora_dropout",
        ),
        (
            {"critic_lora_rank": 8, "reuse_old_values": True, "critic_lora_dropout": 0.1},
            r"^reuse_old_values: .*critic",
        ),
    ],
)
def test_bad_lora_fields_are_refused_naming_the_field(
    hf_dir: str, overrides: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make(hf_dir, **overrides)


def test_a_target_the_model_lacks_is_refused_listing_what_it_has(hf_dir: str) -> None:
    with pytest.raises(ValueError, match=r"^lora_target_modules: 'c_attn' is not a linear layer") as info:
        make(hf_dir, lora_rank=8, lora_target_modules=("q_proj", "c_attn"))
    for name in (*HF_LINEARS, *FUSED_TARGETS, ALL_LINEAR):
        assert name in str(info.value)


def test_flags_lora_cannot_work_with_are_refused(
    hf_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = tmp_path_factory.mktemp("ref")
    (other / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^ref_load: .* a LoRA actor's reference is its own base model"):
        make(hf_dir, lora_rank=8, use_kl_loss=True, ref_load=str(other))
    make(hf_dir, lora_rank=8, use_kl_loss=True, ref_load=hf_dir)  # the base itself is fine
    with pytest.raises(ValueError, match=r"^offload_backend: torch_memory_saver copies the frozen LoRA base"):
        make(
            hf_dir,
            critic_lora_rank=8,
            device="cuda",
            params_dtype="bfloat16",
            offload_backend="torch_memory_saver",
        )
    resident = make(
        hf_dir,
        critic_lora_rank=8,
        device="cuda",
        params_dtype="bfloat16",
        offload_backend="torch_memory_saver",
        lora_base_offload=False,
    )
    assert resident.lora_of("critic") is not None
    # One host copy of the two bases needs both models' LoRA and their bases asleep on the host.
    for fields in ({"lora_rank": 8}, {"lora_rank": 8, "critic_lora_rank": 8, "lora_base_offload": False}):
        with pytest.raises(
            ValueError, match=r"^lora_base_share: shares the host copy .* needs both `lora_rank`"
        ):
            make(hf_dir, lora_base_share=True, **fields)
    assert make(hf_dir, lora_rank=8, critic_lora_rank=8, lora_base_share=True).shares_lora_base
    # Unset, it is on wherever it can be, and off elsewhere without a word; False turns it off.
    assert make(hf_dir, lora_rank=8, critic_lora_rank=8).shares_lora_base
    assert not make(hf_dir, lora_rank=8, critic_lora_rank=8, lora_base_share=False).shares_lora_base
    for fields in ({"lora_rank": 8}, {"lora_rank": 8, "critic_lora_rank": 8, "lora_base_offload": False}):
        assert not make(hf_dir, **fields).shares_lora_base
    with pytest.raises(ValueError, match=r"^lora_base_share: got 'yes'; it must be True, False or None"):
        make(hf_dir, lora_rank=8, critic_lora_rank=8, lora_base_share="yes")
    # Dropout keeps the old log-probs a forward pass of their own (auto).
    assert not make(hf_dir, lora_rank=8, lora_dropout=0.1).reuses_old_log_probs
    assert make(hf_dir, lora_rank=8).reuses_old_log_probs


_NAMES = st.lists(st.sampled_from([*HF_LINEARS, *FUSED_TARGETS, ALL_LINEAR]), min_size=1, max_size=5)


@given(_NAMES)
def test_targets_resolve_to_the_parts_of_every_name_in_hf_order(names: list[str]) -> None:
    expected: set[str] = set()
    for name in names:
        expected |= set(HF_LINEARS if name == ALL_LINEAR else FUSED_TARGETS.get(name, (name,)))
    resolved = resolve_targets(names)
    assert set(resolved) == expected
    assert list(resolved) == sorted(resolved, key=HF_LINEARS.index)
    assert resolve_targets(None) == HF_LINEARS


@given(st.integers(0, 40), st.sampled_from(HF_LINEARS), st.sampled_from(["A", "B"]), st.booleans())
def test_adapter_names_split_back_into_their_weight(layer: int, target: str, matrix: str, peft: bool) -> None:
    name = adapter_name(layer, target, matrix, peft=peft)  # type: ignore[arg-type]
    block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    assert split_adapter_name(name) == (f"model.layers.{layer}.{block}.{target}.weight", matrix)
    assert name.startswith("base_model.model.model.layers.") == peft


def test_merge_is_the_base_plus_scaled_b_a_rounded_once() -> None:
    base = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.bfloat16)
    a = torch.tensor([[1.0, -1.0]])  # rank 1
    b = torch.tensor([[0.5], [0.0], [-2.0]])
    # B A = [[0.5, -0.5], [0, 0], [-2, 2]]; times scaling 2: [[1, -1], [0, 0], [-4, 4]].
    expected = torch.tensor([[2.0, 1.0], [3.0, 4.0], [1.0, 10.0]], dtype=torch.bfloat16)
    merged = merge_lora(base, a, b, 2.0)
    assert merged.dtype == torch.bfloat16 and torch.equal(merged, expected)
    # From the base every time: merging twice from the base gives the same tensor.
    assert torch.equal(merge_lora(base, a, b, 2.0), merged)
    with pytest.raises(ValueError, match="do not fit a weight of shape"):
        merge_lora(base, a.T, b, 2.0)
