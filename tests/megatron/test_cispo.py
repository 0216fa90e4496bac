"""CISPO's loss (MiniMax-M1, arXiv:2506.13585) by hand and against the paper's formula re-derived."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.algorithms.cispo import cispo_policy_loss


def test_clipped_weight_scales_every_tokens_gradient_by_hand() -> None:
    # Ratios r = π/π_old of 1.0, 1.5, 0.5 with ε_low = 0.2, ε_high = 0.28: weights clip(r, 0.8, 1.28) =
    # (1.0, 1.28, 0.8). Advantages (2, 1, −1). The loss is −w·A·log π, its gradient in log π −w·A =
    # (−2, −1.28, 0.8): the clipped tokens still get one, where PPO's clip gives the second token none.
    old = torch.tensor([[math.log(0.4), math.log(0.2), math.log(0.6)]], dtype=torch.float64)
    log_probs = (old + torch.log(torch.tensor([[1.0, 1.5, 0.5]], dtype=torch.float64))).requires_grad_()
    advantages = torch.tensor([[2.0, 1.0, -1.0]], dtype=torch.float64)
    loss, metrics = cispo_policy_loss(log_probs, old, advantages, 0.2, 0.28)
    weights = torch.tensor([[1.0, 1.28, 0.8]], dtype=torch.float64)
    torch.testing.assert_close(loss, -weights * advantages * log_probs.detach())
    loss.sum().backward()
    assert log_probs.grad is not None
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-2.0, -1.28, 0.8]], dtype=torch.float64))
    torch.testing.assert_close(metrics["clip_frac"], torch.tensor([[0.0, 1.0, 1.0]], dtype=torch.float64))
    assert metrics["dual_clip_frac"].eq(0).all()
    # approx_kl = (r − 1) − log r: 0 at r = 1, 0.5 − ln 1.5 and −0.5 − ln 0.5.
    expected_kl = [0.0, 0.5 - math.log(1.5), -0.5 - math.log(0.5)]
    torch.testing.assert_close(metrics["approx_kl"], torch.tensor([expected_kl], dtype=torch.float64))


ratio = st.floats(min_value=0.05, max_value=20.0)
advantage = st.floats(min_value=-5.0, max_value=5.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(ratio, advantage, st.floats(-8.0, -0.01)), min_size=1, max_size=10),
    st.floats(0.05, 0.95),
    st.floats(0.05, 5.0),
)
def test_matches_the_papers_objective(
    tokens: list[tuple[float, float, float]], eps_low: float, eps_high: float
) -> None:
    # J = sg[r̂] · A · log π with r̂ = clip(r, 1 − ε_low, 1 + ε_high) (the paper's objective), per token; the loss is −J
    # and its gradient in log π is −r̂ · A.
    old = torch.tensor([[lp for _, _, lp in tokens]], dtype=torch.float64)
    log_probs = (
        old + torch.tensor([[math.log(r) for r, _, _ in tokens]], dtype=torch.float64)
    ).requires_grad_()
    advantages = torch.tensor([[a for _, a, _ in tokens]], dtype=torch.float64)
    loss, _ = cispo_policy_loss(log_probs, old, advantages, eps_low, eps_high)
    clipped = [min(max(r, 1 - eps_low), 1 + eps_high) for r, _, _ in tokens]
    values = [-w * a * (lp + math.log(r)) for w, (r, a, lp) in zip(clipped, tokens, strict=True)]
    torch.testing.assert_close(loss, torch.tensor([values], dtype=torch.float64), rtol=1e-9, atol=1e-12)
    loss.sum().backward()
    assert log_probs.grad is not None
    grads = [-w * a for w, (_, a, _) in zip(clipped, tokens, strict=True)]
    torch.testing.assert_close(
        log_probs.grad, torch.tensor([grads], dtype=torch.float64), rtol=1e-9, atol=1e-12
    )


def test_bad_clip_ranges_and_shapes_are_refused() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="`eps_clip`"):
        cispo_policy_loss(x, x, x, 1.5)
    with pytest.raises(ValueError, match="one shape"):
        cispo_policy_loss(x, x, torch.zeros(1, 3), 0.2)
