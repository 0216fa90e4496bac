"""The run's hints (`tandem.ppo.run.health`): pure functions of per-step figures, no driver.

Each hint fires on a history built to trip it and says the measured cause and the flag; none fires
while the reward rises, none before `FIRST_HINT_STEP`, none twice; the learning test and the
spacing arithmetic as properties (hypothesis) and on the issue's figures.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.ppo.run.health import (
    CRITIC_EV_FLOOR,
    FIRST_HINT_STEP,
    STATIC_WEIGHTS_FRACTION,
    TIED_GROUPS_SHARE,
    TRUNCATED_SHARE,
    WINDOW,
    RunFacts,
    RunHealth,
    StepFigures,
    WeightMagnitudes,
    is_learning,
    out_of_reach,
    rise_t,
    tied_examples,
)

# The issue's model, roughly: 92 % of the weights at |w| >= 2**-6, 8 % below 2**-10; bfloat16.
WEIGHTS = WeightMagnitudes("bfloat16", 2.0**-7, {-10: 8, -6: 60, -5: 32})
FACTS = RunFacts(
    lr=1e-6,
    critic_lr=1e-5,
    num_critic_only_steps=0,
    rollout_max_response_len=64,
    n_samples_per_prompt=8,
    optimizer_steps_per_rollout=1,
    weights=WEIGHTS,
)
HEALTHY = StepFigures(
    step=0,
    reward_mean=0.3,
    tied_groups=0.1,
    truncated=0.05,
    explained_variance=0.4,
    actor_trained=True,
    actor_lr=1e-6,
    actor_grad_norm=0.5,
    changed_fraction_since_start=0.6,
)
"""A step of a run with nothing to say: the hints below each change one figure of it."""

finite = st.floats(-1e3, 1e3, allow_nan=False)


def run_steps(steps: int, facts: RunFacts = FACTS, **figures: Any) -> tuple[RunHealth, list[list[str]]]:
    """`steps` steps of `HEALTHY` with `figures` changed (a callable gets the step index); each step's hints."""
    health = RunHealth(facts)
    said: list[list[str]] = []
    for k in range(steps):
        values = {name: value(k) if callable(value) else value for name, value in figures.items()}
        figure = dataclasses.replace(HEALTHY, step=k, **values)
        said.append([h.message for h in health.observe(figure, [("The answer is 15.", 0.0), ("7", 0.0)])])
    return health, said


def only_hint(said: list[list[str]]) -> str:
    (message,) = [m for step in said for m in step]
    return message


# --- learning ------------------------------------------------------------------------------------
def test_learning_needs_two_windows_and_a_rise_beyond_the_spread() -> None:
    assert not is_learning([0.1, 0.2, 0.3])  # too short to judge
    assert not is_learning([0.5] * 12)  # flat
    assert is_learning([0.1] * WINDOW + [0.2] * WINDOW)  # a rise with no spread at all
    # The issue's run: 0.038 -> 0.039, against a step-to-step spread of about 0.005.
    flat = [0.038, 0.043, 0.033, 0.041, 0.036, 0.039, 0.044, 0.034, 0.040, 0.038]
    assert not is_learning(flat)
    # The demo's first 15 steps (docs/results/estimators_demo.json).
    demo = [0.042, 0.042, 0.113, 0.12, 0.116, 0.113, 0.193, 0.235, 0.191, 0.188, 0.154, 0.244, 0.171, 0.223]
    assert is_learning(demo)


@given(
    eighths=st.lists(st.integers(-8000, 8000), min_size=2 * WINDOW, max_size=30),
    scale=st.sampled_from([2.0**k for k in range(-6, 7)]),
    offset=st.integers(-8000, 8000),
)
def test_the_rise_does_not_depend_on_the_rewards_scale_or_offset(
    eighths: list[int], scale: float, offset: int
) -> None:
    # Rewards on a grid of eighths (exact in binary): only the means' and spreads' rounding differs.
    rewards = [k / 8 for k in eighths]
    t = rise_t(rewards)
    moved = rise_t([scale * (r + offset / 8) for r in rewards])
    assert t is not None and moved is not None
    if math.isfinite(t):
        assert moved == pytest.approx(t, rel=1e-6, abs=1e-9)
    else:
        assert moved == t


@given(rewards=st.lists(finite, min_size=2 * WINDOW, max_size=30))
def test_a_run_learning_forwards_is_not_learning_backwards(rewards: list[float]) -> None:
    if is_learning(rewards):
        assert not is_learning(rewards[::-1])


# --- the spacing -------------------------------------------------------------------------------------
def test_the_issues_figures_half_a_bf16_spacing_at_two_to_the_minus_six() -> None:
    # 40 Adam steps at 1e-6 move a master weight by 4e-5; half a bf16 spacing at 2**-6 is 6.1e-5.
    share, exponent = out_of_reach(40 * 1e-6, WEIGHTS)
    assert exponent == -6 and WEIGHTS.half_spacing(-6) == pytest.approx(6.1e-5, rel=1e-2)
    assert share == pytest.approx(0.92)
    assert out_of_reach(1.0, WEIGHTS) == (0.0, None)  # a move past every weight's spacing
    assert out_of_reach(0.0, WEIGHTS) == (1.0, -10)  # no move: no weight can change


@given(
    exponents=st.dictionaries(st.integers(-40, 4), st.integers(1, 1000), min_size=1, max_size=10),
    zeros=st.integers(0, 100),
    moves=st.lists(st.floats(0, 1.0), min_size=2, max_size=2),
)
def test_a_larger_move_leaves_fewer_weights_out_of_reach(
    exponents: dict[int, int], zeros: int, moves: list[float]
) -> None:
    weights = WeightMagnitudes("bfloat16", 2.0**-7, exponents, zeros)
    small, large = sorted(moves)
    share_small, _ = out_of_reach(small, weights)
    share_large, lowest = out_of_reach(large, weights)
    assert 0.0 <= share_large <= share_small <= 1.0
    # Out of reach are exactly the weights whose half spacing exceeds the move, from `lowest` up.
    beyond = [e for e in exponents if weights.half_spacing(e) > large]
    assert lowest == (min(beyond) if beyond else None)
    assert share_large == pytest.approx(sum(exponents[e] for e in beyond) / (sum(exponents.values()) + zeros))


# --- each hint, on a run built to trip it -------------------------------------------------------------
def test_sampling_weights_barely_changing_names_the_lr_against_the_spacing() -> None:
    _, said = run_steps(FIRST_HINT_STEP, reward_mean=0.04, changed_fraction_since_start=0.003)
    message = only_hint(said)
    assert said[FIRST_HINT_STEP - 1] == [message]  # at the first step a hint may come
    assert message.startswith("only 0.30% of the sampling weights changed in 15 actor steps")
    # 15 steps x 1e-6 = 1.5e-5 < 6.1e-5 = half a bf16 spacing at 2**-6, where 92 % of the weights are.
    assert "--lr 1e-06 moves a weight by at most about 1.5e-05 in their 15 Adam steps" in message
    assert "half a bfloat16 spacing (>= 6.1e-05 for |w| >= 2^-6) for 92% of this model's weights" in message
    assert message.endswith("raise --lr (now 1e-06): about 4e-06 moves the median weight that far")


def test_weights_that_do_not_move_at_a_large_lr_point_at_the_updates() -> None:
    facts = dataclasses.replace(FACTS, lr=1e-3)
    _, said = run_steps(
        FIRST_HINT_STEP, facts, reward_mean=0.04, changed_fraction_since_start=0.0, actor_lr=1e-3
    )
    message = only_hint(said)
    assert (
        "although --lr 0.001 could move most of them: the updates are near zero, actor/grad_norm 0.5"
        in message
    )


def test_most_groups_tied_shows_the_share_and_two_responses() -> None:
    _, said = run_steps(FIRST_HINT_STEP, reward_mean=0.0, tied_groups=0.75)
    message = only_hint(said)
    assert message.startswith("75% of prompts over the last 5 steps had all 8 samples scored the same")
    assert "(e.g. 'The answer is 15.' -> 0, '7' -> 0)" in message
    assert "--custom-rm-path" in message and "--n-samples-per-prompt" in message
    # A run without a reward (`--rm-type none`, distillation alone): every group ties, and says nothing.
    _, said = run_steps(
        FIRST_HINT_STEP, dataclasses.replace(FACTS, rewarded=False), reward_mean=0.0, tied_groups=1.0
    )
    assert said == [[]] * FIRST_HINT_STEP


def test_a_critic_below_zero_after_its_window_names_warm_up_and_critic_lr() -> None:
    facts = dataclasses.replace(FACTS, num_critic_only_steps=12, critic_lr=0.0)
    _, said = run_steps(FIRST_HINT_STEP + 2, facts, reward_mean=0.04, explained_variance=lambda k: -1.0 - k)
    # 12 warm-up steps + a window of 5: the 17th step is the first it may judge.
    assert said[FIRST_HINT_STEP] == [] and said[FIRST_HINT_STEP + 1] != []
    message = only_hint(said)
    assert message.startswith("critic/explained_variance averaged -15.00 over the last 5 steps")
    assert "--num-critic-only-steps, now 12" in message and "--critic-lr (now 0)" in message


def test_most_responses_truncated_names_the_response_limit() -> None:
    _, said = run_steps(FIRST_HINT_STEP, reward_mean=0.04, truncated=0.6)
    assert only_hint(said) == (
        "60% of responses over the last 5 steps hit --rollout-max-response-len 64 (reward/truncated): they "
        "are cut before they end; raise --rollout-max-response-len or ask for shorter answers"
    )


def test_at_the_thresholds_nothing_fires() -> None:
    _, said = run_steps(
        FIRST_HINT_STEP + 5,
        reward_mean=0.04,
        changed_fraction_since_start=STATIC_WEIGHTS_FRACTION,
        tied_groups=TIED_GROUPS_SHARE,
        truncated=TRUNCATED_SHARE,
        explained_variance=CRITIC_EV_FLOOR,
    )
    assert said == [[]] * (FIRST_HINT_STEP + 5)


def test_a_run_that_learns_gets_no_hint_whatever_else_it_shows() -> None:
    _, said = run_steps(
        40,
        reward_mean=lambda k: 0.04 + 0.02 * k,  # the demo's pace
        changed_fraction_since_start=0.0,
        tied_groups=1.0,
        truncated=1.0,
        explained_variance=-2.0,
    )
    assert said == [[]] * 40


def test_every_hint_fires_once_and_a_resumed_run_does_not_repeat_them() -> None:
    bad = {
        "reward_mean": 0.5,
        "changed_fraction_since_start": 0.0,
        "tied_groups": 1.0,
        "truncated": 1.0,
        "explained_variance": -1.0,
    }
    health, said = run_steps(30, **bad)
    assert [len(s) for s in said] == [0] * (FIRST_HINT_STEP - 1) + [4] + [0] * 15
    assert health.fired == {"static_weights", "tied_groups", "critic", "truncated"}
    resumed = RunHealth(FACTS)
    resumed.replay(health.history[:20])
    assert resumed.fired == health.fired
    assert resumed.observe(dataclasses.replace(HEALTHY, step=20, **bad)) == []


@given(
    rewards=st.lists(st.floats(0, 1), min_size=FIRST_HINT_STEP, max_size=25),
    tied=st.floats(0, 1),
    truncated=st.floats(0, 1),
    changed=st.floats(0, 1),
    explained=st.floats(-3, 1),
)
def test_no_hint_while_learning_and_none_twice(
    rewards: list[float], tied: float, truncated: float, changed: float, explained: float
) -> None:
    health = RunHealth(FACTS)
    names: list[str] = []
    for k, reward in enumerate(rewards):
        figure = StepFigures(
            step=k,
            reward_mean=reward,
            tied_groups=tied,
            truncated=truncated,
            explained_variance=explained,
            actor_trained=True,
            actor_lr=1e-6,
            changed_fraction_since_start=changed,
        )
        hints = health.observe(figure)
        if health.learning() or k + 1 < FIRST_HINT_STEP:
            assert hints == []
        names += [h.name for h in hints]
    assert len(names) == len(set(names))


# --- the figures ---------------------------------------------------------------------------------------
def test_step_figures_read_the_metrics_and_skip_undefined_values() -> None:
    figures = StepFigures.from_metrics(
        3,
        {
            "reward/mean": 0.25,
            "reward/tied_groups": 0.5,
            "critic/explained_variance": None,  # undefined that step (metrics.jsonl's null)
            "actor/pg_loss": 0.1,
            "actor/lr": 1e-6,
            "policy/changed_fraction_since_start": float("nan"),
        },
    )
    assert figures == StepFigures(
        step=3, reward_mean=0.25, tied_groups=0.5, actor_trained=True, actor_lr=1e-6
    )


def test_the_critics_window_is_the_mean_of_its_last_explained_variances() -> None:
    health, _ = run_steps(7, explained_variance=lambda k: float(k))
    assert health.window_metrics() == {
        "critic/explained_variance_window": pytest.approx((2 + 3 + 4 + 5 + 6) / 5)
    }
    assert RunHealth(FACTS).window_metrics() == {}


def test_tied_examples_come_from_prompts_whose_samples_all_scored_the_same() -> None:
    responses = ["a", "b", "c", "d", "e", "f", "g", "h"]
    rewards = [0.0, 1.0, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0]  # groups of 2: (0, 1) differ, the rest tie
    assert tied_examples(responses, rewards, 2) == [("c", 0.5), ("e", 1.0)]
    assert tied_examples(responses, rewards, 4) == []
    assert WeightMagnitudes.of({"dtype": "float32", "eps": 2**-23, "exponents": {"-3": 2}, "zeros": 1}) == (
        WeightMagnitudes("float32", 2**-23, {-3: 2}, 1)
    )
