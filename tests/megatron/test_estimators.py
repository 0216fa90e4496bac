"""The critic-free advantage estimators against references written here from each paper's formula.

Every reference works on Python floats, one group or one response at a time, the
way the paper writes it (GRPO: DeepSeekMath §4.1.2; Dr.GRPO: Liu et al. 2025
§3.1; RLOO: Ahmadian et al. 2024 eq. 7; REINFORCE++: Hu et al. 2025 eq. 8-10).
Hypothesis draws group sizes, rewards from a small set (so that ties, including
whole tied groups, are frequent) and from all floats in a range, and arbitrary
masks (holes, all-masked rows).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.algorithms.advantages import whiten_advantages
from tandem.megatron.algorithms.estimators import (
    GRPO_EPS,
    discounted_returns,
    group_centered_rewards,
    grpo_advantages,
    outcome_advantages,
    rloo_advantages,
    sample_signal,
    tied_groups,
    token_advantages,
    whitens,
)
from tandem.megatron.algorithms.kl import kl_penalized_rewards


# --- references, from the papers' formulas ----------------------------------------------------------
def ref_grpo(group: list[float], std_normalization: bool) -> list[float]:
    """A_i = (r_i − mean) / (std + ε), std with Bessel's correction; Dr.GRPO: r_i − mean. A tie gives 0."""
    if len(set(group)) == 1:
        return [0.0] * len(group)
    g = len(group)
    mean = sum(group) / g
    if not std_normalization:
        return [r - mean for r in group]
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / (g - 1))
    return [(r - mean) / (std + GRPO_EPS) for r in group]


def ref_rloo(group: list[float]) -> list[float]:
    """A_i = r_i − (1/(G−1)) Σ_{j≠i} r_j; a tie gives 0."""
    if len(set(group)) == 1:
        return [0.0] * len(group)
    g = len(group)
    return [r - sum(group[j] for j in range(g) if j != i) / (g - 1) for i, r in enumerate(group)]


def ref_centered(group: list[float]) -> list[float]:
    if len(set(group)) == 1:
        return [0.0] * len(group)
    mean = sum(group) / len(group)
    return [r - mean for r in group]


def ref_return_to_go(
    reward: float, kl: list[float], mask: list[bool], beta: float, gamma: float
) -> list[float]:
    """REINFORCE++ eq. 8 with a discount: G_t = Σ_{s≥t, trainable} γ^{k(s)−k(t)} r_s,
    r_s = −β·KL_s, plus the reward at the last trainable token."""
    steps = [t for t, m in enumerate(mask) if m]
    token_reward = {t: -beta * kl[t] for t in steps}
    if steps:
        token_reward[steps[-1]] += reward
    out = [0.0] * len(mask)
    for k, t in enumerate(steps):
        out[t] = sum(gamma ** (j - k) * token_reward[s] for j, s in enumerate(steps) if j >= k)
    return out


def grouped(rewards: list[float], size: int) -> list[list[float]]:
    return [rewards[i : i + size] for i in range(0, len(rewards), size)]


# --- strategies ------------------------------------------------------------------------------------
few_values = st.sampled_from([0.0, 0.1, 0.5, 1.0, -1.0])
"""Rewards from a small set: ties within a group, and whole tied groups, are common."""
any_values = st.floats(min_value=-5.0, max_value=5.0, allow_nan=False, width=32)


@st.composite
def rollouts(draw: st.DrawFn, min_group: int = 1) -> tuple[list[float], int]:
    size = draw(st.integers(min_group, 8))
    groups = draw(st.integers(1, 5))
    values = draw(st.sampled_from([few_values, any_values]))
    rewards = draw(st.lists(values, min_size=size * groups, max_size=size * groups))
    return rewards, size


# --- the per-sample baselines ------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(rollouts(), st.booleans())
def test_grpo_matches_the_paper(case: tuple[list[float], int], std_normalization: bool) -> None:
    rewards, size = case
    got = grpo_advantages(torch.tensor(rewards), size, std_normalization=std_normalization)
    expected = [a for g in grouped(rewards, size) for a in ref_grpo(g, std_normalization)]
    assert got.dtype == torch.float32 and not torch.isnan(got).any()
    # float32 inputs, float64 statistics: a group whose spread is tiny is scaled by up to 1/ε.
    torch.testing.assert_close(
        got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-4, atol=1e-4
    )


@settings(max_examples=150, deadline=None)
@given(rollouts(min_group=2))
def test_rloo_matches_the_paper(case: tuple[list[float], int]) -> None:
    rewards, size = case
    got = rloo_advantages(torch.tensor(rewards, dtype=torch.float64), size)
    expected = [a for g in grouped(rewards, size) for a in ref_rloo(g)]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    # The leave-one-out baseline is the scaled group-centred reward: G/(G−1) · (r − mean).
    centered = group_centered_rewards(torch.tensor(rewards, dtype=torch.float64), size)
    torch.testing.assert_close(got, centered * size / (size - 1), rtol=1e-9, atol=1e-9)


@settings(max_examples=100, deadline=None)
@given(rollouts())
def test_group_centred_rewards_match_the_paper(case: tuple[list[float], int]) -> None:
    rewards, size = case
    got = group_centered_rewards(torch.tensor(rewards, dtype=torch.float64), size)
    expected = [a for g in grouped(rewards, size) for a in ref_centered(g)]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("value", [0.1, 1 / 3, -7.3, 0.0, 1e6])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 8])
def test_a_tied_group_gives_exactly_zero(value: float, size: int) -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: subtracting the mean alone would leave a residue,
    # and GRPO's division by a ~1e-17 std would blow it up (or give NaN for a group of one).
    rewards = torch.cat([torch.full((size,), value), torch.linspace(0, 1, size)])
    tied = torch.zeros(size, dtype=torch.float32)
    for estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        if estimator == "rloo" and size < 2:
            continue
        out = sample_signal(estimator, rewards, size)  # type: ignore[arg-type]
        assert torch.equal(out[:size], tied), (estimator, out)
        assert not torch.isnan(out).any()
    assert torch.equal(grpo_advantages(rewards, size, std_normalization=False)[:size], tied)
    assert bool(tied_groups(rewards, size)[0])
    assert bool(tied_groups(rewards, size)[1]) == (size == 1)


def test_groups_must_divide_the_rollout() -> None:
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        grpo_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match=">= 2"):
        rloo_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="unknown estimator"):
        sample_signal("ppo", torch.zeros(4), 2)  # type: ignore[arg-type]


def test_gae_and_reinforce_keep_the_rewards() -> None:
    rewards = torch.tensor([0.3, -1.0, 2.0, 0.5])
    for estimator in ("gae", "reinforce_plus_plus"):
        assert torch.equal(sample_signal(estimator, rewards, 2), rewards)  # type: ignore[arg-type]


# --- per-token advantages ------------------------------------------------------------------------------
@st.composite
def responses(draw: st.DrawFn) -> tuple[list[float], list[list[float]], list[list[bool]]]:
    batch = draw(st.integers(1, 4))
    length = draw(st.integers(1, 7))
    rewards = draw(st.lists(any_values, min_size=batch, max_size=batch))
    kl = [draw(st.lists(any_values, min_size=length, max_size=length)) for _ in range(batch)]
    masks = [draw(st.lists(st.booleans(), min_size=length, max_size=length)) for _ in range(batch)]
    return rewards, kl, masks


@settings(max_examples=100, deadline=None)
@given(responses())
def test_outcome_advantages_broadcast_over_trainable_tokens(
    case: tuple[list[float], list[list[float]], list[list[bool]]],
) -> None:
    per_sample, _kl, masks = case
    got = outcome_advantages(torch.tensor(per_sample), torch.tensor(masks))
    expected = [[a if m else 0.0 for m in row] for a, row in zip(per_sample, masks, strict=True)]
    assert torch.equal(got, torch.tensor(expected, dtype=torch.float32))
    for estimator in ("grpo", "rloo"):
        advantages, returns = token_advantages(estimator, torch.tensor(per_sample), None, torch.tensor(masks))  # type: ignore[arg-type]
        assert torch.equal(advantages, got) and returns is None


@settings(max_examples=150, deadline=None)
@given(responses(), st.floats(0.0, 1.0), st.floats(0.0, 2.0))
def test_reinforce_plus_plus_returns_match_the_paper(
    case: tuple[list[float], list[list[float]], list[list[bool]]], gamma: float, beta: float
) -> None:
    rewards, kl, masks = case
    mask = torch.tensor(masks, dtype=torch.float64)
    # kl_penalized_rewards takes log-probs: KL_t (k1) = log π − log π_ref, so π_ref = 0 gives KL_t = log π.
    log_probs = torch.tensor(kl, dtype=torch.float64)
    token_rewards = kl_penalized_rewards(
        torch.tensor(rewards, dtype=torch.float64), log_probs, torch.zeros_like(log_probs), mask, beta, "k1"
    )
    for estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        advantages, returns = token_advantages(estimator, token_rewards, None, mask, gamma=gamma)  # type: ignore[arg-type]
        expected = [
            ref_return_to_go(r, k, m, beta, gamma) for r, k, m in zip(rewards, kl, masks, strict=True)
        ]
        torch.testing.assert_close(
            advantages, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6
        )
        assert returns is advantages
    # Without KL (scalar rewards): the reward discounted back from the last trainable token.
    scalar = discounted_returns(torch.tensor(rewards, dtype=torch.float64), mask, gamma)
    expected = [
        ref_return_to_go(r, [0.0] * len(m), m, 0.0, gamma) for r, m in zip(rewards, masks, strict=True)
    ]
    torch.testing.assert_close(scalar, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)


@settings(max_examples=80, deadline=None)
@given(rollouts(min_group=2), st.integers(1, 6), st.data())
def test_reinforce_plus_plus_baseline_whitened_over_the_batch(
    case: tuple[list[float], int], length: int, data: st.DataObject
) -> None:
    """The whole REINFORCE++-baseline: centre per group, discount back (γ = 1, no KL), whiten over the batch."""
    rewards, size = case
    masks = [data.draw(st.lists(st.booleans(), min_size=length, max_size=length)) for _ in rewards]
    mask = torch.tensor(masks, dtype=torch.float64)
    centred = sample_signal("reinforce_plus_plus_baseline", torch.tensor(rewards, dtype=torch.float64), size)
    advantages, _ = token_advantages("reinforce_plus_plus_baseline", centred, None, mask)
    assert whitens("reinforce_plus_plus_baseline", True)
    got = whiten_advantages(advantages, mask)

    # The paper's eq. 10 by hand: every trainable token of sample i carries r_i − mean_g (γ = 1),
    # then (A − mean) / std over all trainable tokens of the batch (unbiased std, + 1e-8 as ours).
    per_sample = [a for g in grouped(rewards, size) for a in ref_centered(g)]
    tokens = [a for a, row in zip(per_sample, masks, strict=True) for m in row if m]
    if not tokens:
        assert torch.equal(got, torch.zeros_like(got))
        return
    mean = sum(tokens) / len(tokens)
    var = sum((a - mean) ** 2 for a in tokens) / max(len(tokens) - 1, 1)
    expected = [
        [(a - mean) / math.sqrt(var + 1e-8) if m else 0.0 for m in row]
        for a, row in zip(per_sample, masks, strict=True)
    ]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_which_estimators_whiten() -> None:
    assert [
        e
        for e in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
        if whitens(e, True)
    ] == [
        "gae",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
    ]
    assert not any(whitens(e, False) for e in ("gae", "reinforce_plus_plus"))


def test_token_advantages_refuse_what_the_estimator_cannot_take() -> None:
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="values"):
        token_advantages("gae", torch.zeros(2), None, mask)
    with pytest.raises(ValueError, match="kl_coef"):
        token_advantages("grpo", torch.zeros(2, 3), None, mask)


def test_each_estimator_is_one_registered_definition() -> None:
    """The registry holds every choice once; what the config, the plan and the worker read follows from it."""
    from tandem.megatron.choices import (
        ADVANTAGE_ESTIMATORS,
        CRITIC_FREE_ESTIMATORS,
        ESTIMATORS,
        GROUP_ESTIMATORS,
        estimator,
    )

    assert tuple(ESTIMATORS) == ADVANTAGE_ESTIMATORS
    # As the papers define them: only GAE's baseline is learned; GRPO, RLOO and REINFORCE++-baseline
    # compare a sample with its prompt's others; GRPO and RLOO give one advantage per sample.
    assert CRITIC_FREE_ESTIMATORS == ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
    assert GROUP_ESTIMATORS == ("grpo", "rloo", "reinforce_plus_plus_baseline")
    assert [e for e in ESTIMATORS if ESTIMATORS[e].per_sample] == ["grpo", "rloo"]
    assert [e for e in ADVANTAGE_ESTIMATORS if whitens(e, True)] == [  # type: ignore[arg-type]
        "gae",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
    ]
    with pytest.raises(ValueError, match="advantage_estimator: got 'ppo'"):
        estimator("ppo")
