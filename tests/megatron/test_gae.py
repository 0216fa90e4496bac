"""`compute_gae` against a plain reverse loop over each response's trainable tokens."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.algorithms import gae
from tandem.megatron.algorithms.gae import compute_gae, lambda_returns, scalar_at_last_token


def reference_gae(
    reward: float, values: list[float], mask: list[bool], gamma: float, lambd: float
) -> tuple[list[float], list[float]]:
    """GAE of one response, written the textbook way: list the steps, then walk them backwards."""
    steps = [t for t, m in enumerate(mask) if m]
    advantages = [0.0] * len(values)
    returns = [0.0] * len(values)
    next_value = 0.0  # nothing follows the last step, truncated or not
    next_advantage = 0.0
    for k in reversed(range(len(steps))):
        t = steps[k]
        r = reward if k == len(steps) - 1 else 0.0
        delta = r + gamma * next_value - values[t]
        advantages[t] = delta + gamma * lambd * next_advantage
        returns[t] = advantages[t] + values[t]
        next_value = values[t]
        next_advantage = advantages[t]
    return advantages, returns


finite = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False)
unit = st.floats(min_value=0.0, max_value=1.0)


@st.composite
def gae_batches(draw: st.DrawFn) -> tuple[list[float], list[list[float]], list[list[bool]], float, float]:
    batch = draw(st.integers(1, 4))
    # Short rows, and rows over several of the blocked sums' blocks (`gae._BLOCK`).
    length = draw(st.one_of(st.integers(1, 8), st.integers(gae._BLOCK - 2, 3 * gae._BLOCK + 5)))
    rewards = draw(st.lists(finite, min_size=batch, max_size=batch))
    values = [draw(st.lists(finite, min_size=length, max_size=length)) for _ in range(batch)]
    # Arbitrary masks: holes, leading/trailing padding and all-masked rows all occur.
    masks = [draw(st.lists(st.booleans(), min_size=length, max_size=length)) for _ in range(batch)]
    return rewards, values, masks, draw(unit), draw(unit)


@settings(max_examples=100, deadline=None)
@given(gae_batches())
def test_matches_reverse_loop(
    case: tuple[list[float], list[list[float]], list[list[bool]], float, float],
) -> None:
    rewards, values, masks, gamma, lambd = case
    advantages, returns = compute_gae(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(values, dtype=torch.float64),
        torch.tensor(masks, dtype=torch.float64),
        gamma=gamma,
        lambd=lambd,
    )
    for i, (reward, row_values, row_mask) in enumerate(zip(rewards, values, masks, strict=True)):
        expected_adv, expected_ret = reference_gae(reward, row_values, row_mask, gamma, lambd)
        torch.testing.assert_close(advantages[i], torch.tensor(expected_adv, dtype=torch.float64))
        torch.testing.assert_close(returns[i], torch.tensor(expected_ret, dtype=torch.float64))


@settings(max_examples=50, deadline=None)
@given(gae_batches(), st.floats(allow_nan=True, allow_infinity=True))
def test_values_at_masked_positions_do_not_matter(
    case: tuple[list[float], list[list[float]], list[list[bool]], float, float], garbage: float
) -> None:
    rewards, values, masks, gamma, lambd = case
    mask = torch.tensor(masks)
    clean = torch.where(mask, torch.tensor(values, dtype=torch.float64), 0.0)
    dirty = torch.where(mask, clean, garbage)
    expected = compute_gae(torch.tensor(rewards, dtype=torch.float64), clean, mask, gamma, lambd)
    got = compute_gae(torch.tensor(rewards, dtype=torch.float64), dirty, mask, gamma, lambd)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)


def test_masked_hole_is_skipped_not_a_step() -> None:
    # Mask 1 0 1 with γ = 0.5, λ = 1, V = (1, 100, 3), reward 8 (hand-computed):
    # the hole at t=1 is skipped, so t=0 bootstraps from V_2 = 3 with ONE factor γ.
    # t=2: δ = 8 + 0 − 3 = 5, A_2 = 5.
    # t=0: δ = 0 + 0.5·3 − 1 = 0.5, A_0 = 0.5 + 0.5·5 = 3.
    # Were the hole a zero-reward step, A_0 would use V_1 = 100 and γ² for A_2.
    advantages, returns = compute_gae(
        torch.tensor([8.0]), torch.tensor([[1.0, 100.0, 3.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5
    )
    torch.testing.assert_close(advantages, torch.tensor([[3.0, 0.0, 5.0]]))
    torch.testing.assert_close(returns, torch.tensor([[4.0, 0.0, 8.0]]))


def test_defaults_give_reward_minus_value() -> None:
    # γ = λ = 1: every trainable token's advantage is the final reward minus its own value
    # (the intermediate values telescope away), and the return is the reward itself.
    values = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    advantages, returns = compute_gae(torch.tensor([3.0]), values, mask)
    torch.testing.assert_close(advantages, torch.tensor([[2.5, 4.0, 1.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[3.0, 3.0, 3.0, 0.0]]))


def test_outputs_are_detached_and_at_least_float32() -> None:
    values = torch.zeros(2, 3, dtype=torch.bfloat16, requires_grad=True)
    rewards = torch.ones(2, requires_grad=True)
    advantages, returns = compute_gae(rewards, values, torch.ones(2, 3))
    assert not advantages.requires_grad and not returns.requires_grad
    assert advantages.dtype == returns.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"gamma": 1.5}, "gamma"),
        ({"gamma": math.nan}, "gamma"),
        ({"lambd": -0.1}, "lambd"),
        ({"rewards": torch.zeros(2, 1)}, "rewards"),
        ({"loss_mask": torch.ones(2, 4)}, "loss_mask"),
        ({"values": torch.zeros(2)}, "values"),
    ],
)
def test_bad_input_names_the_argument(kwargs: dict[str, object], flag: str) -> None:
    args: dict[str, object] = {
        "rewards": torch.zeros(2),
        "values": torch.zeros(2, 3),
        "loss_mask": torch.ones(2, 3),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"`{flag}`"):
        compute_gae(**args)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(gae_batches())
def test_lambda_returns_are_the_gae_returns(
    case: tuple[list[float], list[list[float]], list[list[bool]], float, float],
) -> None:
    # The critic's targets without advantages: another recursion, the same numbers.
    rewards, values, masks, gamma, lambd = case
    args = (
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(values, dtype=torch.float64),
        torch.tensor(masks, dtype=torch.float64),
    )
    _, expected = compute_gae(*args, gamma=gamma, lambd=lambd)
    torch.testing.assert_close(lambda_returns(*args, gamma=gamma, lambd=lambd), expected)


def test_lambda_returns_by_hand() -> None:
    # Two trainable tokens, values 1 and 2, reward 3, gamma 0.5, lambda 0.5:
    # G_1 = 3 (last step: reward, nothing after); G_0 = 0 + 0.5 * (0.5 * V_1 + 0.5 * G_1) = 0.5 * 2.5 = 1.25.
    got = lambda_returns(torch.tensor([3.0]), torch.tensor([[1.0, 2.0]]), torch.ones(1, 2), 0.5, 0.5)
    torch.testing.assert_close(got, torch.tensor([[1.25, 3.0]]))


def reference_gae_token_rewards(
    rewards: list[float], values: list[float], mask: list[bool], gamma: float, lambd: float
) -> tuple[list[float], list[float]]:
    """GAE of one response with a reward per token: the textbook loop over its trainable steps."""
    steps = [t for t, m in enumerate(mask) if m]
    advantages = [0.0] * len(values)
    returns = [0.0] * len(values)
    next_value = next_advantage = 0.0
    for t in reversed(steps):
        delta = rewards[t] + gamma * next_value - values[t]
        advantages[t] = delta + gamma * lambd * next_advantage
        returns[t] = advantages[t] + values[t]
        next_value, next_advantage = values[t], advantages[t]
    return advantages, returns


@settings(max_examples=100, deadline=None)
@given(gae_batches(), st.data())
def test_token_rewards_match_reverse_loop(
    case: tuple[list[float], list[list[float]], list[list[bool]], float, float], data: st.DataObject
) -> None:
    # Token-level rewards (the KL-first plan's KL-folded rewards): every trainable token's own
    # reward enters its δ; rewards at masked positions are ignored, whatever they hold.
    _, values, masks, gamma, lambd = case
    width = len(values[0])
    token_rewards = [data.draw(st.lists(finite, min_size=width, max_size=width)) for _ in values]
    garbage = data.draw(st.floats(allow_nan=True, allow_infinity=True))
    mask = torch.tensor(masks)
    dirty = torch.where(mask, torch.tensor(token_rewards, dtype=torch.float64), garbage)
    args = (dirty, torch.tensor(values, dtype=torch.float64), mask.double())
    advantages, returns = compute_gae(*args, gamma=gamma, lambd=lambd)
    torch.testing.assert_close(lambda_returns(*args, gamma=gamma, lambd=lambd), returns)
    for i, (row_rewards, row_values, row_mask) in enumerate(zip(token_rewards, values, masks, strict=True)):
        expected_adv, expected_ret = reference_gae_token_rewards(
            row_rewards, row_values, row_mask, gamma, lambd
        )
        torch.testing.assert_close(advantages[i], torch.tensor(expected_adv, dtype=torch.float64))
        torch.testing.assert_close(returns[i], torch.tensor(expected_ret, dtype=torch.float64))


@settings(max_examples=50, deadline=None)
@given(gae_batches())
def test_scalar_rewards_are_token_rewards_at_the_last_trainable_token(
    case: tuple[list[float], list[list[float]], list[list[bool]], float, float],
) -> None:
    rewards, values, masks, gamma, lambd = case
    scalar = torch.tensor(rewards, dtype=torch.float64)
    mask = torch.tensor(masks)
    placed = scalar_at_last_token(scalar, mask)
    assert ((placed != 0) <= mask).all()
    values_t = torch.tensor(values, dtype=torch.float64)
    for a, b in zip(
        compute_gae(scalar, values_t, mask, gamma, lambd),
        compute_gae(placed, values_t, mask, gamma, lambd),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(0, 5 * gae._BLOCK + 3),
    st.sampled_from([0.0, 1e-3, 0.3, 0.9, 0.999, 1.0]) | unit,
    st.integers(0, 2**31 - 1),
)
def test_suffix_sums_match_the_loop(batch: int, length: int, decay: float, seed: int) -> None:
    # Tiny decays over long rows: a cumulative sum of decay^(-j) terms would overflow there.
    terms = torch.randn(batch, length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    expected = torch.zeros_like(terms)
    running = torch.zeros(batch, dtype=torch.float64)
    for k in reversed(range(length)):
        running = terms[:, k] + decay * running
        expected[:, k] = running
    got = gae._suffix_sums(terms, decay)
    assert got.dtype == terms.dtype and got.shape == terms.shape
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(gae_batches(), st.data())
def test_a_lambda_per_response_is_each_rows_own_gae(
    case: tuple[list[float], list[list[float]], list[list[bool]], float, float], data: st.DataObject
) -> None:
    # Length-adaptive GAE gives each response its λ: every row must be the textbook loop with its own.
    rewards, values, masks, gamma, _ = case
    lambdas = data.draw(
        st.lists(st.sampled_from([0.0, 1.0]) | unit, min_size=len(values), max_size=len(values))
    )
    args = (
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(values, dtype=torch.float64),
        torch.tensor(masks, dtype=torch.float64),
    )
    per_row = torch.tensor(lambdas, dtype=torch.float64)
    advantages, returns = compute_gae(*args, gamma=gamma, lambd=per_row)
    torch.testing.assert_close(lambda_returns(*args, gamma=gamma, lambd=per_row), returns)
    for i, (reward, row_values, row_mask, lambd) in enumerate(
        zip(rewards, values, masks, lambdas, strict=True)
    ):
        expected_adv, expected_ret = reference_gae(reward, row_values, row_mask, gamma, lambd)
        torch.testing.assert_close(advantages[i], torch.tensor(expected_adv, dtype=torch.float64))
        torch.testing.assert_close(returns[i], torch.tensor(expected_ret, dtype=torch.float64))


def test_length_adaptive_lambdas_by_hand() -> None:
    # VAPO's λ = 1 − 1/(α·l) with α = 0.05: l = 100 → 1 − 1/5 = 0.8; l = 40 → 1 − 1/2 = 0.5;
    # l = 20 → 0 (exactly 1/α tokens); l = 10 → 1 − 2 < 0, clamped to 0; no trainable token → 0.
    lengths = [100, 40, 20, 10, 0]
    mask = torch.zeros(len(lengths), 120)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    got = gae.length_adaptive_lambdas(mask, 0.05)
    torch.testing.assert_close(got, torch.tensor([0.8, 0.5, 0.0, 0.0, 0.0], dtype=torch.float64))
    # A hole does not count: 3 trainable tokens of 5 with α = 1 give 1 − 1/3.
    assert gae.length_adaptive_lambdas(torch.tensor([[1, 0, 1, 0, 1]]), 1.0).item() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="alpha"):
        gae.length_adaptive_lambdas(mask, 0.0)


def test_per_response_lambda_by_hand() -> None:
    # Two identical responses (values 1, 2; reward 3; γ = 1) with λ 0 and 1:
    # δ = (0 + 2 − 1, 3 + 0 − 2) = (1, 1). λ = 0: A = δ = (1, 1); λ = 1: A_0 = 1 + 1 = 2, A_1 = 1.
    values = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    advantages, returns = compute_gae(
        torch.tensor([3.0, 3.0]), values, torch.ones(2, 2), 1.0, torch.tensor([0.0, 1.0])
    )
    torch.testing.assert_close(advantages, torch.tensor([[1.0, 1.0], [2.0, 1.0]]))
    torch.testing.assert_close(returns, torch.tensor([[2.0, 3.0], [3.0, 3.0]]))
    with pytest.raises(ValueError, match="`lambd`"):
        compute_gae(torch.tensor([3.0, 3.0]), values, torch.ones(2, 2), 1.0, torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match=r"shape \(batch,\)"):
        compute_gae(torch.tensor([3.0, 3.0]), values, torch.ones(2, 2), 1.0, torch.tensor([0.5]))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(0, 3 * gae._BLOCK + 3), st.integers(0, 2**31 - 1), st.data())
def test_suffix_sums_with_a_decay_per_row_match_the_loop(
    batch: int, length: int, seed: int, data: st.DataObject
) -> None:
    decays = data.draw(
        st.lists(st.sampled_from([0.0, 1e-3, 0.999, 1.0]) | unit, min_size=batch, max_size=batch)
    )
    terms = torch.randn(batch, length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    decay = torch.tensor(decays, dtype=torch.float64)
    expected = torch.zeros_like(terms)
    running = torch.zeros(batch, dtype=torch.float64)
    for k in reversed(range(length)):
        running = terms[:, k] + decay * running
        expected[:, k] = running
    torch.testing.assert_close(gae._suffix_sums(terms, decay), expected, rtol=1e-12, atol=1e-12)
