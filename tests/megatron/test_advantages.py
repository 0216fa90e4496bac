"""Advantage whitening: local properties, and a 2-process gloo group equals whitening the concatenation."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tandem.megatron.algorithms.advantages import masked_mean_var, merge_moments, whiten_advantages
from tandem.megatron.algorithms.losses import explained_variance


@st.composite
def masked_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    batch = draw(st.integers(1, 4))
    length = draw(st.integers(1, 6))
    rows = [draw(st.lists(st.floats(-50, 50), min_size=length, max_size=length)) for _ in range(batch)]
    masks = [draw(st.lists(st.booleans(), min_size=length, max_size=length)) for _ in range(batch)]
    return torch.tensor(rows, dtype=torch.float64), torch.tensor(masks)


@settings(max_examples=60, deadline=None)
@given(masked_batches(), st.floats(allow_nan=True, allow_infinity=True))
def test_matches_torch_mean_and_std_of_the_trainable_tokens(
    case: tuple[torch.Tensor, torch.Tensor], garbage: float
) -> None:
    advantages, mask = case
    tokens = advantages[mask]
    assume(tokens.numel() >= 2)
    # Reference: torch's own mean and (unbiased) var of the selected tokens.
    expected = torch.zeros_like(advantages)
    expected[mask] = (tokens - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8)
    # Whatever sits at masked positions must neither count nor come out.
    dirty = torch.where(mask, advantages, garbage)
    got = whiten_advantages(dirty, mask)
    torch.testing.assert_close(got, expected)
    kept_mean = whiten_advantages(dirty, mask, shift_mean=False)
    expected[mask] += tokens.mean()
    torch.testing.assert_close(kept_mean, expected)


@settings(max_examples=40, deadline=None)
@given(masked_batches())
def test_whitened_tokens_have_mean_zero_and_unit_variance(case: tuple[torch.Tensor, torch.Tensor]) -> None:
    advantages, mask = case
    tokens = advantages[mask]
    assume(tokens.numel() >= 2 and tokens.var() > 1e-3)
    got = whiten_advantages(advantages, mask)
    mean, var, count = masked_mean_var(got, mask)
    assert count.item() == tokens.numel()
    assert abs(mean.item()) < 1e-9
    # Unit variance but for the `eps` under the square root: var / (var + eps), exactly.
    assert var.item() == pytest.approx(float(tokens.var() / (tokens.var() + 1e-8)), rel=1e-9)
    assert got[~mask].eq(0).all()


def test_degenerate_batches_give_zeros_not_nan() -> None:
    # Nothing trainable, a single token (no variance), and a constant batch: all whiten to 0.
    assert whiten_advantages(torch.randn(2, 3), torch.zeros(2, 3)).eq(0).all()
    single = whiten_advantages(torch.tensor([[5.0, 7.0]]), torch.tensor([[0, 1]]))
    torch.testing.assert_close(single, torch.zeros(1, 2))
    constant = whiten_advantages(torch.full((2, 2), 3.0), torch.ones(2, 2))
    torch.testing.assert_close(constant, torch.zeros(2, 2))


def test_output_is_detached_in_the_input_dtype() -> None:
    advantages = torch.randn(2, 3, dtype=torch.bfloat16, requires_grad=True)
    got = whiten_advantages(advantages, torch.ones(2, 3))
    assert got.dtype == torch.bfloat16 and not got.requires_grad


@pytest.mark.parametrize("eps", [0.0, -1e-8])
def test_bad_eps(eps: float) -> None:
    with pytest.raises(ValueError, match="`eps`"):
        whiten_advantages(torch.randn(2, 3), torch.ones(2, 3), eps=eps)


def test_mask_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="`loss_mask`"):
        whiten_advantages(torch.randn(2, 3), torch.ones(2, 4))


def _exact_mean_m2(values: list[float]) -> tuple[float, float]:
    """Mean and sum of squared deviations of the floats as stored, in exact rational arithmetic."""
    exact = [Fraction(v) for v in values]
    mean = sum(exact, Fraction(0)) / len(exact)
    return float(mean), float(sum(((v - mean) ** 2 for v in exact), Fraction(0)))


def _two_pass(values: torch.Tensor) -> list[float]:
    """One part's `(count, mean, M2)` as each rank computes it: the mean, then the squared deviations."""
    if values.numel() == 0:
        return [0.0, 0.0, 0.0]
    mean = values.mean()
    return [float(values.numel()), float(mean), float((values - mean).square().sum())]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=40),
    st.lists(st.integers(0, 40), min_size=0, max_size=5),
)
def test_merged_moments_of_parts_are_the_wholes(values: list[float], cuts: list[int]) -> None:
    # Any split into parts (empty ones included), each reduced on its own, merges into the moments of the whole.
    data = torch.tensor(values, dtype=torch.float64)
    bounds = [0, *sorted(min(c, len(values)) for c in cuts), len(values)]
    parts = torch.tensor([_two_pass(data[a:b]) for a, b in itertools.pairwise(bounds)], dtype=torch.float64)
    count, mean, m2 = merge_moments(parts.view(-1, 3))
    exact_mean, exact_m2 = _exact_mean_m2(values)
    assert count.item() == len(values)
    assert mean.item() == pytest.approx(exact_mean, rel=1e-12, abs=1e-9)
    assert m2.item() == pytest.approx(exact_m2, rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("ratio", [1e4, 1e7, 1e8, 1e10])
def test_variance_keeps_its_precision_when_the_mean_dwarfs_the_spread(ratio: float) -> None:
    # Advantages `ratio` standard deviations away from 0, over three "ranks" of unequal sizes.
    # The one-pass E[x²] − E[x]² cancels about ratio² · 1e-16 of the variance: 1 % at 1e7, all of it
    # at 1e8. Two passes per part and Chan's merge lose only about ratio · 1e-16 of it.
    generator = torch.Generator().manual_seed(int(ratio) % 1000)
    data = ratio + torch.randn(60, generator=generator, dtype=torch.float64)
    exact_mean, exact_m2 = _exact_mean_m2(data.tolist())
    mean, var, count = masked_mean_var(data[None, :], torch.ones(1, 60, dtype=torch.bool), unbiased=True)
    assert count.item() == 60
    assert mean.item() == pytest.approx(exact_mean, rel=1e-15)
    assert var.item() == pytest.approx(exact_m2 / 59, rel=1e-5)
    parts = torch.tensor(
        [_two_pass(data[:7]), _two_pass(data[7:7]), _two_pass(data[7:])], dtype=torch.float64
    )
    merged_count, merged_mean, merged_m2 = merge_moments(parts)
    assert merged_count.item() == 60
    assert merged_mean.item() == pytest.approx(exact_mean, rel=1e-15)
    assert merged_m2.item() == pytest.approx(exact_m2, rel=1e-5)
    one_pass = (data.square().mean() - data.mean().square()).item() * 60
    if ratio >= 1e8:  # what the test guards against: the one-pass form is far off here
        assert one_pass != pytest.approx(exact_m2, rel=1e-2)


_WORKER = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist

    from tandem.megatron.algorithms.advantages import whiten_advantages
    from tandem.megatron.algorithms.losses import explained_variance

    rank, folder = int(sys.argv[1]), sys.argv[2]
    store = dist.FileStore(f"{folder}/store", 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    shard = torch.load(f"{folder}/in{rank}.pt")
    subgroup = dist.new_group([0, 1])
    torch.save(
        {
            "default": whiten_advantages(shard["advantages"], shard["mask"]),
            "group": whiten_advantages(shard["advantages"], shard["mask"], group=subgroup),
            "kept_mean": whiten_advantages(shard["advantages"], shard["mask"], shift_mean=False),
            "ev": explained_variance(shard["values"], shard["returns"], shard["mask"], group=subgroup),
        },
        f"{folder}/out{rank}.pt",
    )
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_two_process_group_equals_whitening_the_concatenation(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    # Ranks hold different numbers of samples of different padded lengths and scales;
    # rank 1 has an all-masked row.
    shapes = {0: (3, 5), 1: (2, 7)}
    shards = {}
    for rank, shape in shapes.items():
        mask = torch.rand(shape, generator=generator) < 0.7
        if rank == 1:
            mask[0] = False
        scale = 1.0 + 4.0 * rank
        shards[rank] = {
            "advantages": torch.where(mask, scale * torch.randn(shape, generator=generator) + rank, 0.0),
            "values": torch.randn(shape, generator=generator),
            "returns": torch.randn(shape, generator=generator),
            "mask": mask,
        }
        torch.save(shards[rank], tmp_path / f"in{rank}.pt")

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(tmp_path)], stderr=subprocess.PIPE, text=True
        )
        for rank in shapes
    ]
    for worker in workers:
        _, stderr = worker.communicate(timeout=600)
        assert worker.returncode == 0, stderr

    width = max(length for _, length in shapes.values())

    def concat(key: str) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(shards[r][key], (0, width - shapes[r][1])) for r in shapes])

    whole_mask = concat("mask")
    expected = whiten_advantages(concat("advantages"), whole_mask)
    expected_kept = whiten_advantages(concat("advantages"), whole_mask, shift_mean=False)
    expected_ev = explained_variance(concat("values"), concat("returns"), whole_mask)
    offset = 0
    for rank, (batch, length) in shapes.items():
        got = torch.load(tmp_path / f"out{rank}.pt")
        rows = slice(offset, offset + batch)
        torch.testing.assert_close(got["default"], expected[rows, :length])
        torch.testing.assert_close(got["group"], expected[rows, :length])
        torch.testing.assert_close(got["kept_mean"], expected_kept[rows, :length])
        torch.testing.assert_close(got["ev"], expected_ev)
        offset += batch
    # The check has teeth: whitening each shard on its own differs from the group result.
    alone = whiten_advantages(shards[0]["advantages"], shards[0]["mask"])
    assert not torch.allclose(alone, expected[:3, :5])
