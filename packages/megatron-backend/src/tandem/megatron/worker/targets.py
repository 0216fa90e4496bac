"""Stage 2 of both roles' train step: the targets, pure functions of what stage 1 computed.

docs/design.md, "The train step inside steps 3 and 4".

The rewards are the scalar rewards (an episode's rewards at their tokens where the
rollout gave them), or with `kl_coef != 0` (or the teacher's reverse KL in the rewards,
`opd_mode` reward) the KL-folded token rewards (`reward_signal`), the same on both roles
since both get the actor's old and reference log-probs (and the same teacher log-probs in
their batches). Critic: old values → λ-returns (`critic_targets`);
actor: the advantage estimator's advantages, whitened when asked (`actor_targets`).
Each returns the batch with its padded per-token targets set and the rollout's figures.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.megatron.algorithms.advantages import masked_mean_var, whiten_advantages
from tandem.megatron.algorithms.distillation import distillation_rewards
from tandem.megatron.algorithms.estimators import token_advantages, whitens
from tandem.megatron.algorithms.gae import Lambda, lambda_returns, length_adaptive_lambdas
from tandem.megatron.algorithms.kl import approx_kl, kl_penalized_rewards
from tandem.megatron.algorithms.losses import explained_variance
from tandem.megatron.batch import RolloutBatch
from tandem.megatron.config import WorkerConfig

__all__ = ["actor_lambda", "actor_targets", "clipped_rewards", "critic_targets", "reward_signal"]


def clipped_rewards(rewards: torch.Tensor, config: WorkerConfig) -> torch.Tensor:
    """The scalar rewards clipped to ±`reward_clip` (as they are without it), before anything else reads them."""
    if config.reward_clip is None:
        return rewards
    return rewards.clamp(-config.reward_clip, config.reward_clip)


def actor_lambda(config: WorkerConfig, loss_mask: torch.Tensor) -> Lambda:
    """The λ of the actor's GAE: `lambd`, or VAPO's per-response `length_adaptive_lambdas`."""
    alpha = config.length_adaptive_gae_alpha
    return config.lambd if alpha is None else length_adaptive_lambdas(loss_mask, alpha)


def reward_signal(
    batch: RolloutBatch,
    log_probs: torch.Tensor | None,
    ref_log_probs: torch.Tensor | None,
    config: WorkerConfig,
    *,
    device: torch.device,
    dp_group: Any = None,
    scalar_rewards: torch.Tensor | None = None,
    kl_coef: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The rewards the estimator runs on, and their figures: scalar rewards, or token rewards with KLs folded in.

    `scalar_rewards`: the per-sample rewards to use, shape `(n,)` (the estimator's,
    `rollout_rewards.estimator_rewards`); None: `batch.rewards` (`clipped_rewards`). A batch
    with `step_rewards` (episodes rewarded turn by turn) gives an estimator without a group
    baseline (GAE, REINFORCE++) those token rewards, each clipped like a scalar, shape
    `(n, max_response_len)`, 0 at masked tokens; a group estimator compares each sample's total
    with its group's and keeps the scalar. With no KL in the rewards: that, exactly as without
    the KL-first plan (the log-probs are not read). Otherwise token rewards, shape
    `(n, max_response_len)`: `kl.kl_penalized_rewards` of the actor's old and reference
    log-probs (`kl_coef`), and `distillation.distillation_rewards` of the old log-probs and the
    batch's teacher log-probs (`opd_mode` reward); critic and actor call this with the same
    log-probs (the actor's, from `compute_log_probs`) and the same batch, hence the same rewards
    bit for bit. `kl_coef`: this step's coefficient (the adaptive KL controller's, from the
    driver); None: `config.kl_coef`. Whether the KL is folded at all is `config.kl_coef`'s to say.
    """
    scalar = clipped_rewards(batch.rewards, config) if scalar_rewards is None else scalar_rewards
    if batch.step_rewards is not None and not config.estimator.groups:
        steps = batch.padded_step_rewards(device)
        assert steps is not None
        scalar = torch.where(batch.padded_loss_mask(device) != 0, clipped_rewards(steps, config), 0.0)
    if config.kl_coef == 0 and not config.opd_in_rewards:
        return scalar, {}
    assert log_probs is not None, "checked by the caller"
    mask = batch.padded_loss_mask(device)
    log_probs = log_probs.to(device)
    rewards, figures = scalar.to(device), {}
    if config.kl_coef != 0:
        assert ref_log_probs is not None, "checked by the caller"
        ref_log_probs = ref_log_probs.to(device)
        coef = config.kl_coef if kl_coef is None else kl_coef
        rewards = kl_penalized_rewards(rewards, log_probs, ref_log_probs, mask, coef, config.kl_penalty_type)
        kl = approx_kl(log_probs, ref_log_probs, config.kl_penalty_type)
        figures["reward_kl"] = masked_mean_var(kl, mask, group=dp_group)[0]
    if config.opd_in_rewards:
        teacher = batch.padded_teacher_log_probs(device)
        rewards = distillation_rewards(rewards, log_probs, teacher, mask, config.opd_coef)
    return rewards, figures


def critic_targets(
    batch: RolloutBatch,
    old_values: torch.Tensor,
    config: WorkerConfig,
    *,
    rewards: torch.Tensor | None = None,
    dp_group: Any = None,
) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
    """The critic's targets: returns from its old values; (batch with `old_values`, `returns`; rollout figures).

    `rewards`: what `reward_signal` gives; None: `batch.rewards` (`clipped_rewards`). The
    returns' λ is `critic_lambd` when set (VAPO's decoupled GAE), else `lambd`.
    """
    mask = batch.padded_loss_mask(old_values.device)
    rewards = clipped_rewards(batch.rewards, config) if rewards is None else rewards
    returns = lambda_returns(rewards, old_values, mask, config.gamma, config.critic_lambda)
    figures = {
        "values_mean": masked_mean_var(old_values, mask, group=dp_group)[0],
        "returns_mean": masked_mean_var(returns, mask, group=dp_group)[0],
        "explained_variance": explained_variance(old_values, returns, mask, group=dp_group),
    }
    return batch.with_targets(old_values=old_values, returns=returns), figures


def actor_targets(
    batch: RolloutBatch,
    old_log_probs: torch.Tensor | None,
    ref_log_probs: torch.Tensor | None,
    values: torch.Tensor | None,
    config: WorkerConfig,
    *,
    rewards: torch.Tensor | None = None,
    dp_group: Any = None,
    device: torch.device | None = None,
) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
    """The actor's targets: the estimator's advantages (GAE on the critic's values), whitened when configured.

    `values`: the critic's values (GAE), None for a critic-free estimator. `rewards`: what
    `reward_signal` gives; None: `batch.rewards`. Returns the batch with `old_log_probs`,
    `ref_log_probs`, `old_values` (the critic's values it used, if any) and `advantages`,
    and the rollout figures (advantages before whitening). `old_log_probs` None: the update
    takes them from its own forward (`reuse_old_log_probs`), and `log_prob` is not a figure.
    `device`: where the targets go; None: the old log-probs' device.
    """
    if device is None:
        assert old_log_probs is not None, "give the device when there are no old log-probs"
        device = old_log_probs.device
    mask = batch.padded_loss_mask(device)
    values = None if values is None else values.to(device)
    rewards = clipped_rewards(batch.rewards, config) if rewards is None else rewards
    estimator = config.advantage_estimator
    advantages, returns = token_advantages(
        estimator, rewards, values, mask, gamma=config.gamma, lambd=actor_lambda(config, mask)
    )
    figures = {"advantages_mean": masked_mean_var(advantages, mask, group=dp_group)[0]}
    if old_log_probs is not None:
        figures["log_prob"] = masked_mean_var(old_log_probs, mask, group=dp_group)[0]
    if values is not None:
        figures["values_mean"] = masked_mean_var(values, mask, group=dp_group)[0]
    if returns is not None:
        figures["returns_mean"] = masked_mean_var(returns, mask, group=dp_group)[0]
    if whitens(estimator, config.normalize_advantages):
        advantages = whiten_advantages(advantages, mask, group=dp_group)
    targets = batch.with_targets(
        old_log_probs=old_log_probs, ref_log_probs=ref_log_probs, old_values=values, advantages=advantages
    )
    return targets, figures
