"""One rank's PPO training of the critic and of the actor (docs/design.md, "One PPO step", steps 3 and 4).

Both roles follow the same numbered stages, in this order (`train_critic`, `train_actor`):

1. Forward only, with the weights the rollout's training starts from: the
   old values (critic); the old log-probs and, with a KL loss or reward-level
   KL, the reference log-probs with the reference weights swapped in (actor),
   or those that `compute_log_probs` already returned (the KL-first plan).
   With one epoch and one optimizer step the update's own forward runs with
   those weights and supplies the old log-probs (`reuse_old_log_probs`) and the
   old values (`reuse_old_values`, the returns then computed in the loss).
2. Targets, pure functions of those (`critic_targets`, `actor_targets`),
   stored in the batch as padded per-token fields so that every micro-batch
   carries its own. The rewards are the scalar rewards, or with `kl_coef != 0`
   the KL-folded token rewards (`reward_signal`), the same on both roles since
   both get the actor's old and reference log-probs (the reverse KL to the teacher too, with
   `opd_mode` reward: the teacher's log-probs come in the batch). Critic: old values →
   λ-returns (`gae.lambda_returns`, no advantages); actor: the advantage
   estimator's (`estimators`): GAE on the critic's values (0 without a critic),
   or, critic-free, a group baseline of the rollout's rewards
   (`rollout_rewards`) or REINFORCE++'s discounted returns → whitening over the
   data-parallel group when asked (`estimators.whitens`).
3. The train step (`train_step.train_step`): `ppo_epochs` passes of
   minibatches, each an optimizer step on the role's loss
   (`role_losses.critic_loss`, `role_losses.actor_loss`, pure, in Megatron's
   per-token form).
4. Metrics, the same on every rank (`train_step.reduce_metrics`); the
   critic's pipeline-last-stage ranks add their old values (a `Box`) for the actor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.megatron.algorithms.gae import scalar_at_last_token
from tandem.megatron.algorithms.rollout_rewards import estimator_rewards
from tandem.megatron.batch import RolloutBatch, to_device, unpad_responses
from tandem.megatron.payloads import ActorLogProbs, CriticValues, TrainResult
from tandem.megatron.worker._trainee import Trainee
from tandem.megatron.worker.forward import forward_only
from tandem.megatron.worker.received import any_rank, critic_values, log_probs_for, raise_if
from tandem.megatron.worker.response_outputs import ResponseOutputs
from tandem.megatron.worker.role_losses import (
    ACTOR_ROLLOUT_METRICS,
    ACTOR_STEP_METRICS,
    CRITIC_ROLLOUT_METRICS,
    CRITIC_STEP_METRICS,
    LossResult,
    actor_loss,
    critic_loss,
)
from tandem.megatron.worker.targets import actor_targets, clipped_rewards, critic_targets, reward_signal
from tandem.megatron.worker.train_clock import timed_part
from tandem.megatron.worker.train_step import reduce_metrics, train_step
from tandem.value_transfer import pack_values

# --- the two roles, stage by stage ------------------------------------------------------------------
TargetsHook = Callable[[RolloutBatch], None]
"""Called with the batch once its targets are in (the worker keeps a host copy for `last_targets`)."""


def _actor_log_probs(trainee: Trainee, batch: RolloutBatch) -> torch.Tensor | None:
    """Old log-probs of every sample under `temperature` (last stage; None elsewhere). Every rank must call."""
    config = trainee.config
    return forward_only(
        trainee.chunks,
        batch,
        role="actor",
        temperature=config.temperature,
        micro_batch_size=config.forward_micro_batch_size,
        packed=config.use_sequence_packing,
        max_tokens=config.micro_batch_tokens(forward_only=True),
        log_probs_chunk_tokens=config.log_probs_chunk_tokens,
        fused_log_probs=config.fused_log_probs,
        head_at_responses=config.head_at_responses,
    )


def compute_log_probs(trainee: Trainee, batch: RolloutBatch) -> ActorLogProbs | None:
    """Stage 1 of the actor alone, for the KL-first plan: old and reference log-probs as Boxes.

    Returns, on pipeline-last-stage ranks, an `ActorLogProbs`, each Box
    `pack_values` of one tensor per sample (its response length); its
    `ref_log_probs` only when the actor has a reference (host copies, or a LoRA base). None on other stages.
    """

    old_log_probs = _actor_log_probs(trainee, batch)
    ref_log_probs = None
    if trainee.has_reference:
        with trainee.reference_weights():
            ref_log_probs = _actor_log_probs(trainee, batch)
    if old_log_probs is None:
        return None
    return ActorLogProbs(
        log_probs=pack_values(unpad_responses(old_log_probs, batch.response_lengths)),
        ref_log_probs=None
        if ref_log_probs is None
        else pack_values(unpad_responses(ref_log_probs, batch.response_lengths)),
        sample_indices=tuple(batch.sample_indices),
    )


def train_critic(
    trainee: Trainee,
    batch: RolloutBatch,
    group: Any,
    *,
    log_probs: ActorLogProbs | None = None,
    rank: int,
    rollout_id: int,
    on_targets: TargetsHook | None = None,
    kl_coef: float | None = None,
) -> TrainResult:
    """Step 3 on one critic rank: its metrics, and its old values (`CriticValues`) on last-stage ranks.

    `log_probs`: in the KL-first plan (`kl_first`), the actor's `compute_log_probs` record for
    this rank (routed by `TrainGroup.train`); ignored otherwise. `kl_coef`: this step's
    reward-level KL coefficient (the adaptive controller's); None: the config's.
    """
    from megatron.core import parallel_state as mpu

    config = trainee.config
    last = mpu.is_pipeline_last_stage()
    dp_group = mpu.get_data_parallel_group()
    # The actor's log-probs (the KL-first plan), checked on every rank before any collective, so
    # that all fail alike.
    old_log_probs = ref_log_probs = None
    error: Exception | None = None
    needs_ref = config.kl_coef != 0
    if config.kl_first and last:
        try:
            old_log_probs = log_probs_for(log_probs, batch, rank=rank)
            if needs_ref:
                ref_log_probs = log_probs_for(log_probs, batch, rank=rank, reference=True)
        except (ValueError, TypeError) as exc:
            error = exc
    missing = last and (old_log_probs is None or (needs_ref and ref_log_probs is None))
    if config.kl_first:
        failed, missing = any_rank([error is not None, missing], group)
        raise_if(failed, error)
        if missing:
            field, what = (
                (f"kl_coef: {config.kl_coef} folds the KL", "log-probs and reference log-probs")
                if needs_ref
                else (f"opd_coef: {config.opd_coef} folds the reverse KL to the teacher", "log-probs")
            )
            raise ValueError(
                f"{field} into the rewards, but critic ranks got no actor {what}; run the actor's "
                "compute_log_probs first and pass its results as the critic's log_probs (the KL-first plan)"
            )
    # 1. old values: a forward pass of their own, or (reuse_old_values) the update's own forward's
    from_update = config.reuses_old_values
    old_values = None
    if not from_update:
        with timed_part(trainee.clock, "old_values"):
            old_values = forward_only(
                trainee.chunks,
                batch,
                role="critic",
                micro_batch_size=config.forward_micro_batch_size,
                packed=config.use_sequence_packing,
                max_tokens=config.micro_batch_tokens(forward_only=True),
            )
    # 2. targets, on the (KL-folded) rewards
    figures: dict[str, torch.Tensor] = {}
    rewards: torch.Tensor | None = None
    if last:
        rewards, figures = reward_signal(
            batch,
            old_log_probs,
            ref_log_probs,
            config,
            device=trainee.device,
            dp_group=dp_group,
            kl_coef=kl_coef,
        )
    if old_values is not None:
        batch, target_figures = critic_targets(batch, old_values, config, rewards=rewards, dp_group=dp_group)
        figures |= target_figures
        if on_targets is not None:
            on_targets(batch)
    elif last:
        assert rewards is not None
        if rewards.dim() == 1:
            rewards = scalar_at_last_token(rewards, batch.padded_loss_mask(trainee.device))
        batch = batch.with_targets(token_rewards=rewards)
    # 3. train step; with reuse_old_values each micro-batch's values are kept (last stage)
    seen: list[tuple[list[int], torch.Tensor]] = []

    def loss(mb: RolloutBatch, outputs: ResponseOutputs) -> LossResult:
        if from_update:
            seen.append((mb.sample_indices, outputs["values"].detach()))
        return critic_loss(config, mb, outputs)

    sums = train_step(trainee, batch, loss, rollout_id=rollout_id, passes=config.critic_passes)
    if from_update and last:
        old_values = _update_values(batch, seen)
        batch, target_figures = critic_targets(batch, old_values, config, rewards=rewards, dp_group=dp_group)
        figures |= target_figures
        if on_targets is not None:
            on_targets(batch)
    # 4. metrics, and the old values for the actor
    rollout_metrics = [k for k in CRITIC_ROLLOUT_METRICS if k != "reward_kl" or config.kl_coef != 0]
    metrics = reduce_metrics(
        group,
        sums,
        step_metrics=CRITIC_STEP_METRICS,
        rollout={k: figures.get(k) for k in rollout_metrics},
        last=last,
    )
    values = None
    if old_values is not None:
        values = CriticValues(
            values=pack_values(unpad_responses(old_values, batch.response_lengths)),
            sample_indices=tuple(batch.sample_indices),
        )
    return TrainResult(metrics=metrics, values=values)


def _update_values(batch: RolloutBatch, seen: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
    """The values the update's micro-batches computed, `(n, max_response_len)` in `batch`'s order."""
    position = {index: i for i, index in enumerate(batch.sample_indices)}
    rows = [position[index] for indices, _ in seen for index in indices]
    assert sorted(rows) == list(range(len(batch))), "one epoch, one step: every sample exactly once"
    device = seen[0][1].device
    values = torch.zeros(len(batch), batch.max_response_length, device=device)
    for indices, mb_values in seen:
        at = torch.tensor([position[index] for index in indices], dtype=torch.long)
        values[to_device(at, device), : mb_values.shape[1]] = mb_values
    return values


def train_actor(
    trainee: Trainee,
    batch: RolloutBatch,
    group: Any,
    *,
    critic: CriticValues | None = None,
    log_probs: ActorLogProbs | None = None,
    rank: int,
    rollout_id: int,
    on_targets: TargetsHook | None = None,
    kl_coef: float | None = None,
) -> TrainResult:
    """Step 4 on one actor rank: its metrics.

    `critic`: the critic's values for this rank, None without a critic (values 0);
    `log_probs`: in the KL-first plan this rank's own `compute_log_probs` record, reused;
    `kl_coef`: this step's reward-level KL coefficient (the adaptive controller's); None: the config's.
    """
    from megatron.core import parallel_state as mpu

    config = trainee.config
    last = mpu.is_pipeline_last_stage()
    needs_ref = config.needs_reference
    # 1. old log-probs, and reference log-probs with the reference weights swapped in. Given ones
    # (compute_log_probs ran on these very weights, which have not changed since) are reused: on
    # the CPU they are bit-equal to a recomputation, on the GPU equal up to kernel nondeterminism,
    # and reusing them is what makes critic and actor fold the very same KL into the rewards.
    # Every rank of the model must take the same branch (the forward passes are collective).
    given_old = given_ref = None
    error: Exception | None = None
    try:
        if last:
            given_old = log_probs_for(log_probs, batch, rank=rank)
            given_ref = log_probs_for(log_probs, batch, rank=rank, reference=True) if needs_ref else None
    except (ValueError, TypeError) as exc:
        error = exc
    failed, recompute_old, recompute_ref = any_rank(
        [error is not None, last and given_old is None, last and needs_ref and given_ref is None], group
    )
    raise_if(failed, error)
    reuse_old, reuse_ref = not recompute_old, not recompute_ref
    # With one epoch and one optimizer step the update's own forward supplies them instead
    # (reuse_old_log_probs; decided from the config, alike on every rank).
    from_update = not reuse_old and config.reuses_old_log_probs
    old_log_probs = given_old if reuse_old else None
    if not reuse_old and not from_update:
        with timed_part(trainee.clock, "old_log_probs"):
            old_log_probs = _actor_log_probs(trainee, batch)
    ref_log_probs = None
    if needs_ref:
        if reuse_ref:
            ref_log_probs = given_ref
        else:
            with timed_part(trainee.clock, "reference_log_probs"), trainee.reference_weights():
                ref_log_probs = _actor_log_probs(trainee, batch)
    # 2. targets, on the critic's values and the (KL-folded) rewards
    figures: dict[str, torch.Tensor] = {}
    if last:
        assert old_log_probs is not None or from_update, "the last stage computes or is given log-probs"
        device = trainee.device
        values = critic_values(critic, batch, rank=rank, device=device) if config.uses_critic else None
        dp_group = mpu.get_data_parallel_group()
        # Critic-free group estimators: each sample's reward less its prompt's baseline, pooled over DP.
        scalar_rewards, group_figures = estimator_rewards(
            config.advantage_estimator,
            clipped_rewards(batch.rewards, config),
            batch.sample_indices,
            n_samples_per_prompt=config.n_samples_per_prompt,
            std_normalization=config.grpo_std_normalization,
            group=dp_group,
        )
        rewards, figures = reward_signal(
            batch,
            old_log_probs,
            ref_log_probs,
            config,
            device=device,
            dp_group=dp_group,
            scalar_rewards=scalar_rewards,
            kl_coef=kl_coef,
        )
        figures |= group_figures
        batch, target_figures = actor_targets(
            batch,
            old_log_probs,
            ref_log_probs,
            values,
            config,
            rewards=rewards,
            dp_group=dp_group,
            device=device,
        )
        figures |= target_figures
        if on_targets is not None:
            on_targets(batch)
    # 3. train step
    sums = train_step(
        trainee,
        batch,
        lambda mb, out: actor_loss(config, mb, out),
        rollout_id=rollout_id,
        with_entropy=config.entropy_coef > 0,
    )
    # 4. metrics
    skip = (
        ({"kl_loss"} if not config.use_kl_loss else set())
        | ({"entropy"} if config.entropy_coef <= 0 else set())
        | ({"tis_weight"} if not config.use_tis else set())
        | ({"tis_masked_frac"} if not (config.use_tis and config.tis_mode == "seq_mask") else set())
        | ({"sampler_log_prob_gap"} if batch.rollout_log_probs is None else set())
        | ({"reward_kl"} if config.kl_coef == 0 else set())
        | ({"opd_reverse_kl"} if config.opd_coef == 0 else set())
        | ({"opd_loss"} if config.opd_coef == 0 or config.opd_mode != "loss" else set())
        | ({"values_mean"} if not config.estimator.needs_critic else set())
        | ({"returns_mean"} if config.estimator.per_sample else set())
        | ({"tied_groups"} if not config.estimator.groups else set())
        | ({"log_prob"} if from_update else set())
    )
    metrics = reduce_metrics(
        group,
        sums,
        step_metrics=[k for k in ACTOR_STEP_METRICS if k not in skip],
        rollout={k: figures.get(k) for k in ACTOR_ROLLOUT_METRICS if k not in skip},
        last=last,
    )
    return TrainResult(metrics=metrics)
