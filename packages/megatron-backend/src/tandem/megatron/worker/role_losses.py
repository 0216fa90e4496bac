"""The two roles' losses of one micro-batch, pure functions of the batch and the forward's outputs.

`critic_loss` and `actor_loss` are what `train_step.train_step` hands to each
micro-batch's backward (stage 3 of `roles`), in Megatron's per-token form: a
(loss sum, token count, metric numerators) triple that the schedule sums over
micro-batches and data-parallel ranks before dividing (`aggregation.loss_sum_and_count`).
The metric names below are what they add up, and what `roles` reports.
"""

from __future__ import annotations

import torch

from tandem.megatron.algorithms.aggregation import loss_sum_and_count, metric_aggregation
from tandem.megatron.algorithms.cispo import cispo_policy_loss
from tandem.megatron.algorithms.distillation import distillation_loss, reverse_kl
from tandem.megatron.algorithms.gae import lambda_returns
from tandem.megatron.algorithms.gspo import gspo_policy_loss
from tandem.megatron.algorithms.importance import tis_sequence_mask, tis_weights
from tandem.megatron.algorithms.kl import approx_kl
from tandem.megatron.algorithms.losses import policy_loss, value_loss_and_metrics
from tandem.megatron.batch import RolloutBatch, pad_responses, to_device
from tandem.megatron.config import WorkerConfig
from tandem.megatron.worker.response_outputs import ResponseOutputs

CRITIC_STEP_METRICS = ("value_loss", "value_clip_frac")
"""Exact means over each optimizer step of the critic."""
ACTOR_STEP_METRICS = (
    "pg_loss",
    "clip_frac",
    "dual_clip_frac",
    "approx_kl",
    "kl_loss",
    "entropy",
    "tis_weight",
    "tis_masked_frac",
    "opd_reverse_kl",
    "opd_loss",
    "sampler_log_prob_gap",
)
"""Exact means over each optimizer step of the actor (`kl_loss`, `entropy`, `tis_weight` only when configured;
`tis_masked_frac`, the tokens whose sequence `tis_mode` seq_mask left out, only with it; `opd_reverse_kl`, the
student's per-token reverse KL to the teacher as it trains, with `opd_coef`; `opd_loss` with `opd_mode` loss;
`sampler_log_prob_gap`, `|old_log_probs - rollout_log_probs|` per token, where the rollout has the engine's
log-probs: how far the sampler's policy is from the trainer's). `pg_loss`, `kl_loss` and `opd_loss` are the
loss's terms, aggregated as the loss (`loss_aggregation`); the others are per-token figures, token means per
sample where the loss sums over tokens (`aggregation.metric_aggregation`)."""
CRITIC_ROLLOUT_METRICS = ("values_mean", "returns_mean", "explained_variance", "reward_kl")
"""Figures of the rollout's targets, over the data-parallel group (`reward_kl` only with `kl_coef != 0`)."""
ACTOR_ROLLOUT_METRICS = (
    "log_prob",
    "advantages_mean",
    "values_mean",
    "returns_mean",
    "reward_kl",
    "tied_groups",
)
"""Figures of the rollout's targets, over the data-parallel group (advantages before whitening;
`values_mean` with GAE only; `returns_mean` with GAE and REINFORCE++(-baseline); `reward_kl`, the
mean per-token KL of the reward, only with `kl_coef != 0`; `tied_groups`, the fraction of prompts
whose samples all got the same reward, with the group estimators)."""


LossResult = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def critic_loss(config: WorkerConfig, mb: RolloutBatch, outputs: ResponseOutputs) -> LossResult:
    """The clipped value loss of a micro-batch as (sum, count, metric numerators) (`aggregation.loss_sum_and_count`)."""
    values = outputs["values"]
    mask = mb.padded_loss_mask(values.device)
    if mb.old_values is None:
        # reuse_old_values: this forward runs on the weights the rollout's training starts from
        # (one epoch, one step), so its values are the old values, and the returns follow from them.
        assert mb.token_rewards is not None, "train_critic fills them"
        old_values = values.detach()
        returns = lambda_returns(mb.token_rewards, old_values, mask, config.gamma, config.critic_lambda)
    else:
        assert mb.returns is not None, "critic_targets fills them"
        old_values, returns = mb.old_values, mb.returns
    per_token, token_metrics = value_loss_and_metrics(values, old_values, returns, config.value_clip)
    mode, norm = config.loss_aggregation, config.loss_norm_tokens
    loss_sum, count = loss_sum_and_count(per_token, mask, mode, norm_tokens=norm)
    clip_sum, _ = loss_sum_and_count(token_metrics["value_clip_frac"], mask, metric_aggregation(mode))
    return loss_sum, count, {"value_loss": loss_sum.detach(), "value_clip_frac": clip_sum}


def actor_loss(config: WorkerConfig, mb: RolloutBatch, outputs: ResponseOutputs) -> LossResult:
    """Policy loss + KL loss + distillation loss − entropy bonus of a micro-batch as (sum, count, metric numerators).

    All terms share the loss mask and aggregation mode, hence one count.
    """
    assert mb.advantages is not None, "actor_targets fills them"
    log_probs = outputs["log_probs"]
    # With one epoch and one step the old log-probs are this forward's own (reuse_old_log_probs):
    # the ratio is exactly 1 and the gradient flows through `log_probs` alone.
    old_log_probs = mb.old_log_probs if mb.old_log_probs is not None else log_probs.detach()
    mask = mb.padded_loss_mask(log_probs.device)
    mode, norm = config.loss_aggregation, config.loss_norm_tokens
    per_token_mode = metric_aggregation(mode)
    per_token, token_metrics = _policy_loss(config, log_probs, old_log_probs, mb.advantages, mask)
    metrics: dict[str, torch.Tensor] = {}
    if config.use_tis:
        # Truncated importance sampling: the rollout came from the engine's policy, not from π_old.
        rollout_log_probs = _rollout_log_probs(mb, log_probs)
        weights = tis_weights(old_log_probs, rollout_log_probs, config.tis_cap, low=config.tis_cap_low)
        if config.tis_mode == "seq_mask":
            kept = tis_sequence_mask(
                old_log_probs, rollout_log_probs, mask, config.tis_cap, low=config.tis_cap_low
            )
            weights = weights * kept
            metrics["tis_masked_frac"] = loss_sum_and_count(1.0 - kept, mask, per_token_mode)[0]
        per_token = per_token * weights
        metrics["tis_weight"] = loss_sum_and_count(weights, mask, per_token_mode)[0]
    if mb.rollout_log_probs is not None:
        # The engine's log-probs against the trainer's for the same tokens and weights: other kernels,
        # another dtype, or (async) a step of staleness; large gaps make the rollout off-policy.
        gap = (old_log_probs - _rollout_log_probs(mb, log_probs)).abs()
        metrics["sampler_log_prob_gap"] = loss_sum_and_count(gap, mask, per_token_mode)[0]
    pg_sum, count = loss_sum_and_count(per_token, mask, mode, norm_tokens=norm)
    loss_sum = pg_sum
    metrics["pg_loss"] = pg_sum.detach()
    for name in ("clip_frac", "dual_clip_frac", "approx_kl"):
        metrics[name] = loss_sum_and_count(token_metrics[name], mask, per_token_mode)[0]
    if config.use_kl_loss:
        assert mb.ref_log_probs is not None, "actor_targets fills them with use_kl_loss"
        kl = approx_kl(log_probs, mb.ref_log_probs, config.kl_loss_type)
        kl_sum, _ = loss_sum_and_count(kl, mask, mode, norm_tokens=norm)
        loss_sum = loss_sum + config.kl_loss_coef * kl_sum
        metrics["kl_loss"] = kl_sum.detach()
    if config.opd_coef != 0:
        teacher = mb.padded_teacher_log_probs(log_probs.device).to(log_probs.dtype)
        kl_sum, _ = loss_sum_and_count(reverse_kl(log_probs.detach(), teacher), mask, per_token_mode)
        metrics["opd_reverse_kl"] = kl_sum
        if config.opd_mode == "loss":
            opd_sum, _ = loss_sum_and_count(
                distillation_loss(log_probs, teacher), mask, mode, norm_tokens=norm
            )
            loss_sum = loss_sum + config.opd_coef * opd_sum
            metrics["opd_loss"] = opd_sum.detach()
    if config.entropy_coef > 0:
        entropy_sum, _ = loss_sum_and_count(outputs["entropy"], mask, mode, norm_tokens=norm)
        loss_sum = loss_sum - config.entropy_coef * entropy_sum
        metrics["entropy"] = (
            entropy_sum.detach()
            if per_token_mode == mode
            else loss_sum_and_count(outputs["entropy"].detach(), mask, per_token_mode)[0]
        )
    return loss_sum, count, metrics


def _policy_loss(
    config: WorkerConfig,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token policy loss of `loss_type` and its per-token metrics."""
    if config.loss_type == "gspo":
        return gspo_policy_loss(
            log_probs,
            old_log_probs,
            advantages,
            mask,
            config.eps_clip,
            config.eps_clip_high,
            config.eps_clip_c,
        )
    if config.loss_type == "cispo":
        return cispo_policy_loss(log_probs, old_log_probs, advantages, config.eps_clip, config.eps_clip_high)
    return policy_loss(
        log_probs, old_log_probs, advantages, config.eps_clip, config.eps_clip_high, config.eps_clip_c
    )


def _rollout_log_probs(mb: RolloutBatch, like: torch.Tensor) -> torch.Tensor:
    """The engine's log-probs of the micro-batch, padded like `like`; ValueError naming `use_tis` if absent."""
    if mb.rollout_log_probs is None:
        raise ValueError(
            "use_tis: the rollout batch has no rollout_log_probs; truncated importance sampling needs the "
            "engine's per-token log-probs (RolloutBatch.rollout_log_probs), or set use_tis=False"
        )
    lengths = [int(lp.numel()) for lp in mb.rollout_log_probs]
    if lengths != list(mb.response_lengths):
        raise ValueError(
            f"use_tis: rollout_log_probs have lengths {lengths[:8]} but the responses {mb.response_lengths[:8]}; "
            "the engine must report one log-prob per response token"
        )
    return to_device(pad_responses(mb.rollout_log_probs), like.device).to(like.dtype)
