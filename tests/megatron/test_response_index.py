"""`ResponseIndex`: one gather and one scatter give what per-sample slices gave, values and gradients."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.batch import RolloutBatch, pad_responses
from tandem.megatron.models.packing import pack_lengths
from tandem.megatron.worker.response_outputs import ResponseIndex, response_rows


def _batch(draw_lengths: list[tuple[int, int]]) -> RolloutBatch:
    tokens = [torch.arange(p + r) + 3 * i for i, (p, r) in enumerate(draw_lengths)]
    return RolloutBatch(
        tokens=tokens,
        response_lengths=[r for _, r in draw_lengths],
        loss_masks=[torch.ones(r) for _, r in draw_lengths],
        rewards=torch.zeros(len(draw_lengths)),
    )


samples = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(samples, st.booleans(), st.integers(1, 3))
def test_gather_and_padding_equal_the_per_sample_slices(
    lengths: list[tuple[int, int]], packed: bool, vocab: int
) -> None:
    mb = _batch(lengths)
    row = pack_lengths([p + r for p, r in lengths], 1) if packed else None
    rows = response_rows(mb, row)
    seq = row.total if row is not None else max(p + r for p, r in lengths)
    n_rows = 1 if packed else len(lengths)
    output = torch.randn(n_rows, seq, vocab, requires_grad=True)
    tokens = torch.randint(0, 50, (n_rows, seq))
    index = ResponseIndex.of(rows, seq, torch.device("cpu"))

    picked = index.gather(output)
    # The reference: one slice per sample, as the positions were picked before.
    expected = torch.cat([output[i, begin:end] for i, begin, end in rows])
    assert torch.equal(picked, expected)
    assert torch.equal(index.targets(tokens), torch.cat([tokens[i, b + 1 : e + 1] for i, b, e in rows]))

    padded = index.padded(picked.sum(-1))
    reference = pad_responses(expected.sum(-1).split([e - b for _, b, e in rows]))
    assert torch.equal(padded, reference)

    weights = torch.randn_like(padded)
    (grad,) = torch.autograd.grad((padded * weights).sum(), output)
    (expected_grad,) = torch.autograd.grad((reference * weights).sum(), output)
    assert torch.equal(grad, expected_grad)
