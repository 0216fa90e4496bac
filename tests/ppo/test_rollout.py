"""Rollout assembly: per-rank splits keep samples in order; dynamic sampling keeps only prompts with signal."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.ppo.engines import Generation
from tandem.ppo.rollout import Rollout, dynamic_sample, to_train_batches
from tandem.ppo.rollout.data import PromptRecord, PromptSample


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


@given(
    n=st.integers(2, 5),
    tied=st.lists(st.booleans(), min_size=1, max_size=12),
)
def test_tied_groups_is_the_share_of_prompts_whose_samples_all_scored_the_same(
    n: int, tied: list[bool]
) -> None:
    # Prompt p's samples score (p, p, ..., p) when tied, else (p, p, ..., p + 1) for its last sample.
    rollout = fake_rollout(list(range(len(tied))), n, lambda p, j: p + (j == n - 1 and not tied[p]))
    metrics = rollout.metrics(accuracy_threshold=1.0, n_samples_per_prompt=n)
    assert metrics["reward/tied_groups"] == pytest.approx(sum(tied) / len(tied))
    assert "reward/tied_groups" not in rollout.metrics(
        accuracy_threshold=1.0
    )  # one sample a prompt: no groups


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


def long_rollout(lengths: list[int], finish: list[str], rewards: list[float]) -> Rollout:
    record = PromptRecord(index=0, prompt="p", messages=None, label=None, metadata={})
    sample = PromptSample(record=record, prompt_ids=[1, 2], prompt_text="p")
    generations = [
        Generation(token_ids=[5] * n, log_probs=[-1.0] * n, finish_reason=f)  # type: ignore[arg-type]
        for n, f in zip(lengths, finish, strict=True)
    ]
    return Rollout([sample] * len(lengths), generations, [""] * len(lengths), rewards)


def test_training_rewards_add_the_overlong_penalty_and_keep_the_task_reward() -> None:
    from tandem.ppo.config.file import unvalidated
    from tandem.ppo.rollout import training_rewards

    rollout = long_rollout([2, 7, 8, 10], ["stop", "stop", "stop", "length"], [1.0, 1.0, 0.0, 1.0])
    off = unvalidated({"rollout_max_response_len": 10})
    assert training_rewards(rollout, off) == ([1.0, 1.0, 0.0, 1.0], {})
    on = unvalidated(
        {"rollout_max_response_len": 10, "overlong_buffer_len": 4, "overlong_penalty_factor": 2.0}
    )
    rewards, metrics = training_rewards(rollout, on)
    # L_max 10, L_cache 4: free up to 6 tokens; then -2/4 per token (factor 2): 7 -> -0.5, 8 -> -1, 10 -> -2.
    assert rewards == pytest.approx([1.0, 0.5, -1.0, -1.0])
    assert metrics["reward/overlong_penalty"] == pytest.approx(-3.5 / 4)
    assert metrics["reward/shaped_mean"] == pytest.approx(-0.5 / 4)
    assert rollout.rewards == [1.0, 1.0, 0.0, 1.0]  # the task reward, for the reward/ metrics
    (batch,) = to_train_batches(rollout, 1, rewards=rewards)
    assert batch.rewards.tolist() == pytest.approx([1.0, 0.5, -1.0, -1.0])


def test_filter_truncated_masks_out_only_the_cut_responses() -> None:
    rollout = long_rollout([3, 4, 4, 2], ["stop", "length", "length", "abort"], [0.0, 1.0, 0.0, 1.0])
    kept, filtered = to_train_batches(rollout, 1)[0], to_train_batches(rollout, 1, filter_truncated=True)[0]
    assert [m.tolist() for m in kept.loss_masks] == [[1.0] * 3, [1.0] * 4, [1.0] * 4, [1.0] * 2]
    assert [m.tolist() for m in filtered.loss_masks] == [[1.0] * 3, [0.0] * 4, [0.0] * 4, [1.0] * 2]
    assert filtered.rewards.tolist() == kept.rewards.tolist()  # still in their group's baseline


def test_truncated_counts_only_responses_that_a_stop_token_could_have_ended() -> None:
    """`truncated`: finish reason `length` where EOS was possible. A one-token limit (the demo's
    one-digit answer) leaves no room for EOS after an answer; with `ignore_eos` or no stop token at all
    every response runs to the limit by design."""
    from tandem.ppo.engines import SamplingParams

    rollout = fake_rollout([0, 1], 2, lambda p, j: 0.0)
    rollout.generations[0] = Generation(token_ids=[3], log_probs=[-1.0], finish_reason="length")
    rollout.generations[3] = Generation(token_ids=[4], log_probs=[-1.0], finish_reason="length")

    def truncated(**params: Any) -> float:
        rollout.params = SamplingParams(**params)
        return rollout.metrics(accuracy_threshold=1.0, prefix="eval")["eval/truncated"]

    assert truncated(max_new_tokens=8, stop_token_ids=(2,)) == 0.5
    assert truncated(max_new_tokens=1, stop_token_ids=(2,)) == 0.0
    assert truncated(max_new_tokens=8, stop_token_ids=(2,), ignore_eos=True) == 0.0
    assert truncated(max_new_tokens=8, stop_token_ids=()) == 0.0
    assert rollout.select([0, 1]).metrics(accuracy_threshold=1.0)["reward/truncated"] == 0.0  # params carried
    assert Rollout.concat([rollout, rollout]).params == rollout.params


def test_roles_of_the_same_shares_get_the_same_batches_built_and_put_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`shard_per_role`: each distinct data-parallel size is cut and put in the object store once; roles of
    the same size share its refs and sample indices, a role with a layout of its own gets its own."""
    from tandem.ppo.rollout import train_batches

    put: list[Any] = []
    monkeypatch.setattr(train_batches.ray, "put", lambda batch: put.append(batch) or f"ref{len(put) - 1}")
    cuts: list[int] = []
    cut = train_batches.to_train_batches
    monkeypatch.setattr(
        train_batches, "to_train_batches", lambda r, dp, **kw: cuts.append(dp) or cut(r, dp, **kw)
    )
    rollout = fake_rollout(list(range(4)), 2, lambda p, j: p + j)
    refs, indices = train_batches.shard_per_role(rollout, {"actor": 2, "critic": 2, "reward_model": 4})
    assert cuts == [2, 4], "each size cut once"
    assert refs["actor"] is refs["critic"] and indices["actor"] == indices["critic"]
    assert refs["actor"] == ["ref0", "ref1"] and refs["reward_model"] == ["ref2", "ref3", "ref4", "ref5"]
    assert len(put) == 6, "two shares for the size 2, four for the size 4, each put once"
    assert indices["actor"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and indices["reward_model"][3] == [6, 7]
