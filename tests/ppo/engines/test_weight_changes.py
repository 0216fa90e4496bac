"""The weight sync's count of changed weights (`_weight_changes`), against counts made by hand.

The torch path (`count_and_copy`) against sets of changed positions (hypothesis), and the
embedded engine on CPU: a sync that changes chosen elements of a tiny Llama reports exactly
those, "since the start" is the union over syncs, the bitmask survives a release, and with
the count off the weights still arrive.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.ppo.engines import EmbeddedEngine, EngineMemoryReleasedError, EngineOptions, ipc_payload
from tandem.ppo.engines._weight_changes import _count_with_torch, count_and_copy, weight_magnitudes

from .conftest import make_tiny_model, save_model


def _changed_positions(size: int, positions: list[int]) -> set[int]:
    return {p % size for p in positions}


@given(
    size=st.integers(1, 70),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    rounds=st.lists(st.lists(st.integers(0, 10_000), max_size=12), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    # The CPU's NumPy path, and the torch path of other devices (here on CPU tensors).
    path=st.sampled_from([count_and_copy, _count_with_torch]),
)
def test_count_and_copy_counts_the_positions_that_change(
    size: int, dtype: torch.dtype, rounds: list[list[int]], seed: int, path: Any
) -> None:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(size, generator=g).to(dtype)
    bits = torch.zeros(math.ceil(size / 8), dtype=torch.uint8)
    counts = torch.zeros(2, dtype=torch.int64)
    ever: set[int] = set()
    for positions in rounds:
        changed = _changed_positions(size, positions)
        source = target.clone()
        for p in changed:
            source[p] = source[p] + 1.0  # |w| < 2**8 and a step of 1: another bf16 value too
        before = counts.clone()
        path(target, source, bits, counts)
        assert torch.equal(target, source)
        # This copy's changes, and the positions changed for the first time.
        assert int(counts[0] - before[0]) == len(changed)
        assert int(counts[1] - before[1]) == len(changed - ever)
        ever |= changed
        expected = [any(8 * b + i in ever for i in range(8)) for b in range(len(bits))]
        set_bits = [[bool(int(byte) >> i & 1) for i in range(8)] for byte in bits]
        assert [8 * b + i for b in range(len(bits)) for i in range(8) if set_bits[b][i]] == sorted(ever)
        assert [any(row) for row in set_bits] == expected


def test_the_same_value_is_no_change_and_a_sign_of_zero_is_one() -> None:
    """Elements compare by their bits in the engine's dtype: a value rounded to the same bf16 is no
    change, -0.0 against 0.0 is one."""
    target = torch.tensor([1.0, 0.0, 2.0], dtype=torch.bfloat16)
    source = torch.tensor([1.0 + 2**-10, -0.0, 2.0], dtype=torch.float32)  # 1 + 2**-10 rounds to 1 in bf16
    bits, counts = torch.zeros(1, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)
    count_and_copy(target, source, bits, counts)
    assert counts.tolist() == [1, 1] and int(bits[0]) == 0b010


def test_a_strided_target_is_counted_in_row_major_order() -> None:
    base = torch.zeros(4, 6)
    target = base[:, ::2]  # a (4, 3) view, not contiguous
    source = torch.zeros(4, 3)
    source[1, 2] = 5.0
    bits, counts = torch.zeros(2, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)
    count_and_copy(target, source, bits, counts)
    assert counts.tolist() == [1, 1] and int(bits[0]) == 1 << 5  # element 1 * 3 + 2
    assert base[1, 4] == 5.0


def _hand_edit(model: Any, edits: dict[str, list[int]], delta: float) -> list[tuple[str, torch.Tensor]]:
    """The model's HF state with `delta` added at the flat positions `edits[name]` of each named tensor."""
    named = []
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().clone()
        for p in edits.get(name, []):
            tensor.view(-1)[p] += delta
        named.append((name, tensor))
    return named


@pytest.mark.parametrize(
    ("device", "as_ipc"),
    [
        ("cpu", False),
        ("cpu", True),
        # bfloat16 weights, the Triton kernel, CUDA tensors (on a GPU host's `-m gpu` suite).
        pytest.param("cuda", False, marks=pytest.mark.gpu),
    ],
    ids=["tensors", "ipc_payload", "cuda"],
)
def test_the_engine_counts_what_each_sync_changed(tiny_llama_dir: str, device: str, as_ipc: bool) -> None:
    assert_counts_of_hand_edits(EmbeddedEngine(tiny_llama_dir, EngineOptions(device=device)), device, as_ipc)


def assert_counts_of_hand_edits(engine: EmbeddedEngine, device: str, as_ipc: bool) -> None:
    """Syncs that change chosen elements of the tiny Llama report exactly those (test_weight_change_kernel.py
    runs it with the counter's kernel in Triton's interpreter)."""
    base = make_tiny_model("llama")  # the weights the engine loaded (the folder's)
    elements = sum(p.numel() for p in {id(p): p for p in engine.model.parameters()}.values())

    def sync(named: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
        for lo in range(0, len(named), 4):  # buckets of a few tensors, as the actor sends them
            bucket = [(name, t.to(device)) for name, t in named[lo : lo + 4]]
            engine.update_weights_from_tensors(ipc_payload(bucket) if as_ipc else bucket)
        return engine.weight_changes()

    # The same weights again: nothing changes.
    first = sync(_hand_edit(base, {}, 0.0))
    assert (first["changed"], first["changed_since_start"], first["elements"]) == (0, 0, elements)
    # 3 + 2 chosen elements, counted by hand.
    edits = {"model.norm.weight": [0, 5, 31], "model.layers.1.mlp.up_proj.weight": [7, 100]}
    second = sync(_hand_edit(base, edits, 0.5))
    assert (second["changed"], second["changed_since_start"]) == (5, 5)
    # Back to the start for norm's three, a new one in the embedding: 3 + 1 change now, 6 ever.
    edits = {"model.layers.1.mlp.up_proj.weight": [7, 100], "model.embed_tokens.weight": [3]}
    third = sync(_hand_edit(base, edits, 0.5))
    assert (third["changed"], third["changed_since_start"]) == (4, 6)
    assert third["update_s"] > 0
    # The bitmask goes to the host with the weights and comes back with them.
    engine.release_memory(["weights"])
    with pytest.raises(EngineMemoryReleasedError, match="weight_changes"):
        engine.weight_changes()
    engine.resume_memory(["weights"])
    fourth = sync(_hand_edit(base, {"model.norm.weight": [0, 1]}, 0.5))
    assert (fourth["changed"], fourth["changed_since_start"]) == (5, 7)  # norm[1] is new


def test_without_the_count_the_weights_still_arrive(tiny_llama_dir: str) -> None:
    engine = EmbeddedEngine(tiny_llama_dir, EngineOptions(device="cpu", count_weight_changes=False))
    named = _hand_edit(make_tiny_model("llama"), {"model.norm.weight": [0], "lm_head.weight": [3, 4]}, 0.5)
    named[0] = (named[0][0], named[0][1].double())  # another dtype: cast as `copy_` casts
    engine.update_weights_from_tensors(named)  # one batched copy over every tensor
    state = engine.model.state_dict()
    assert all(torch.equal(state[name], tensor.to(state[name].dtype)) for name, tensor in named)
    assert float(state["model.norm.weight"][0]) == 1.5  # RMSNorm's weights start at 1
    assert set(engine.weight_changes()) == {"update_s"}
    assert engine.weight_magnitudes() == {}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tied_names_are_one_weight_counted_once(tmp_path: Path, device: str) -> None:
    """Qwen2's head is its embedding: sent under both names, the weight is copied and counted once (on CUDA
    two programs of one launch over it would both count its changes)."""
    model = make_tiny_model("qwen2")
    engine = EmbeddedEngine(save_model(model, tmp_path), EngineOptions(device=device))
    embedding = model.model.embed_tokens.weight.detach().clone().to(device, engine.dtype)
    embedding[2, :3] += 0.5
    engine.update_weights_from_tensors(
        [("model.embed_tokens.weight", embedding), ("lm_head.weight", embedding)]
    )
    changes = engine.weight_changes()
    assert (changes["changed"], changes["changed_since_start"]) == (3, 3)
    assert torch.equal(engine.model.lm_head.weight.detach(), embedding)


def test_weight_magnitudes_count_elements_by_binary_exponent() -> None:
    a = torch.tensor([0.75, -0.5, 3.0, 0.0, 2**-7])  # exponents -1, -1, 1, (zero), -7
    b = torch.tensor([1.0, 1.5], dtype=torch.bfloat16)  # exponent 0 twice
    figures = weight_magnitudes({"a": a, "b": b, "tied": a}, torch.bfloat16)
    assert figures == {"dtype": "bfloat16", "eps": 2**-7, "exponents": {-7: 1, -1: 2, 0: 2, 1: 1}, "zeros": 1}
