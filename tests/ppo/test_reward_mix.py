"""Weighted rewards: each sample's reward is the weighted sum of its terms, and each term is kept as a metric."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.ppo.engines import Generation
from tandem.ppo.rollout import Rollout
from tandem.ppo.rollout.data import PromptRecord, PromptSample
from tandem.ppo.rollout.reward_mix import RewardMix, ScoreRequest, build_reward, combine, parse_reward_weights
from tandem.ppo.rollout.rewards import RewardInput, exact_match
from tandem.ppo.rollout.samples import generate_samples, score_requests, score_rollout

finite = st.floats(-100, 100, allow_nan=False)


def inputs_and_requests(
    labels: list[str], responses: list[str]
) -> tuple[list[RewardInput], list[ScoreRequest]]:
    record = PromptRecord(index=0, prompt="p", messages=None, label=None)
    prompt = PromptSample(record, [5, 6], "p")
    inputs = [
        RewardInput("p", r, label, index=i)
        for i, (label, r) in enumerate(zip(labels, responses, strict=True))
    ]
    requests = [ScoreRequest(prompt, [7 + i], r) for i, r in enumerate(responses)]
    return inputs, requests


@given(
    data=st.data(),
    n=st.integers(1, 8),
    w_model=finite,
    w_rule=finite,
)
def test_rewards_are_the_weighted_sum_of_the_terms(
    data: st.DataObject, n: int, w_model: float, w_rule: float
) -> None:
    scores = data.draw(st.lists(finite, min_size=n, max_size=n))
    responses = data.draw(st.lists(st.sampled_from(["1", "2"]), min_size=n, max_size=n))
    inputs, _ = inputs_and_requests(["1"] * n, responses)
    mix = RewardMix({"model": w_model, "exact_match": w_rule}, {"exact_match": exact_match})
    assert mix.has_model
    mixed = mix.compute(inputs, scores)  # the reward model's scores, from its `score` turn
    rule = [float(r == "1") for r in responses]
    assert mixed.terms == {"model": scores, "exact_match": rule}
    for reward, s, e in zip(mixed.rewards, scores, rule, strict=True):
        assert reward == pytest.approx(w_model * s + w_rule * e, abs=1e-9)
    assert set(mixed.seconds) == {"reward"}


def test_parse_reward_weights_keeps_the_order_written() -> None:
    assert parse_reward_weights(" exact_match = 0.5, model=1") == {"exact_match": 0.5, "model": 1.0}
    assert list(parse_reward_weights("model=1,exact_match=-2,math=0,custom=3e-1")) == [
        "model",
        "exact_match",
        "math",
        "custom",
    ]


def test_combine_refuses_a_term_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="'model' has 1 values for 2 samples"):
        combine({"model": 1.0}, {"model": [0.5]}, 2)


def test_a_model_term_that_returns_too_few_scores_fails_loudly() -> None:
    inputs, _ = inputs_and_requests(["1", "1"], ["1", "2"])
    mix = RewardMix({"model": 1.0}, {})
    with pytest.raises(RuntimeError, match="returned 1 scores for 2 samples"):
        mix.compute(inputs, [0.0])
    with pytest.raises(ValueError, match="needs the reward model's scores"):
        mix.compute(inputs)


class Config:
    """The reward fields of a PPOConfig."""

    def __init__(self, **fields: Any) -> None:
        self.rm_type, self.custom_rm_path, self.reward_weights = "exact_match", None, None
        self.__dict__.update(fields)


def test_one_rule_term_stays_the_plain_function() -> None:
    # No mix for the plain runs: their rewards and metrics are exactly what they were.
    assert build_reward(Config()) is exact_match
    assert isinstance(build_reward(Config(reward_weights="exact_match=2")), RewardMix)
    mix = build_reward(Config(rm_type="model"))
    assert isinstance(mix, RewardMix) and dict(mix.weights) == {"model": 1.0}


def test_a_rollout_keeps_the_terms_and_reports_their_means() -> None:
    class Engines:
        def generate(self, prompts: list[list[int]], params: Any) -> list[Generation]:
            return [Generation([10 + i], [-0.1], "stop") for i in range(len(prompts))]

    class Tokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return str(ids[0] % 2)

    record = PromptRecord(index=0, prompt="p", messages=None, label="1")
    prompts = [PromptSample(record, [3, 4], "p")]
    mix = RewardMix({"model": 2.0, "exact_match": 1.0}, {"exact_match": exact_match})
    samples = generate_samples(Engines(), prompts, n_samples_per_prompt=4, params=None, tokenizer=Tokenizer())
    requests = score_requests(samples)  # what the reward model's `score` turn is given
    rollout = score_rollout(samples, mix, [float(i) for i in range(len(requests))])
    # Responses 10..13 decode to "0","1","0","1"; the model scores 0,1,2,3.
    assert rollout.reward_terms == {"model": [0.0, 1.0, 2.0, 3.0], "exact_match": [0.0, 1.0, 0.0, 1.0]}
    assert rollout.rewards == [0.0, 3.0, 4.0, 7.0]
    assert [list(r.response_ids) for r in requests] == [[10], [11], [12], [13]]
    metrics = rollout.metrics(accuracy_threshold=1.0)
    assert (
        metrics["reward/model"] == 1.5
        and metrics["reward/exact_match"] == 0.5
        and metrics["reward/mean"] == 3.5
    )
    # Selections and concatenations (dynamic sampling) carry the terms along.
    part = rollout.select([3, 0])
    assert part.reward_terms == {"model": [3.0, 0.0], "exact_match": [1.0, 0.0]}
    whole = Rollout.concat([part, rollout.select([1])])
    assert whole.reward_terms["model"] == [3.0, 0.0, 1.0]
