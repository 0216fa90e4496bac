"""Rollout assembly: per-rank splits keep samples in order; dynamic sampling keeps only prompts with signal."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tandem.ppo.data import PromptRecord, PromptSample
from tandem.ppo.engines import Generation
from tandem.ppo.rollout import Rollout, dynamic_sample, to_train_batches


def fake_rollout(prompt_ids: list[int], n: int, reward_of: Any) -> Rollout:
    """`n` samples of each prompt; sample j of prompt p gets `reward_of(p, j)`."""
    prompts, generations, rewards = [], [], []
    for p in prompt_ids:
        record = PromptRecord(index=p, prompt=str(p), messages=None, label=None, metadata={})
        sample = PromptSample(record=record, prompt_ids=[1, 2 + p % 5], prompt_text=str(p))
        for j in range(n):
            prompts.append(sample)
            generations.append(Generation(token_ids=[3 + j % 4], log_probs=[-1.0], finish_reason="stop"))
            rewards.append(float(reward_of(p, j)))
    return Rollout(prompts, generations, [""] * len(prompts), rewards, {"generate": 1.0, "reward": 0.5})


def test_constant_reward_prompts_are_dropped() -> None:
    """Even prompts always get reward 1 (no signal); odd prompts get 0 or 1: batches hold odd prompts only."""
    counter = itertools.count()

    def draw(num: int) -> Rollout:
        ids = [next(counter) for _ in range(num)]
        return fake_rollout(ids, 4, lambda p, j: 1.0 if p % 2 == 0 else float(j % 2))

    rollout, counts = dynamic_sample(draw, num_prompts=8, n_samples_per_prompt=4, max_rounds=4)
    assert len(rollout) == 32
    assert {s.record.index % 2 for s in rollout.prompts} == {1}
    assert counts["dynamic/rounds"] == 2 and counts["dynamic/filled_prompts"] == 0
    assert counts["dynamic/dropped_prompts"] == 8
    assert rollout.seconds["generate"] == 2.0  # both rounds' cost is counted


def test_a_short_batch_is_filled_and_counted() -> None:
    counter = itertools.count()

    def draw(num: int) -> Rollout:
        ids = [next(counter) for _ in range(num)]
        return fake_rollout(ids, 2, lambda p, j: 0.0 if p % 4 else float(j))  # 1 prompt in 4 has signal

    rollout, counts = dynamic_sample(draw, num_prompts=8, n_samples_per_prompt=2, max_rounds=2)
    assert len(rollout) == 16
    assert counts["dynamic/kept_prompts"] == 4 and counts["dynamic/filled_prompts"] == 4


@given(ranks=st.sampled_from([1, 2, 4]), per_rank=st.integers(1, 6), n=st.integers(1, 3))
def test_train_batches_split_contiguously_in_order(ranks: int, per_rank: int, n: int) -> None:
    total = ranks * per_rank * n
    rollout = fake_rollout(list(range(total // n)), n, lambda p, j: p * 10 + j)
    batches = to_train_batches(rollout, ranks)
    assert [i for b in batches for i in b.sample_indices] == list(range(total))
    for b in batches:
        for k, i in enumerate(b.sample_indices):
            assert float(b.rewards[k]) == rollout.rewards[i]
            assert b.tokens[k].tolist() == [*rollout.prompts[i].prompt_ids, *rollout.generations[i].token_ids]
            assert b.response_lengths[k] == len(rollout.generations[i].token_ids)
