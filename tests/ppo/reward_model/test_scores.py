"""The reward-model worker's scores are transformers' own, however the samples are batched; it sleeps and wakes.

References come from `AutoModelForSequenceClassification` itself: the same samples,
padded left and right with pad = EOS and an attention mask, in one batch; its
`logits` are read at the rightmost non-pad token (a trailing EOS skipped), and our
worker must give the same numbers for the unpadded samples, with budgets that cut
them into one batch or many.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.ppo.rollout.reward_model import RewardModelOptions, score_position, token_budget_batches

from .conftest import EOS, VOCAB

FP32_ATOL = 1e-5


def samples() -> list[list[int]]:
    """Samples of many lengths: ending in EOS, in two EOS, with an EOS inside, and without one."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for n in (3, 17, 9, 1, 25, 12, 6, 30):
        out.append([int(t) for t in torch.randint(2, VOCAB, (n,), generator=gen)])
    out[0] += [EOS]
    out[1] += [EOS, EOS]
    out[2][4] = EOS
    out[4] += [EOS]
    return out


def reference(model: Any, rows: list[list[int]], side: str) -> torch.Tensor:
    """transformers' scores of `rows` as one batch padded on `side` with the pad id (EOS)."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), EOS, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        span = slice(0, len(r)) if side == "right" else slice(longest - len(r), longest)
        ids[i, span] = torch.tensor(r)
        mask[i, span] = 1
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()


@pytest.fixture(scope="module")
def workers(reward_model_folder: Any) -> dict[str, Any]:
    from tandem.ppo.rollout.reward_model import RewardModelWorker

    out = {}
    for family in ("llama", "qwen2"):
        folder, model = reward_model_folder(family)
        out[family] = (RewardModelWorker(str(folder), RewardModelOptions(max_tokens_per_batch=40)), model)
        out[f"{family}-folder"] = folder
    return out


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_scores_equal_transformers_padded_either_side(
    workers: dict[str, Any], family: str, side: str
) -> None:
    worker, model = workers[family]
    rows = samples()
    expected = reference(model, rows, side)
    ours = torch.tensor(worker.score(rows))
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() < FP32_ATOL, (ours, expected)
    # The reference is not trivially equal to other readings: the last token's output differs
    # where a sample ends in EOS, so the position rule matters.
    with torch.no_grad():
        last = torch.stack(
            [model.score(model.model(torch.tensor([r])).last_hidden_state)[0, -1, 0] for r in rows]
        )
    assert (last[0] - expected[0]).abs().item() > 100 * FP32_ATOL


def test_scores_do_not_depend_on_the_batching(workers: dict[str, Any]) -> None:
    from tandem.ppo.rollout.reward_model import RewardModelWorker

    worker, _ = workers["llama"]
    whole = RewardModelWorker(str(workers["llama-folder"]), RewardModelOptions(max_tokens_per_batch=10_000))
    one_batch = whole.score(samples())
    many = worker.score(samples())  # a budget of 40 tokens: about one sample a batch
    alone = [worker.score([r])[0] for r in samples()]
    assert torch.allclose(torch.tensor(one_batch), torch.tensor(many), atol=FP32_ATOL)
    assert torch.allclose(torch.tensor(alone), torch.tensor(many), atol=FP32_ATOL)


def test_a_model_without_a_pad_id_scores_the_last_token(reward_model_folder: Any) -> None:
    from tandem.ppo.rollout.reward_model import RewardModelWorker

    folder, model = reward_model_folder("qwen2", pad_token_id=None)
    worker = RewardModelWorker(str(folder), RewardModelOptions(max_tokens_per_batch=64))
    rows = samples()
    with torch.no_grad():  # transformers scores a batch of one without a pad id: its last token
        expected = torch.stack([model(input_ids=torch.tensor([r])).logits[0, 0] for r in rows])
    assert torch.allclose(torch.tensor(worker.score(rows)), expected, atol=FP32_ATOL)


def test_sleep_and_wake_give_back_the_same_scores(workers: dict[str, Any]) -> None:
    from tandem.ppo.rollout.reward_model import RewardModelAsleepError

    worker, _ = workers["qwen2"]
    before = worker.score(samples())
    worker.sleep()
    assert worker.asleep()
    assert all(p.untyped_storage().size() == 0 for p in worker.model.parameters())  # freed, not copied
    with pytest.raises(RewardModelAsleepError, match="wake_up"):
        worker.score(samples())
    worker.sleep()  # a second sleep does nothing
    worker.wake_up()
    worker.wake_up()
    assert not worker.asleep()
    assert worker.score(samples()) == before


def test_bad_samples_are_refused_naming_the_sample(workers: dict[str, Any]) -> None:
    worker, _ = workers["llama"]
    with pytest.raises(ValueError, match="sample 1 has no tokens"):
        worker.score([[2, 3], []])
    with pytest.raises(ValueError, match=r"sample 0 has token ids outside .* \[0, 48\)"):
        worker.score([[2, VOCAB + 5]])


@given(ids=st.lists(st.sampled_from([EOS, 2, 3, 7]), min_size=1, max_size=12), pad=st.sampled_from([EOS, 7]))
def test_score_position_is_transformers_rule(ids: list[int], pad: int) -> None:
    # transformers' own expression (GenericForSequenceClassification.forward), padded on either side.
    for left in (0, 3):
        row = torch.tensor([[pad] * left + ids])
        non_pad = (row != pad).int()
        expected = int((torch.arange(row.shape[-1]) * non_pad).argmax(-1))
        assert score_position([pad] * left + ids, pad) == expected
        if any(t != pad for t in ids):
            assert score_position(ids, pad) == expected - left
    assert score_position(ids, None) == len(ids) - 1


@given(lengths=st.lists(st.integers(1, 50), max_size=30), budget=st.integers(1, 120))
def test_token_budget_batches_cover_every_sample_once_within_the_budget(
    lengths: list[int], budget: int
) -> None:
    batches = token_budget_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert lengths[b[0]] == longest
        assert len(b) * longest <= budget or len(b) == 1
    # Longest first, and greedy: a batch ends only when the next sample would not fit.
    order = [i for b in batches for i in b]
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True)
    for b in batches[:-1]:
        assert (len(b) + 1) * lengths[b[0]] > budget
