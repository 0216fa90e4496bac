"""Sequence packing: the packed row's layout (pure), and packed against padded micro-batches (CPU, gloo).

`_scripts/packing_check.py` runs both layouts through one model per role and
core attention (SDPA, Megatron's local one), in fresh processes: one process,
then two under tensor parallel 2 and under pipeline parallel 2. Model outputs,
`forward_only`'s log-probs / values, each micro-batch's loss metrics and every
gradient of a backward pass must agree to fp32 rounding; so must the actor's, in
each layout, with its vocabulary head over every position and at the response
positions alone (`head_at_responses`).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.batch import RolloutBatch
from tandem.megatron.models.packing import (
    PackedRow,
    block_causal_mask,
    pack_lengths,
    pack_tokens,
    position_ids,
    segments_of,
)
from tandem.megatron.worker.forward import micro_batches_by_tokens

SCRIPTS = Path(__file__).parent / "_scripts"
RUNS = {"1x1": 1, "2x1,1x2": 2}  # phases (TPxPP) -> processes
ATTENTIONS = ("sdpa", "local")
ROLES = ("actor", "critic")


# --- the layout of a packed row (pure) ------------------------------------------------------------------
def test_a_row_of_three_samples() -> None:
    row = pack_lengths([3, 1, 2])
    assert (row.cu_seqlens, row.offsets, row.total, row.max_seqlen, row.pad) == (
        [0, 3, 4, 6],
        (0, 3, 4),
        6,
        3,
        0,
    )
    assert position_ids(row).tolist() == [0, 1, 2, 0, 0, 1]
    tokens = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]
    assert pack_tokens(tokens, row).tolist() == [5, 6, 7, 8, 9, 10]
    # Row i: the keys query i may NOT see (1). Samples are blocks; inside each, causal.
    expected = [
        [0, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 1],
        [0, 0, 0, 1, 1, 1],
        [1, 1, 1, 0, 1, 1],
        [1, 1, 1, 1, 0, 1],
        [1, 1, 1, 1, 0, 0],
    ]
    assert block_causal_mask(row).int().tolist() == expected


def test_filler_is_a_block_of_its_own() -> None:
    row = pack_lengths([3, 2], multiple=4)
    assert (row.pad, row.total, row.segments, row.cu_seqlens, row.offsets) == (
        3,
        8,
        (3, 2, 3),
        [0, 3, 5, 8],
        (0, 3),
    )
    assert pack_tokens([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], row).tolist() == [
        1,
        2,
        3,
        4,
        5,
        0,
        0,
        0,
    ]
    assert position_ids(row).tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert pack_lengths([4, 4], multiple=4).pad == 0


@pytest.mark.parametrize(("lengths", "multiple"), [([], 1), ([2, 0], 1), ([2], 0)])
def test_bad_layouts_are_refused(lengths: list[int], multiple: int) -> None:
    with pytest.raises(ValueError, match="pack_lengths"):
        pack_lengths(lengths, multiple)


def test_segments_are_read_back_from_thd_boundaries() -> None:
    # What the core attentions read from Megatron's PackedSeqParams (stood in for here: importing
    # megatron in the test process is left to the Megatron scripts); packed_seq_params builds it.
    row = pack_lengths([3, 1, 2], multiple=4)
    cu = torch.tensor(row.cu_seqlens, dtype=torch.int32)
    params = SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=None)
    assert segments_of(params) == [3, 1, 2, 2] == list(row.segments)
    with pytest.raises(ValueError, match="only 'thd'"):
        segments_of(SimpleNamespace(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="same unpadded cu_seqlens"):
        segments_of(SimpleNamespace(**{**vars(params), "cu_seqlens_kv": cu.flip(0)}))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(1, 8))
def test_every_token_sees_exactly_the_earlier_tokens_of_its_own_sample(
    lengths: list[int], multiple: int
) -> None:
    row = pack_lengths(lengths, multiple)
    assert row.total % multiple == 0 and 0 <= row.pad < multiple and row.total == sum(lengths) + row.pad
    assert row.cu_seqlens[-1] == row.total and sorted(row.cu_seqlens) == row.cu_seqlens
    # Label each token by (block, position in block), by hand.
    labels = [(b, p) for b, n in enumerate(row.segments) for p in range(n)]
    assert position_ids(row).tolist() == [p for _, p in labels]
    mask = block_causal_mask(row)
    for i, (bi, pi) in enumerate(labels):
        seen = [j for j, (bj, pj) in enumerate(labels) if not mask[i, j]]
        assert seen == [j for j, (bj, pj) in enumerate(labels) if bj == bi and pj <= pi]
    # Each sample's tokens come back from its offset.
    tokens = [torch.arange(n) + 100 * s for s, n in enumerate(lengths)]
    packed = pack_tokens(tokens, row)
    for t, offset in zip(tokens, row.offsets, strict=True):
        assert torch.equal(packed[offset : offset + t.numel()], t)


def test_packed_row_is_a_value() -> None:
    assert PackedRow((2, 3)) == pack_lengths([2, 3]) and hash(PackedRow((2, 3))) == hash(pack_lengths([2, 3]))


# --- packed against padded, through Megatron --------------------------------------------------------------
@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory, random_llama: Callable[..., None]) -> Path:
    work = tmp_path_factory.mktemp("packing")
    random_llama(
        work / "hf",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    for phases, nproc in RUNS.items():
        command = [sys.executable, str(SCRIPTS / "launch.py"), str(nproc), str(SCRIPTS / "packing_check.py")]
        proc = subprocess.run([*command, str(work), phases], capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return work / "out"


def _saved(out_dir: Path, phase: str, attention: str, role: str) -> list[dict[str, Any]]:
    ranks = RUNS["1x1"] if phase == "1x1" else RUNS["2x1,1x2"]
    return [torch.load(out_dir / f"{phase}-{attention}-{role}-rank{r}.pt") for r in range(ranks)]


@pytest.mark.slow
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("phase", ["1x1", "2x1", "1x2"])
def test_packed_micro_batches_give_the_padded_outputs_losses_and_gradients(
    out_dir: Path, phase: str, attention: str, role: str
) -> None:
    kinds: set[str] = set()
    biggest_grad = 0.0
    for saved in _saved(out_dir, phase, attention, role):
        for name, (padded, packed) in saved.items():
            kind = name.split(":")[-1].rstrip("0123456789")
            kinds.add(kind)
            if kind == "leaky":
                continue
            torch.testing.assert_close(
                packed, padded, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
            if name.startswith("grad:"):
                biggest_grad = max(biggest_grad, float(padded.abs().max()))
    # What was compared: real gradients, the losses, and (without pipelining) the raw outputs.
    assert biggest_grad > 1e-4
    assert {"forward_only", "forward_only_sizes"} <= kinds
    assert ("pg_loss" if role == "actor" else "value_loss") in kinds
    if role == "actor":
        heads = {name.split(":")[0] for saved in _saved(out_dir, phase, attention, role) for name in saved}
        assert {"head0", "head1"} <= heads, heads
    if phase != "1x2":
        assert {"output", "filled"} <= kinds


@pytest.mark.slow
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_the_comparison_fails_when_samples_leak_into_each_other(out_dir: Path, attention: str) -> None:
    # The packed row run as one plain sequence: the first sample is unchanged (causal), the others not.
    (saved,) = _saved(out_dir, "1x1", attention, "actor")
    leaky = {k: v for k, v in saved.items() if k.split(":")[-1].startswith("leaky")}
    assert leaky
    for name, (padded, packed) in leaky.items():
        diff = float((padded - packed).abs().max())
        assert (diff < 1e-5) if name.endswith("leaky0") else (diff > 1e-3), (name, diff)


# --- micro-batches cut by tokens (pure) -------------------------------------------------------------------
def _cost(lengths: list[int], packed: bool) -> int:
    return sum(lengths) if packed else len(lengths) * max(lengths)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 40), min_size=1, max_size=30),
    max_tokens=st.integers(1, 120),
    packed=st.booleans(),
)
def test_micro_batches_by_tokens_keep_order_and_fill_up_to_the_budget(
    lengths: list[int], max_tokens: int, packed: bool
) -> None:
    batch = RolloutBatch(
        tokens=[torch.full((n,), i) for i, n in enumerate(lengths)],
        response_lengths=[1] * len(lengths),
        loss_masks=[torch.ones(1)] * len(lengths),
        rewards=torch.zeros(len(lengths)),
    )
    cut = micro_batches_by_tokens(batch, max_tokens, packed=packed)
    # Every sample once, in the batch's order.
    assert [int(t[0]) for mb in cut for t in mb.tokens] == list(range(len(lengths)))
    sizes = [[int(t.numel()) for t in mb.tokens] for mb in cut]
    for i, mb in enumerate(sizes):
        # Within the budget, unless one sample alone is over it.
        assert _cost(mb, packed) <= max_tokens or len(mb) == 1
        # Full: the next sample would not have fitted (a greedy cut, no needless micro-batch).
        if i + 1 < len(sizes):
            assert _cost([*mb, sizes[i + 1][0]], packed) > max_tokens


def test_micro_batches_by_tokens_refuse_a_budget_below_one() -> None:
    batch = RolloutBatch([torch.ones(2)], [1], [torch.ones(1)], torch.zeros(1))
    with pytest.raises(ValueError, match="max_tokens_per_gpu"):
        micro_batches_by_tokens(batch, 0, packed=False)


@pytest.mark.slow
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("phase", ["1x1", "2x1", "1x2"])
def test_dynamic_batch_size_trains_a_rollout_as_micro_batches_of_a_fixed_size_do(
    out_dir: Path, phase: str, role: str
) -> None:
    # The same rollout's training with micro-batches cut by tokens (padded and packed) instead of
    # two samples each: other cuts of the same steps, so the same metrics and weights.
    ranks = RUNS["1x1"] if phase == "1x1" else RUNS["2x1,1x2"]
    for rank in range(ranks):
        saved: dict[str, Any] = torch.load(out_dir / f"{phase}-train-dynamic-{role}-rank{rank}.pt")
        variants = {name.split("@")[1] for name in saved}
        assert variants == {"dynamic", "dynamic_packed"}
        # The cuts differ from the fixed size's (else this would compare a run with itself).
        assert saved["cuts@dynamic"][0].tolist() != saved["cuts@dynamic"][1].tolist()
        for name, (fixed, dynamic) in saved.items():
            if name.startswith("cuts@"):
                continue
            torch.testing.assert_close(
                dynamic, fixed, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("phase", ["1x1", "2x1", "1x2"])
def test_use_sequence_packing_trains_a_rollout_as_padding_does(out_dir: Path, phase: str, role: str) -> None:
    # The worker's stages (old log-probs / values, targets, two optimizer steps), packing off and on.
    ranks = RUNS["1x1"] if phase == "1x1" else RUNS["2x1,1x2"]
    for rank in range(ranks):
        saved: dict[str, Any] = torch.load(out_dir / f"{phase}-train-{role}-rank{rank}.pt")
        assert any(k.startswith("weights/") for k in saved)
        assert saved["metric:grad_norm"][0] > 1e-3 and ("metric:pg_loss" in saved) == (role == "actor")
        for name, (padded, packed) in saved.items():
            torch.testing.assert_close(
                packed, padded, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_sdpa_on_the_gpu_leaves_cudnn_out_unless_allowed() -> None:
    """cuDNN's attention builds a graph per new shape; `sdpa_backends` keeps SDPA on CUDA to the others."""
    from tandem.megatron.models.attention import allow_cudnn_attention, sdpa_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with sdpa_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with sdpa_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
    allow_cudnn_attention(True)
    try:
        with sdpa_backends(torch.device("cuda")):
            assert torch.backends.cuda.cudnn_sdp_enabled() == before
    finally:
        allow_cudnn_attention(False)
