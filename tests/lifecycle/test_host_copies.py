"""HostCopies: exact host copies of tensors in one buffer of their bytes (page-aligned), independent of the sources."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.lifecycle import HostCopies

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
_PAGE = 4096


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 100, shape, generator=g).to(dtype)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 9), min_size=0, max_size=3)),
        min_size=0,
        max_size=6,
    ),
    st.integers(0, 2**16),
)
def test_the_copies_equal_their_sources_and_fill_one_buffer_of_their_bytes(
    specs: list[tuple[torch.dtype, list[int]]], seed: int
) -> None:
    sources = [_tensor(d, tuple(shape), seed + i) for i, (d, shape) in enumerate(specs)]
    copies = HostCopies(sources)

    assert len(copies) == len(sources)
    for copy, source in zip(copies, sources, strict=True):
        assert copy.dtype == source.dtype and copy.shape == source.shape
        assert torch.equal(copy, source)
        assert copy.untyped_storage().data_ptr() == copies.buffer.tensor.untyped_storage().data_ptr()
    # Exactly the bytes, each copy starting on its own page: nothing rounded to a power of two.
    pages = sum(-(-(t.numel() * t.element_size()) // _PAGE) * _PAGE for t in sources[:-1])
    last = sources[-1].numel() * sources[-1].element_size() if sources else 0
    assert copies.buffer.nbytes == -(-(pages + last) // _PAGE) * _PAGE
    # Copies, not views: writing the sources leaves them alone, and they do not overlap.
    for s in sources:
        s.zero_() if s.dtype != torch.bool else s.fill_(False)
    for c in copies:
        c.fill_(True) if c.dtype == torch.bool else c.fill_(7)
    for c, s in zip(copies, sources, strict=True):
        assert torch.equal(c, torch.full_like(s, True if s.dtype == torch.bool else 7))


def test_non_contiguous_sources_are_copied_by_value() -> None:
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    source = base.t()[1:5]
    (copy,) = HostCopies([source])
    assert copy.is_contiguous() and torch.equal(copy, source)


def test_without_cuda_tensors_the_buffer_is_pageable() -> None:
    copies = HostCopies([torch.ones(3)], host_memory="registered")
    assert not copies.buffer.tensor.is_pinned()


def test_an_unknown_host_memory_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"host_memory='locked'.*registered.*pinned.*pageable"):
        HostCopies([torch.ones(1)], host_memory="locked")  # type: ignore[arg-type]
