"""DAPO's soft overlong punishment against eq. 13 of the paper, written out case by case."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.algorithms.reward_shaping import overlong_penalty


def dapo_eq13(length: int, max_len: int, cache: int) -> float:
    """R_length(y) of DAPO (Yu et al. 2025, eq. 13), one response."""
    if length <= max_len - cache:
        return 0.0
    if length <= max_len:
        return ((max_len - cache) - length) / cache
    return -1.0


@settings(deadline=None)
@given(
    max_len=st.integers(1, 64),
    data=st.data(),
    factor=st.floats(0.0, 4.0),
)
def test_matches_the_paper(max_len: int, data: st.DataObject, factor: float) -> None:
    cache = data.draw(st.integers(1, max_len))
    lengths = data.draw(st.lists(st.integers(0, max_len + 5), min_size=1, max_size=12))
    got = overlong_penalty(torch.tensor(lengths), max_len, cache, factor)
    expected = [factor * dapo_eq13(n, max_len, cache) for n in lengths]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=1e-6)


def test_a_worked_example() -> None:
    # L_max = 10, L_cache = 4: free up to 6 tokens, then -1/4 per token, -1 from 10 on.
    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 10, 12]), 10, 4, 1.0)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(torch.tensor([8]), 10, 4, 0.5).tolist() == [-0.25]


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((10, 0, 1.0), "buffer_len"),
        ((10, 11, 1.0), "buffer_len"),
        ((0, 1, 1.0), "max_response_len"),
        ((10, 4, -1.0), "penalty_factor"),
    ],
)
def test_bad_arguments_name_themselves(args: tuple[int, int, float], name: str) -> None:
    with pytest.raises(ValueError, match=f"`{name}`"):
        overlong_penalty(torch.tensor([1]), *args)
