"""The KL estimators of `approx_kl` against their formulas, written out per element."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.algorithms.kl import KL_KINDS, approx_kl, kl_penalized_rewards

log_prob = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)


def formula(kind: str, log_prob: float, ref_log_prob: float) -> float:
    """Schulman's estimators (and verl's `abs`) of r = log π_ref − log π; a `+` kind has its base kind's value."""
    r = ref_log_prob - log_prob
    kind = kind.removesuffix("+")
    if kind == "k1":
        return -r
    if kind == "k2":
        return r * r / 2
    if kind == "abs":
        return abs(r)
    k3 = math.exp(r) - 1 - r if r < 700 else math.inf
    if kind == "k3":
        return k3
    return min(max(k3, -10.0), 10.0)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(KL_KINDS),
    st.lists(st.tuples(log_prob, log_prob), min_size=1, max_size=12),
)
def test_kinds_match_their_formulas(kind: str, pairs: list[tuple[float, float]]) -> None:
    log_probs = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    ref_log_probs = torch.tensor([q for _, q in pairs], dtype=torch.float64)
    got = approx_kl(log_probs, ref_log_probs, kind)  # type: ignore[arg-type]
    expected = torch.tensor([formula(kind, p, q) for p, q in pairs], dtype=torch.float64)
    # k3 = e^r − 1 − r: the test's subtraction loses digits near r = 0 that expm1 keeps, hence atol.
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(log_prob, log_prob), min_size=1, max_size=12))
def test_k2_k3_low_var_are_nonnegative_and_low_var_is_bounded(pairs: list[tuple[float, float]]) -> None:
    log_probs = torch.tensor([p for p, _ in pairs])
    ref_log_probs = torch.tensor([q for _, q in pairs])
    for kind in ("k2", "k3", "low_var_kl"):
        assert (approx_kl(log_probs, ref_log_probs, kind) >= 0).all()
    assert (approx_kl(log_probs, ref_log_probs, "low_var_kl") <= 10.0).all()


def test_small_ratio_k3_keeps_precision() -> None:
    # For r = 1e-3, k3 = r²/2 + r³/6 + … ≈ 5.0017e-7. In float32, exp(r) − 1 − r rounds exp(r) ≈ 1.001
    # to a multiple of 1.2e-7 (10 % of the answer); expm1(r) − r is off by ~6e-11 (1e-4).
    r = 1e-3
    got = approx_kl(torch.zeros(1), torch.tensor([r], dtype=torch.float32), "k3")
    expected = torch.tensor([math.expm1(r) - r], dtype=torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=0)


def test_low_var_kl_gradient_is_finite_for_huge_ratios() -> None:
    # r = 100 overflows exp in float32; the clamp must not turn that into a NaN gradient (0 · inf).
    log_probs = torch.tensor([-100.0, -100.0, 0.0], requires_grad=True)
    ref_log_probs = torch.tensor([0.0, -200.0, 0.0])
    kl = approx_kl(log_probs, ref_log_probs, "low_var_kl")
    torch.testing.assert_close(kl, torch.tensor([10.0, 10.0, 0.0]))
    kl.sum().backward()
    assert log_probs.grad is not None
    # Clamped entries get no gradient; at r = 0 the gradient of k3 is 1 − e^0 = 0.
    torch.testing.assert_close(log_probs.grad, torch.zeros(3))


def test_abs_and_straight_through_kinds_by_hand() -> None:
    # log π = (0, −1), log π_ref = (3, −1.5): r = (3, −0.5).
    log_probs = torch.tensor([0.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref_log_probs = torch.tensor([3.0, -1.5], dtype=torch.float64)
    # abs: |r| = (3, 0.5); its gradient in log π is −sign(r) = (−1, +1).
    kl = approx_kl(log_probs, ref_log_probs, "abs")
    torch.testing.assert_close(kl, torch.tensor([3.0, 0.5], dtype=torch.float64))
    (grad,) = torch.autograd.grad(kl.sum(), log_probs)
    torch.testing.assert_close(grad, torch.tensor([-1.0, 1.0], dtype=torch.float64))
    # k3+: k3's value, e³ − 1 − 3 = 16.0855 (not clamped) and e^−0.5 − 1 + 0.5 = 0.1065;
    # low_var_kl+: the same clamped to 10 (verl's k3 and OpenRLHF's give 10.0 on the first token).
    # Both take k2's gradient, ∂(r²/2)/∂log π = −r = (−3, 0.5), where k3's would be 1 − e^r = (−19.09, 0.39).
    k3_value = [math.expm1(3.0) - 3.0, math.expm1(-0.5) + 0.5]
    for kind, value in (("k3+", k3_value), ("low_var_kl+", [10.0, k3_value[1]])):
        kl = approx_kl(log_probs, ref_log_probs, kind)  # type: ignore[arg-type]
        torch.testing.assert_close(kl, torch.tensor(value, dtype=torch.float64))
        (grad,) = torch.autograd.grad(kl.sum(), log_probs)
        torch.testing.assert_close(grad, torch.tensor([-3.0, 0.5], dtype=torch.float64))
    assert approx_kl(log_probs, ref_log_probs, "k3")[0].item() == pytest.approx(16.0855, abs=1e-4)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(log_prob, log_prob), min_size=1, max_size=12))
def test_straight_through_gradient_is_k2s(pairs: list[tuple[float, float]]) -> None:
    ref_log_probs = torch.tensor([q for _, q in pairs], dtype=torch.float64)
    grads = {}
    for kind in ("k2", "k3+", "low_var_kl+"):
        log_probs = torch.tensor([p for p, _ in pairs], dtype=torch.float64, requires_grad=True)
        approx_kl(log_probs, ref_log_probs, kind).sum().backward()  # type: ignore[arg-type]
        grads[kind] = log_probs.grad
    torch.testing.assert_close(grads["k3+"], grads["k2"], rtol=0, atol=0)
    torch.testing.assert_close(grads["low_var_kl+"], grads["k2"], rtol=0, atol=0)


def test_padding_gives_zero() -> None:
    for kind in KL_KINDS:
        assert approx_kl(torch.zeros(2, 3), torch.zeros(2, 3), kind).eq(0).all()  # type: ignore[arg-type]


def test_unknown_kind_lists_the_kinds() -> None:
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        approx_kl(torch.zeros(1), torch.zeros(1), "kl")  # type: ignore[arg-type]


def test_shape_mismatch_names_the_argument() -> None:
    with pytest.raises(ValueError, match="`ref_log_probs`"):
        approx_kl(torch.zeros(2, 3), torch.zeros(2, 4), "k1")


def test_kl_penalized_rewards_by_hand() -> None:
    # Two samples; sample 0 has 3 trainable tokens, sample 1 a hole and a masked last token.
    # k1: KL_t = log π − log π_ref. kl_coef 0.5.
    log_probs = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
    ref_log_probs = torch.tensor([[-1.5, -2.0, -0.25], [-3.0, -9.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    rewards = torch.tensor([2.0, -1.0])
    got = kl_penalized_rewards(rewards, log_probs, ref_log_probs, mask, 0.5, "k1")
    # sample 0: KL = (0.5, 0, −0.25) → −0.5·KL = (−0.25, 0, 0.125), + reward 2 at t = 2.
    # sample 1: only t = 0 is trainable and last: −0.5·2 + (−1) = −2; masked tokens 0.
    torch.testing.assert_close(got, torch.tensor([[-0.25, 0.0, 2.125], [-2.0, 0.0, 0.0]]))
    # kl_coef 0: the scalar rewards at the last trainable token.
    zero = kl_penalized_rewards(rewards, log_probs, ref_log_probs, mask, 0.0, "k3")
    torch.testing.assert_close(zero, torch.tensor([[0.0, 0.0, 2.0], [-1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="kl_coef"):
        kl_penalized_rewards(rewards, log_probs, ref_log_probs, mask, -0.1, "k1")
    with pytest.raises(ValueError, match="kl_coef"):
        kl_penalized_rewards(rewards, log_probs, ref_log_probs, mask, math.inf, "k1")
