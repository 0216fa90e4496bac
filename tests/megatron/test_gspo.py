"""GSPO's loss against the paper's sequence objective and its gradient written out by hand.

Zheng et al. 2025 (arXiv:2507.18071): `s_i = exp(mean_t (log π − log π_old))` over
the trainable tokens, `J = mean_i min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i)`
(eq. 5, 7). GSPO-token (eq. 13) gives token t of response i the value s_i and the
gradient `s_i ∇ log π(y_t)`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.algorithms.gspo import gspo_policy_loss, sequence_log_ratio
from tandem.megatron.algorithms.losses import aggregate_loss, policy_loss


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    batch = draw(st.integers(1, 4))
    length = draw(st.integers(1, 6))
    small = st.floats(-0.3, 0.3, allow_nan=False)
    old = torch.tensor(
        [[draw(st.floats(-3.0, -0.1)) for _ in range(length)] for _ in range(batch)], dtype=torch.float64
    )
    shift = torch.tensor([[draw(small) for _ in range(length)] for _ in range(batch)], dtype=torch.float64)
    mask = torch.tensor(
        [[draw(st.booleans()) for _ in range(length)] for _ in range(batch)], dtype=torch.float64
    )
    eps_low = draw(st.sampled_from([0.01, 0.05, 0.2]))
    eps_high = draw(st.sampled_from([0.01, 0.08, 0.28]))
    return old, old + shift, mask, eps_low, eps_high


@settings(max_examples=150, deadline=None)
@given(cases(), st.data())
def test_sequence_objective_and_its_gradient(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float], data: st.DataObject
) -> None:
    """One advantage per response (GRPO's): the loss is −J of the paper, its gradient the sequence one."""
    old, new, mask, eps_low, eps_high = case
    batch, length = old.shape
    per_sample = [data.draw(st.floats(-2.0, 2.0)) for _ in range(batch)]
    advantages = torch.tensor(per_sample, dtype=torch.float64)[:, None].expand(batch, length) * mask
    log_probs = new.clone().requires_grad_(True)
    per_token, metrics = gspo_policy_loss(log_probs, old, advantages, mask, eps_low, eps_high)
    loss = aggregate_loss(per_token, mask, "sample_mean")
    loss.backward()
    assert log_probs.grad is not None

    # The paper, response by response, in Python floats.
    rows = [i for i in range(batch) if mask[i].sum() > 0]
    expected_loss = 0.0
    expected_grad = torch.zeros(batch, length, dtype=torch.float64)
    for i in rows:
        steps = [t for t in range(length) if mask[i, t]]
        s = math.exp(sum(float(new[i, t] - old[i, t]) for t in steps) / len(steps))
        a = per_sample[i]
        clipped = min(max(s, 1 - eps_low), 1 + eps_high)
        expected_loss += max(-a * s, -a * clipped) / len(rows)
        # d/d log π_t of −min(sA, clip(s)A): −A s / |y| where the unclipped term is the min, else 0.
        active = -a * s >= -a * clipped
        for t in steps:
            expected_grad[i, t] = (-a * s / len(steps) / len(rows)) if active else 0.0
        sequence_clipped = -a * clipped > -a * s
        assert all(bool(metrics["clip_frac"][i, t]) == sequence_clipped for t in steps)
    assert float(loss.detach()) == pytest.approx(expected_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(log_probs.grad, expected_grad, rtol=1e-9, atol=1e-12)


@settings(max_examples=100, deadline=None)
@given(cases(), st.data())
def test_token_advantages_keep_their_own_gradient(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float], data: st.DataObject
) -> None:
    """GSPO-token: token t's loss is −A_t·s_i in value; its gradient flows into log π_t alone."""
    old, new, mask, eps_low, eps_high = case
    batch, length = old.shape
    adv = torch.tensor(
        [[data.draw(st.floats(-2.0, 2.0)) for _ in range(length)] for _ in range(batch)], dtype=torch.float64
    )
    log_probs = new.clone().requires_grad_(True)
    per_token, _ = gspo_policy_loss(log_probs, old, adv, mask, eps_low, eps_high)
    (per_token * mask).sum().backward()
    assert log_probs.grad is not None
    for i in range(batch):
        steps = [t for t in range(length) if mask[i, t]]
        s = math.exp(sum(float(new[i, t] - old[i, t]) for t in steps) / max(len(steps), 1))
        clipped = min(max(s, 1 - eps_low), 1 + eps_high)
        for t in range(length):
            a = float(adv[i, t])
            assert float(per_token[i, t].detach()) == pytest.approx(
                max(-a * s, -a * clipped), rel=1e-9, abs=1e-12
            )
            active = bool(mask[i, t]) and -a * s >= -a * clipped
            assert float(log_probs.grad[i, t]) == pytest.approx(
                -a * s if active else 0.0, rel=1e-9, abs=1e-12
            )


def test_one_token_responses_are_ppo() -> None:
    """With one token per response the sequence ratio is the token ratio: GSPO is PPO's loss."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 1, generator=g, dtype=torch.float64) - 0.5
    new = old + 0.4 * torch.randn(6, 1, generator=g, dtype=torch.float64)
    adv = torch.randn(6, 1, generator=g, dtype=torch.float64)
    mask = torch.ones(6, 1, dtype=torch.float64)
    ppo, ppo_metrics = policy_loss(new, old, adv, 0.2, 0.28, 3.0)
    gspo, gspo_metrics = gspo_policy_loss(new, old, adv, mask, 0.2, 0.28, 3.0)
    torch.testing.assert_close(gspo, ppo)
    for name in ("clip_frac", "dual_clip_frac", "approx_kl"):
        torch.testing.assert_close(gspo_metrics[name], ppo_metrics[name])
    assert ppo_metrics["clip_frac"].sum() > 0  # the case is not vacuous: some tokens clip


def test_sequence_log_ratio_ignores_masked_tokens() -> None:
    log_probs = torch.tensor([[-1.0, -2.0, 50.0], [-1.0, 0.0, 0.0]])
    old = torch.tensor([[-1.5, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(sequence_log_ratio(log_probs, old, mask), torch.tensor([(0.5 - 1.0) / 2, 0.0]))


def test_bad_shapes_and_clips_are_refused() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="share one shape"):
        gspo_policy_loss(x, x, x, torch.ones(2, 2), 0.2)
    with pytest.raises(ValueError, match="`eps_clip`"):
        gspo_policy_loss(x, x, x, x, 1.5)
