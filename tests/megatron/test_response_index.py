"""`ResponseIndex`: one gather and one scatter give what per-sample slices gave, values and gradients;
`HeadRows`: the head at those positions alone gives the whole head's logits there."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.batch import RolloutBatch, pad_responses
from tandem.megatron.models.head_rows import HeadRows
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


@settings(max_examples=40, deadline=None)
@given(samples, st.booleans())
def test_the_head_at_response_rows_gives_the_whole_heads_logits_and_gradients_there(
    lengths: list[tuple[int, int]], packed: bool
) -> None:
    """`HeadRows.only(index.hidden_rows(...))` on Megatron's `[s, b, h]` hidden states: the head computes
    the response positions alone, in the index's order, as the whole head's logits there, and the
    gradient reaching the hidden states is the same."""
    mb = _batch(lengths)
    row = pack_lengths([p + r for p, r in lengths], 1) if packed else None
    seq = row.total if row is not None else max(p + r for p, r in lengths)
    n_rows = 1 if packed else len(lengths)
    index = ResponseIndex.of(response_rows(mb, row), seq, torch.device("cpu"))
    head = torch.nn.Linear(4, 7)
    picker = HeadRows(head)
    hidden = torch.randn(seq, n_rows, 4, requires_grad=True)  # Megatron's [s, b, h]
    whole = head(hidden).transpose(0, 1)  # GPTModel returns [b, s, vocab]
    with picker.only(index.hidden_rows(n_rows, seq)):
        picked = head(hidden)
    assert picked.shape == (index.source.numel(), 1, 7)
    torch.testing.assert_close(picked[:, 0], index.gather(whole), rtol=0, atol=1e-6)
    # The hook is spent: the next forward is the whole head again.
    assert head(hidden).shape == (seq, n_rows, 7)

    weights = torch.randn(index.source.numel(), 7)
    (grad,) = torch.autograd.grad((picked[:, 0] * weights).sum(), hidden)
    (expected,) = torch.autograd.grad((index.gather(whole) * weights).sum(), hidden)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6)
    # Only the picked positions get a gradient (prompts and padding none).
    touched = torch.zeros(seq * n_rows, dtype=torch.bool)
    touched[index.hidden_rows(n_rows, seq)] = True
    assert not grad.reshape(seq * n_rows, 4)[~touched].any()


def test_head_rows_refuse_a_sequence_parallel_head_and_a_2d_index() -> None:
    head = torch.nn.Linear(4, 7)
    picker = HeadRows(head)
    with pytest.raises(ValueError, match="1-D index"), picker.only(torch.zeros(2, 2, dtype=torch.long)):
        pass
    head.sequence_parallel = True  # as Megatron's ColumnParallelLinear carries it
    with pytest.raises(ValueError, match="sequence_parallel=False"), picker.only(torch.arange(2)):
        pass
