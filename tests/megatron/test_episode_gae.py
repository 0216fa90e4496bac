"""GAE over an episode of two turns, by hand: the model's tokens are the steps, the context between
turns is skipped, each turn's reward reaches GAE at that turn's last model token."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.megatron import WorkerConfig
from tandem.megatron.algorithms.gae import compute_gae
from tandem.megatron.algorithms.kl import approx_kl, kl_penalized_rewards
from tandem.megatron.batch import RolloutBatch
from tandem.megatron.worker.targets import actor_targets, critic_targets, reward_signal

# The response after the first prompt: turn 1 (two model tokens), three context tokens (the
# environment's observation through the chat template), turn 2 (two model tokens).
MASK = [1, 1, 0, 0, 0, 1, 1]
# Turn 1 earns 0.5 (at its last token, position 1), turn 2 earns 1.0 (position 6).
STEP_REWARDS = [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0]
# The critic's values; those at context tokens (9.0) must not matter.
VALUES = [0.2, 0.4, 9.0, 9.0, 9.0, 0.6, 0.8]
GAMMA, LAMBD = 0.9, 0.8

# By hand, over the steps t0, t1, t5, t6 (the hole is no step, so t1 bootstraps from V(t5)):
#   δ0 = 0   + 0.9·0.4 − 0.2 = 0.16        δ1 = 0.5 + 0.9·0.6 − 0.4 = 0.64
#   δ2 = 0   + 0.9·0.8 − 0.6 = 0.12        δ3 = 1.0 + 0.9·0   − 0.8 = 0.20   (nothing after the end)
#   γλ = 0.72:  A3 = 0.2,  A2 = 0.12 + 0.72·0.2 = 0.264,  A1 = 0.64 + 0.72·0.264 = 0.83008,
#               A0 = 0.16 + 0.72·0.83008 = 0.7576576;  returns = A + V.
ADVANTAGES = [0.7576576, 0.83008, 0.0, 0.0, 0.0, 0.264, 0.2]
RETURNS = [0.9576576, 1.23008, 0.0, 0.0, 0.0, 0.864, 1.0]


def episode_batch() -> RolloutBatch:
    prompt = [5, 6, 7]
    response = list(range(10, 17))
    return RolloutBatch(
        tokens=[torch.tensor(prompt + response)],
        response_lengths=[len(response)],
        loss_masks=[torch.tensor(MASK, dtype=torch.float32)],
        rewards=torch.tensor([sum(STEP_REWARDS)]),
        step_rewards=[torch.tensor(STEP_REWARDS)],
    )


CPU = torch.device("cpu")
MakeConfig = Callable[..., WorkerConfig]


@pytest.fixture
def config(tmp_path: Path) -> MakeConfig:
    """A worker config of `estimator` with γ, λ above, no whitening (the advantages stay the hand's)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))

    def make(estimator: str, **overrides: object) -> WorkerConfig:
        fields: dict[str, object] = {
            "hf_checkpoint": str(tmp_path),
            "rollout_batch_size": 1,
            "global_batch_size": 1,
            "device": "cpu",
            "params_dtype": "float32",
            "normalize_advantages": False,
            "advantage_estimator": estimator,
            "gamma": GAMMA,
            "lambd": LAMBD,
            "n_samples_per_prompt": 1,
            **overrides,
        }
        return WorkerConfig(**fields)  # type: ignore[arg-type]

    return make


def test_gae_over_an_episodes_turns_by_hand(config: MakeConfig) -> None:
    # The worker's path: reward_signal, then the critic's returns and the actor's advantages.
    batch, gae = episode_batch(), config("gae")
    rewards, figures = reward_signal(batch, None, None, gae, device=CPU)
    assert figures == {} and rewards.tolist() == [STEP_REWARDS]
    critic_batch, _ = critic_targets(batch, torch.tensor([VALUES]), gae, rewards=rewards)
    assert critic_batch.returns is not None
    assert critic_batch.returns[0].tolist() == pytest.approx(RETURNS)
    actor_batch, _ = actor_targets(
        batch, None, None, torch.tensor([VALUES]), gae, rewards=rewards, device=CPU
    )
    assert actor_batch.advantages is not None
    assert actor_batch.advantages[0].tolist() == pytest.approx(ADVANTAGES)


def test_each_turns_reward_is_clipped_at_its_token(config: MakeConfig) -> None:
    # --reward-clip 0.6 on turn rewards 0.5 and 1.0: 0.5 stays, 1.0 becomes 0.6, at the same tokens.
    rewards, _ = reward_signal(episode_batch(), None, None, config("gae", reward_clip=0.6), device=CPU)
    assert rewards[0].tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.6])


def test_the_scalar_reward_alone_would_put_both_turns_rewards_at_the_end() -> None:
    # What the per-turn rewards change: with the total (1.5) at the last token, turn 1's tokens see
    # its reward only discounted through turn 2's steps.
    batch = episode_batch()
    scalar, _ = compute_gae(batch.rewards, torch.tensor([VALUES]), batch.padded_loss_mask(), GAMMA, LAMBD)
    per_turn, _ = compute_gae(
        torch.tensor([STEP_REWARDS]), torch.tensor([VALUES]), batch.padded_loss_mask(), GAMMA, LAMBD
    )
    assert scalar[0, 6] == pytest.approx(0.7) and per_turn[0, 6] == pytest.approx(0.2)
    assert per_turn[0, 1] > scalar[0, 1]


def test_a_group_estimator_compares_the_episodes_totals(config: MakeConfig) -> None:
    batch = episode_batch()
    rewards, _ = reward_signal(batch, None, None, config("grpo", n_samples_per_prompt=2), device=CPU)
    assert rewards.tolist() == [1.5]


def test_the_kl_folds_into_the_turn_rewards_at_model_tokens_only(config: MakeConfig) -> None:
    batch = episode_batch()
    log_probs = torch.tensor([[-1.0, -2.0, 0.0, 0.0, 0.0, -1.5, -0.5]])
    ref_log_probs = torch.tensor([[-1.5, -1.0, 0.0, 0.0, 0.0, -1.5, -1.0]])
    rewards, figures = reward_signal(batch, log_probs, ref_log_probs, config("gae", kl_coef=0.1), device=CPU)
    # k1 = log π − log π_ref per model token: 0.5, −1.0, 0, 0.5; r_t − 0.1·k1 there, 0 at the context.
    expected = [0.0 - 0.05, 0.5 + 0.1, 0.0, 0.0, 0.0, 0.0, 1.0 - 0.05]
    assert rewards[0].tolist() == pytest.approx(expected)
    assert "reward_kl" in figures
    direct = kl_penalized_rewards(
        torch.tensor([STEP_REWARDS]), log_probs, ref_log_probs, batch.padded_loss_mask(), 0.1
    )
    assert torch.equal(direct, rewards)
    assert approx_kl(log_probs, ref_log_probs, "k1")[0, 0] == pytest.approx(0.5)


def test_step_rewards_must_cover_the_response() -> None:
    with pytest.raises(ValueError, match="step_rewards of 2 entries, expected 7"):
        RolloutBatch(
            tokens=[torch.arange(10)],
            response_lengths=[7],
            loss_masks=[torch.ones(7)],
            rewards=torch.zeros(1),
            step_rewards=[torch.zeros(2)],
        )
    assert episode_batch().select([0]).step_rewards is not None
