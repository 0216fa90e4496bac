"""A rank's group baselines come from its samples' whole groups, whatever order and share it holds.

Without torch.distributed the pooled rollout is this rank's own samples; the
data-parallel case (two ranks, each with half of every group) runs through the
train workers in `test_worker_plans.py`.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.algorithms.estimators import sample_signal
from tandem.megatron.algorithms.rollout_rewards import estimator_rewards, gather_rollout_rewards, group_signal

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


@settings(max_examples=80, deadline=None)
@given(
    st.integers(2, 6), st.integers(1, 4), st.sampled_from(GROUP_ESTIMATORS), st.randoms(use_true_random=False)
)
def test_any_order_of_the_samples_gives_their_groups_baselines(
    size: int, groups: int, estimator: str, rng: object
) -> None:
    n = size * groups
    rewards = torch.tensor([float(i % 3) * 0.5 for i in range(n)]) + torch.arange(n) % 2
    expected = sample_signal(estimator, rewards, size)  # type: ignore[arg-type]
    order = list(range(n))
    rng.shuffle(order)  # type: ignore[attr-defined]
    pooled = gather_rollout_rewards(rewards[order], order)
    assert torch.equal(pooled.rewards, rewards.double()) and bool(pooled.present.all())
    signal, figures = group_signal(estimator, pooled, order, size)  # type: ignore[arg-type]
    torch.testing.assert_close(signal, expected[order].float())
    tied = sum(len(set(rewards[g * size : (g + 1) * size].tolist())) == 1 for g in range(groups)) / groups
    assert float(figures["tied_groups"]) == pytest.approx(tied)


def test_groups_that_no_rank_holds_are_ignored_and_partial_ones_refused() -> None:
    # Samples 8..11 (groups 2 and 3 of size 2): groups 0 and 1 are nobody's, which is fine.
    pooled = gather_rollout_rewards(torch.tensor([1.0, 0.0, 1.0, 1.0]), [8, 9, 10, 11])
    signal, figures = group_signal("grpo", pooled, [8, 9, 10, 11], 2)
    assert signal[0] > 0 > signal[1] and signal[2] == signal[3] == 0
    assert float(figures["tied_groups"]) == 0.5
    partial = gather_rollout_rewards(torch.tensor([1.0, 0.0, 1.0]), [0, 1, 2])
    with pytest.raises(ValueError, match=r"^n_samples_per_prompt: .*group 1 .*only 1 of its 2"):
        group_signal("rloo", partial, [0, 1, 2], 2)


def test_a_sample_held_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="more than one data-parallel rank"):
        gather_rollout_rewards(torch.tensor([1.0, 0.0]), [3, 3])
    with pytest.raises(ValueError, match="sample indices"):
        gather_rollout_rewards(torch.tensor([1.0, 0.0]), [0])


def test_estimators_without_groups_keep_the_rewards() -> None:
    rewards = torch.tensor([0.25, -1.0, 3.0])
    for estimator in ("gae", "reinforce_plus_plus"):
        out, figures = estimator_rewards(estimator, rewards, [5, 0, 9], n_samples_per_prompt=4)  # type: ignore[arg-type]
        assert out is rewards and figures == {}
    out, figures = estimator_rewards("grpo", torch.tensor([1.0, 0.0]), [0, 1], n_samples_per_prompt=2)
    assert out.tolist() == pytest.approx([0.7071, -0.7071], abs=1e-4)  # ±0.5 / (std 0.7071 + 1e-6)
    assert set(figures) == {"tied_groups"}
