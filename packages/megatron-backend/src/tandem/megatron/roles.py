"""The PPO training loops of the two roles on one rank (DESIGN.md, "One PPO step", steps 3 and 4).

Critic: old values (forward only) -> returns by GAE -> value-loss training ->
the old values handed to the actor. Actor: old (and reference) log-probs ->
the critic's values -> advantages by GAE (whitened when asked) -> policy-loss
training with the KL loss and entropy bonus as configured.

Each rank's share of a rollout is cut into optimizer steps of
`global_batch_size / dp` samples, each step into micro-batches of
`micro_batch_size`. Losses are exact means over the whole global batch: the
denominator (`loss_denominator`) is summed over the step's micro-batches and
all-reduced over the data-parallel group before the step, and the loss is
scaled by the data-parallel size because Megatron's DDP averages gradients
over it. Every metric is aggregated the same way, so the reported figure of a
step is its exact mean; a rollout's figure is the mean over its steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tandem.megatron._trainee import Trainee
from tandem.megatron.advantages import masked_mean_var, whiten_advantages
from tandem.megatron.batch import RolloutBatch, pad_responses, unpad_responses
from tandem.megatron.forward import ResponseOutputs, forward_only, micro_batches, run_micro_batches
from tandem.megatron.gae import compute_gae
from tandem.megatron.kl import approx_kl
from tandem.megatron.losses import (
    aggregate_loss,
    explained_variance,
    loss_denominator,
    policy_loss,
    value_loss_and_metrics,
)

# Metrics of the loss, exact means over each step (summed over micro-batches and data-parallel ranks).
CRITIC_STEP_METRICS = ("value_loss", "value_clip_frac")
ACTOR_STEP_METRICS = ("pg_loss", "clip_frac", "dual_clip_frac", "approx_kl", "kl_loss", "entropy")
# Metrics of the rollout computed once over the data-parallel group (same on every last-stage rank).
CRITIC_ROLLOUT_METRICS = ("values_mean", "returns_mean", "explained_variance")
ACTOR_ROLLOUT_METRICS = ("log_prob", "advantages_mean", "values_mean", "returns_mean")
# Same on every rank.
OPTIMIZER_METRICS = ("grad_norm", "lr")

LossOf = Callable[[RolloutBatch, ResponseOutputs, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def train_critic(trainee: Trainee, batch: RolloutBatch, group: Any) -> dict[str, Any]:
    """Step 3 on one critic rank: returns `{"metrics": ...}`, plus `"values"` (a Box) on last-stage ranks."""
    from megatron.core import parallel_state as mpu
    from tandem.value_transfer import pack_values

    config, device = trainee.config, trainee.device
    last = mpu.is_pipeline_last_stage()
    old_values = forward_only(trainee.chunks, batch, role="critic", micro_batch_size=config.micro_batch_size)
    rollout: dict[str, torch.Tensor] = {}
    targets: dict[str, list[torch.Tensor]] = {}
    if last:
        assert old_values is not None, "forward_only returns values on the last stage"
        mask = pad_responses(batch.loss_masks).to(device)
        old = pad_responses(old_values)
        _, returns = compute_gae(batch.rewards.to(device), old, mask, config.gamma, config.lambd)
        dp_group = mpu.get_data_parallel_group()
        rollout = {
            "values_mean": masked_mean_var(old, mask, group=dp_group)[0],
            "returns_mean": masked_mean_var(returns, mask, group=dp_group)[0],
            "explained_variance": explained_variance(old, returns, mask, group=dp_group),
        }
        targets = {"old_values": old_values, "returns": unpad_responses(returns, batch.response_lengths)}

    def loss_of(
        mb: RolloutBatch, outputs: ResponseOutputs, count: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = pad_responses(mb.loss_masks).to(device)
        values = pad_responses(outputs["values"])
        old, ret = (pad_responses(_pick(targets[k], batch, mb)) for k in ("old_values", "returns"))
        per_token, token_metrics = value_loss_and_metrics(values, old, ret, config.value_clip)
        loss = aggregate_loss(per_token, mask, config.loss_aggregation, global_count=count)
        metrics = {
            "value_loss": loss.detach(),
            "value_clip_frac": _aggregate(token_metrics["value_clip_frac"], mask, config, count),
        }
        return loss, metrics

    step_sums, optimizer = _optimize(trainee, batch, loss_of, role="critic")
    metrics = _reduce_metrics(
        group,
        exact={k: step_sums.get(k) for k in CRITIC_STEP_METRICS},
        replicated_last={k: rollout.get(k) for k in CRITIC_ROLLOUT_METRICS},
        replicated_all=optimizer,
        last=last,
    )
    result: dict[str, Any] = {"metrics": metrics}
    if last:
        assert old_values is not None
        result["values"] = pack_values(old_values)
    return result


def train_actor(
    trainee: Trainee, batch: RolloutBatch, external_data: Any, group: Any, *, rank: int
) -> dict[str, Any]:
    """Step 4 on one actor rank: returns `{"metrics": ...}`."""
    from megatron.core import parallel_state as mpu

    config, device = trainee.config, trainee.device
    last = mpu.is_pipeline_last_stage()
    old_log_probs = forward_only(
        trainee.chunks,
        batch,
        role="actor",
        temperature=config.temperature,
        micro_batch_size=config.micro_batch_size,
    )
    ref_log_probs = None
    if config.use_kl_loss:
        trainee.swap_reference()
        try:
            ref_log_probs = forward_only(
                trainee.chunks,
                batch,
                role="actor",
                temperature=config.temperature,
                micro_batch_size=config.micro_batch_size,
            )
        finally:
            trainee.swap_reference()
    values = _critic_values(external_data, batch, rank=rank, last=last, device=device)
    rollout: dict[str, torch.Tensor] = {}
    targets: dict[str, list[torch.Tensor]] = {}
    if last:
        assert old_log_probs is not None, "forward_only returns log-probs on the last stage"
        mask = pad_responses(batch.loss_masks).to(device)
        padded_values = pad_responses(values).to(device)
        advantages, returns = compute_gae(
            batch.rewards.to(device), padded_values, mask, config.gamma, config.lambd
        )
        dp_group = mpu.get_data_parallel_group()
        rollout = {
            "log_prob": masked_mean_var(pad_responses(old_log_probs), mask, group=dp_group)[0],
            "advantages_mean": masked_mean_var(advantages, mask, group=dp_group)[0],
            "values_mean": masked_mean_var(padded_values, mask, group=dp_group)[0],
            "returns_mean": masked_mean_var(returns, mask, group=dp_group)[0],
        }
        if config.normalize_advantages:
            advantages = whiten_advantages(advantages, mask, group=dp_group)
        targets = {
            "old_log_probs": old_log_probs,
            "advantages": unpad_responses(advantages, batch.response_lengths),
        }
        if ref_log_probs is not None:
            targets["ref_log_probs"] = ref_log_probs

    def loss_of(
        mb: RolloutBatch, outputs: ResponseOutputs, count: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = pad_responses(mb.loss_masks).to(device)
        log_probs = pad_responses(outputs["log_probs"])
        old = pad_responses(_pick(targets["old_log_probs"], batch, mb))
        advantages = pad_responses(_pick(targets["advantages"], batch, mb))
        per_token, token_metrics = policy_loss(
            log_probs, old, advantages, config.eps_clip, config.eps_clip_high, config.eps_clip_c
        )
        pg_loss = aggregate_loss(per_token, mask, config.loss_aggregation, global_count=count)
        loss = pg_loss
        metrics = {"pg_loss": pg_loss.detach()}
        for name in ("clip_frac", "dual_clip_frac", "approx_kl"):
            metrics[name] = _aggregate(token_metrics[name], mask, config, count)
        if "ref_log_probs" in targets:
            ref = pad_responses(_pick(targets["ref_log_probs"], batch, mb))
            kl = aggregate_loss(
                approx_kl(log_probs, ref, config.kl_loss_type),
                mask,
                config.loss_aggregation,
                global_count=count,
            )
            loss = loss + config.kl_loss_coef * kl
            metrics["kl_loss"] = kl.detach()
        if config.entropy_coef > 0:
            entropy = aggregate_loss(
                pad_responses(outputs["entropy"]), mask, config.loss_aggregation, global_count=count
            )
            loss = loss - config.entropy_coef * entropy
            metrics["entropy"] = entropy.detach()
        return loss, metrics

    step_sums, optimizer = _optimize(trainee, batch, loss_of, role="actor")
    metrics = _reduce_metrics(
        group,
        exact={k: step_sums.get(k) for k in _actor_step_metrics(trainee)},
        replicated_last={k: rollout.get(k) for k in ACTOR_ROLLOUT_METRICS},
        replicated_all=optimizer,
        last=last,
    )
    return {"metrics": metrics}


def _actor_step_metrics(trainee: Trainee) -> tuple[str, ...]:
    config = trainee.config
    skip = {"kl_loss"} if not config.use_kl_loss else set()
    if config.entropy_coef <= 0:
        skip.add("entropy")
    return tuple(k for k in ACTOR_STEP_METRICS if k not in skip)


def _critic_values(
    external_data: Any, batch: RolloutBatch, *, rank: int, last: bool, device: torch.device
) -> list[torch.Tensor]:
    """The critic's old values for this rank's samples; zeros when the run has no critic."""
    from tandem.value_transfer import unpack_values, values_for_rank

    if external_data is None:
        return [torch.zeros(n, dtype=torch.float32, device=device) for n in batch.response_lengths]
    payload = external_data.get("values") if isinstance(external_data, Mapping) else external_data
    payload = values_for_rank(payload, rank=rank, is_pipeline_last_stage=last)
    if payload is None:
        return []  # not the last stage: values are not used here
    return unpack_values(payload, device, sample_indices=batch.sample_indices)


def _pick(per_sample: list[torch.Tensor], batch: RolloutBatch, mb: RolloutBatch) -> list[torch.Tensor]:
    """The entries of `per_sample` (in `batch`'s order) for the samples of micro-batch `mb`."""
    position = {index: i for i, index in enumerate(batch.sample_indices)}
    return [per_sample[position[index]] for index in mb.sample_indices]


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, config: Any, count: torch.Tensor) -> torch.Tensor:
    return aggregate_loss(per_token, mask, config.loss_aggregation, global_count=count).detach()


def _optimize(
    trainee: Trainee, batch: RolloutBatch, loss_of: LossOf, *, role: str
) -> tuple[dict[str, float], dict[str, float]]:
    """Optimizer steps over `batch`; (per-metric sums over micro-batches, mean over steps; grad norm and lr)."""
    from megatron.core import parallel_state as mpu

    config, device = trainee.config, trainee.device
    dp, dp_group = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_group()
    per_step = config.global_batch_size // dp
    if len(batch) % per_step:
        raise ValueError(
            f"global_batch_size: this rank got {len(batch)} samples, not a multiple of global_batch_size / "
            f"data-parallel size = {per_step}; split each rollout evenly over the data-parallel ranks"
        )
    sums: dict[str, float] = {}
    norms: list[float] = []
    lr = trainee.optim.lr
    steps = len(batch) // per_step
    for step in range(steps):
        step_batch = batch.select(range(step * per_step, (step + 1) * per_step))
        mbs = micro_batches(step_batch, config.micro_batch_size)
        count = torch.stack(
            [loss_denominator(pad_responses(mb.loss_masks), config.loss_aggregation) for mb in mbs]
        ).sum()
        count = count.to(device)
        torch.distributed.all_reduce(count, group=dp_group)

        def loss_fn(
            mb: RolloutBatch, outputs: ResponseOutputs, count: torch.Tensor = count
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss, metrics = loss_of(mb, outputs, count)
            # DDP averages gradients over the data-parallel ranks; the loss is already the global mean.
            return loss * dp, metrics

        trainee.optim.zero_grad(trainee.chunks)
        results = run_micro_batches(
            trainee.chunks,
            mbs,
            role=role,  # type: ignore[arg-type]
            temperature=config.temperature,
            forward_only=False,
            loss_fn=loss_fn,
            with_entropy=role == "actor" and config.entropy_coef > 0,
        )
        for metrics in results:
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value) / steps
        norm, lr = trainee.optimizer_step()
        norms.append(norm)
    return sums, {"grad_norm": sum(norms) / max(len(norms), 1), "lr": lr}


def _reduce_metrics(
    group: Any,
    *,
    exact: Mapping[str, float | None],
    replicated_last: Mapping[str, torch.Tensor | float | None],
    replicated_all: Mapping[str, float],
    last: bool,
) -> dict[str, float]:
    """One all-reduce over the role's world turning each rank's parts into the same figures everywhere.

    `exact`: this rank's share of a sum over data-parallel ranks (last stage only;
    TP ranks hold copies). `replicated_last`: a figure every last-stage rank holds
    already. `replicated_all`: a figure every rank holds.
    """
    from megatron.core import parallel_state as mpu

    world = torch.distributed.get_world_size(group)
    tp = mpu.get_tensor_model_parallel_world_size()
    dp = mpu.get_data_parallel_world_size()
    keys = [*exact, *replicated_last, *replicated_all]
    parts: list[float] = []
    for key in exact:
        parts.append(float(exact[key] or 0.0) / tp if last else 0.0)
    for key in replicated_last:
        value = replicated_last[key]
        parts.append(float(value) / (tp * dp) if last and value is not None else 0.0)
    for key in replicated_all:
        parts.append(float(replicated_all[key]) / world)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    vector = torch.tensor(parts, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(vector, group=group)
    return dict(zip(keys, vector.tolist(), strict=True))
