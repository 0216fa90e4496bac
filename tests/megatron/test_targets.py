"""Stage 2's targets by hand: VAPO's decoupled and length-adaptive λ, reward clipping, a step's KL coefficient.

`worker.targets` is pure (no Megatron): the critic's returns and the actor's
advantages of a two-sample batch, each against GAE written out for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.megatron import RolloutBatch, WorkerConfig
from tandem.megatron.worker.targets import actor_targets, critic_targets, reward_signal


def _config(tmp_path: Path, **overrides: object) -> WorkerConfig:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fields: dict[str, object] = {
        "hf_checkpoint": str(tmp_path),
        "rollout_batch_size": 2,
        "global_batch_size": 2,
        "device": "cpu",
        "params_dtype": "float32",
        "normalize_advantages": False,
    }
    fields.update(overrides)
    return WorkerConfig(**fields)  # type: ignore[arg-type]


def _batch(rewards: list[float]) -> RolloutBatch:
    # Sample 0: two trainable tokens; sample 1: one (its second is masked).
    return RolloutBatch(
        tokens=[torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])],
        response_lengths=[2, 2],
        loss_masks=[torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])],
        rewards=torch.tensor(rewards),
    )


VALUES = torch.tensor([[1.0, 2.0], [0.5, 0.0]])


def test_decoupled_gae_gives_the_critic_its_own_lambda(tmp_path: Path) -> None:
    # γ = 1, reward 3 on sample 0 (values 1, 2). δ = (0 + 2 − 1, 3 − 2) = (1, 1).
    # Critic, λ = 1 (critic_lambd): returns = Monte-Carlo = (3, 3). Actor, λ = 0 (lambd): A = δ = (1, 1).
    # Sample 1 (value 0.5, reward 1): one step, return 1, advantage 0.5, whatever λ.
    config = _config(tmp_path, lambd=0.0, critic_lambd=1.0)
    batch = _batch([3.0, 1.0])
    critic_batch, _ = critic_targets(batch, VALUES, config)
    assert critic_batch.returns is not None
    torch.testing.assert_close(critic_batch.returns, torch.tensor([[3.0, 3.0], [1.0, 0.0]]))
    actor_batch, _ = actor_targets(batch, torch.zeros(2, 2), None, VALUES, config)
    assert actor_batch.advantages is not None
    torch.testing.assert_close(actor_batch.advantages, torch.tensor([[1.0, 1.0], [0.5, 0.0]]))
    # Without critic_lambd the critic takes the actor's λ = 0: returns = r_t + V_{t+1} = (2, 3).
    shared, _ = critic_targets(batch, VALUES, _config(tmp_path, lambd=0.0))
    assert shared.returns is not None
    torch.testing.assert_close(shared.returns[0], torch.tensor([2.0, 3.0]))


def test_length_adaptive_lambda_is_each_responses_own(tmp_path: Path) -> None:
    # α = 1: sample 0 has 2 tokens, λ = 1 − 1/2 = 0.5: A_0 = δ_0 + 0.5 · δ_1 = 1.5, A_1 = 1.
    # Sample 1 has 1 token: λ = 0 (it has no step after its one anyway): A = 1 − 0.5 = 0.5.
    config = _config(tmp_path, length_adaptive_gae_alpha=1.0)
    actor_batch, _ = actor_targets(_batch([3.0, 1.0]), torch.zeros(2, 2), None, VALUES, config)
    assert actor_batch.advantages is not None
    torch.testing.assert_close(actor_batch.advantages, torch.tensor([[1.5, 1.0], [0.5, 0.0]]))


def test_reward_clip_bounds_the_rewards_both_roles_train_on(tmp_path: Path) -> None:
    # Rewards 30 and −0.5 clipped to ±10: 10 and −0.5. The critic's λ = 1 returns of sample 0 are 10.
    config = _config(tmp_path, reward_clip=10.0)
    batch = _batch([30.0, -0.5])
    critic_batch, _ = critic_targets(batch, VALUES, config)
    assert critic_batch.returns is not None
    torch.testing.assert_close(critic_batch.returns, torch.tensor([[10.0, 10.0], [-0.5, 0.0]]))
    rewards, _ = reward_signal(batch, None, None, config, device=torch.device("cpu"))
    torch.testing.assert_close(rewards, torch.tensor([10.0, -0.5]))


def test_a_steps_kl_coefficient_overrides_the_configs(tmp_path: Path) -> None:
    # k1 KL per token = log π − log π_ref = (1, 0 | 2): −β·KL folded into the rewards, the reward 1 at the end.
    log_probs = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref_log_probs = torch.tensor([[-2.0, -1.0], [-3.0, -1.0]])
    config = _config(tmp_path, kl_coef=0.1, kl_target=0.1)
    batch = _batch([1.0, 1.0])
    cpu = torch.device("cpu")
    fixed, figures = reward_signal(batch, log_probs, ref_log_probs, config, device=cpu)
    torch.testing.assert_close(fixed, torch.tensor([[-0.1, 1.0], [0.8, 0.0]]))
    steered, _ = reward_signal(batch, log_probs, ref_log_probs, config, device=cpu, kl_coef=0.5)
    torch.testing.assert_close(steered, torch.tensor([[-0.5, 1.0], [0.0, 0.0]]))
    # The figure the controller reads: the token mean of the KL, (1 + 0 + 2) / 3.
    assert figures["reward_kl"].item() == pytest.approx(1.0)
