"""One rank's PPO training of the critic and of the actor (DESIGN.md, "One PPO step", steps 3 and 4).

Both roles follow the same numbered stages, in this order (`train_critic`, `train_actor`):

1. Forward only, with the weights the rollout's training starts from: the
   old values (critic); the old log-probs and, with a KL loss, the reference
   log-probs with the reference weights swapped in (actor).
2. Targets, pure functions of those (`critic_targets`, `actor_targets`),
   stored in the batch as padded per-token fields so that every micro-batch
   carries its own: critic: old values → λ-returns (`gae.lambda_returns`, no
   advantages); actor: the critic's values (0 without a critic) → GAE
   advantages → whitening over the data-parallel group when asked.
3. The train step (`train_step.train_step`): `ppo_epochs` passes of
   minibatches, each an optimizer step on the role's loss (`critic_loss`,
   `actor_loss`, pure, in Megatron's per-token form).
4. Metrics, the same on every rank (`train_step.reduce_metrics`); the
   critic's pipeline-last-stage ranks add their old values (a `Box`) for the actor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tandem.megatron._trainee import Trainee
from tandem.megatron.advantages import masked_mean_var, whiten_advantages
from tandem.megatron.batch import RolloutBatch, pad_responses, unpad_responses
from tandem.megatron.config import WorkerConfig
from tandem.megatron.forward import ResponseOutputs, forward_only
from tandem.megatron.gae import compute_gae, lambda_returns
from tandem.megatron.kl import approx_kl
from tandem.megatron.losses import (
    explained_variance,
    loss_sum_and_count,
    policy_loss,
    value_loss_and_metrics,
)
from tandem.megatron.train_step import reduce_metrics, train_step

CRITIC_STEP_METRICS = ("value_loss", "value_clip_frac")
"""Exact means over each optimizer step of the critic."""
ACTOR_STEP_METRICS = ("pg_loss", "clip_frac", "dual_clip_frac", "approx_kl", "kl_loss", "entropy")
"""Exact means over each optimizer step of the actor (`kl_loss`, `entropy` only when configured)."""
CRITIC_ROLLOUT_METRICS = ("values_mean", "returns_mean", "explained_variance")
"""Figures of the rollout's targets, over the data-parallel group."""
ACTOR_ROLLOUT_METRICS = ("log_prob", "advantages_mean", "values_mean", "returns_mean")
"""Figures of the rollout's targets, over the data-parallel group (advantages before whitening)."""

LossResult = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


# --- 2. targets -------------------------------------------------------------------------------------
def critic_targets(
    batch: RolloutBatch, old_values: torch.Tensor, config: WorkerConfig, *, dp_group: Any = None
) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
    """The critic's targets: returns from its old values; (batch with `old_values`, `returns`; rollout figures)."""
    mask = batch.padded_loss_mask(old_values.device)
    returns = lambda_returns(batch.rewards, old_values, mask, config.gamma, config.lambd)
    figures = {
        "values_mean": masked_mean_var(old_values, mask, group=dp_group)[0],
        "returns_mean": masked_mean_var(returns, mask, group=dp_group)[0],
        "explained_variance": explained_variance(old_values, returns, mask, group=dp_group),
    }
    return batch.with_targets(old_values=old_values, returns=returns), figures


def actor_targets(
    batch: RolloutBatch,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
    values: torch.Tensor,
    config: WorkerConfig,
    *,
    dp_group: Any = None,
) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
    """The actor's targets: GAE advantages on the critic's values, whitened when configured.

    Returns the batch with `old_log_probs`, `ref_log_probs` and `advantages`, and
    the rollout figures (advantages before whitening).
    """
    mask = batch.padded_loss_mask(old_log_probs.device)
    values = values.to(old_log_probs.device)
    advantages, returns = compute_gae(batch.rewards, values, mask, config.gamma, config.lambd)
    figures = {
        "log_prob": masked_mean_var(old_log_probs, mask, group=dp_group)[0],
        "advantages_mean": masked_mean_var(advantages, mask, group=dp_group)[0],
        "values_mean": masked_mean_var(values, mask, group=dp_group)[0],
        "returns_mean": masked_mean_var(returns, mask, group=dp_group)[0],
    }
    if config.normalize_advantages:
        advantages = whiten_advantages(advantages, mask, group=dp_group)
    targets = batch.with_targets(
        old_log_probs=old_log_probs, ref_log_probs=ref_log_probs, advantages=advantages
    )
    return targets, figures


# --- 3. losses ----------------------------------------------------------------------------------------
def critic_loss(config: WorkerConfig, mb: RolloutBatch, outputs: ResponseOutputs) -> LossResult:
    """The clipped value loss of a micro-batch as (sum, count, metric numerators) (`losses.loss_sum_and_count`)."""
    assert mb.old_values is not None and mb.returns is not None, "critic_targets fills them"
    values = outputs["values"]
    mask = mb.padded_loss_mask(values.device)
    per_token, token_metrics = value_loss_and_metrics(values, mb.old_values, mb.returns, config.value_clip)
    loss_sum, count = loss_sum_and_count(per_token, mask, config.loss_aggregation)
    clip_sum, _ = loss_sum_and_count(token_metrics["value_clip_frac"], mask, config.loss_aggregation)
    return loss_sum, count, {"value_loss": loss_sum.detach(), "value_clip_frac": clip_sum}


def actor_loss(config: WorkerConfig, mb: RolloutBatch, outputs: ResponseOutputs) -> LossResult:
    """Policy loss + KL loss − entropy bonus of a micro-batch as (sum, count, metric numerators).

    All terms share the loss mask and aggregation mode, hence one count.
    """
    assert mb.old_log_probs is not None and mb.advantages is not None, "actor_targets fills them"
    log_probs = outputs["log_probs"]
    mask = mb.padded_loss_mask(log_probs.device)
    mode = config.loss_aggregation
    per_token, token_metrics = policy_loss(
        log_probs, mb.old_log_probs, mb.advantages, config.eps_clip, config.eps_clip_high, config.eps_clip_c
    )
    pg_sum, count = loss_sum_and_count(per_token, mask, mode)
    loss_sum = pg_sum
    metrics = {"pg_loss": pg_sum.detach()}
    for name in ("clip_frac", "dual_clip_frac", "approx_kl"):
        metrics[name] = loss_sum_and_count(token_metrics[name], mask, mode)[0]
    if config.use_kl_loss:
        assert mb.ref_log_probs is not None, "actor_targets fills them with use_kl_loss"
        kl_sum, _ = loss_sum_and_count(
            approx_kl(log_probs, mb.ref_log_probs, config.kl_loss_type), mask, mode
        )
        loss_sum = loss_sum + config.kl_loss_coef * kl_sum
        metrics["kl_loss"] = kl_sum.detach()
    if config.entropy_coef > 0:
        entropy_sum, _ = loss_sum_and_count(outputs["entropy"], mask, mode)
        loss_sum = loss_sum - config.entropy_coef * entropy_sum
        metrics["entropy"] = entropy_sum.detach()
    return loss_sum, count, metrics


# --- the two roles, stage by stage ------------------------------------------------------------------
def train_critic(trainee: Trainee, batch: RolloutBatch, group: Any, *, rollout_id: int) -> dict[str, Any]:
    """Step 3 on one critic rank: returns `{"metrics": ...}`, plus `"values"` (a Box) on last-stage ranks."""
    from megatron.core import parallel_state as mpu
    from tandem.value_transfer import pack_values

    config = trainee.config
    last = mpu.is_pipeline_last_stage()
    # 1. old values
    old_values = forward_only(trainee.chunks, batch, role="critic", micro_batch_size=config.micro_batch_size)
    # 2. targets
    figures: dict[str, torch.Tensor] = {}
    if old_values is not None:
        batch, figures = critic_targets(batch, old_values, config, dp_group=mpu.get_data_parallel_group())
    # 3. train step
    sums = train_step(trainee, batch, lambda mb, out: critic_loss(config, mb, out), rollout_id=rollout_id)
    # 4. metrics, and the old values for the actor
    metrics = reduce_metrics(
        group,
        sums,
        step_metrics=CRITIC_STEP_METRICS,
        rollout={k: figures.get(k) for k in CRITIC_ROLLOUT_METRICS},
        last=last,
    )
    result: dict[str, Any] = {"metrics": metrics}
    if old_values is not None:
        result["values"] = pack_values(unpad_responses(old_values, batch.response_lengths))
    return result


def train_actor(
    trainee: Trainee, batch: RolloutBatch, external_data: Any, group: Any, *, rank: int, rollout_id: int
) -> dict[str, Any]:
    """Step 4 on one actor rank: returns `{"metrics": ...}`."""
    from megatron.core import parallel_state as mpu

    config = trainee.config
    last = mpu.is_pipeline_last_stage()

    def log_probs() -> torch.Tensor | None:
        return forward_only(
            trainee.chunks,
            batch,
            role="actor",
            temperature=config.temperature,
            micro_batch_size=config.micro_batch_size,
        )

    # 1. old log-probs, and reference log-probs with the reference weights swapped in
    old_log_probs = log_probs()
    ref_log_probs = None
    if config.use_kl_loss:
        with trainee.reference_weights():
            ref_log_probs = log_probs()
    # 2. targets, on the critic's values
    figures: dict[str, torch.Tensor] = {}
    if old_log_probs is not None:
        values = _critic_values(external_data, batch, rank=rank, device=old_log_probs.device)
        batch, figures = actor_targets(
            batch, old_log_probs, ref_log_probs, values, config, dp_group=mpu.get_data_parallel_group()
        )
    # 3. train step
    sums = train_step(
        trainee,
        batch,
        lambda mb, out: actor_loss(config, mb, out),
        rollout_id=rollout_id,
        with_entropy=config.entropy_coef > 0,
    )
    # 4. metrics
    skip = ({"kl_loss"} if not config.use_kl_loss else set()) | (
        {"entropy"} if config.entropy_coef <= 0 else set()
    )
    metrics = reduce_metrics(
        group,
        sums,
        step_metrics=[k for k in ACTOR_STEP_METRICS if k not in skip],
        rollout={k: figures.get(k) for k in ACTOR_ROLLOUT_METRICS},
        last=last,
    )
    return {"metrics": metrics}


def _critic_values(
    external_data: Any, batch: RolloutBatch, *, rank: int, device: torch.device
) -> torch.Tensor:
    """The critic's old values for this last-stage rank's samples, padded; zeros when the run has no critic."""
    from tandem.value_transfer import unpack_values, values_for_rank

    if external_data is None:
        return torch.zeros(len(batch), batch.max_response_length, device=device)
    payload = external_data.get("values") if isinstance(external_data, Mapping) else external_data
    # Raises, naming the rank, when a last-stage rank got no values.
    payload = values_for_rank(payload, rank=rank, is_pipeline_last_stage=True)
    assert payload is not None
    return pad_responses(unpack_values(payload, device, sample_indices=batch.sample_indices))
