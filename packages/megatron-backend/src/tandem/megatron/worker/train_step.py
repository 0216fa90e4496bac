"""The train step both roles share: PPO epochs over a rollout, minibatches, optimizer steps.

`train_step(trainee, batch, loss_fn, ...)` takes one rank's share of a
rollout whose per-token targets are already in the batch (`roles`), and:

1. orders the samples for each of its passes (`ppo_epochs`; the critic's
   `ppo_epochs * critic_updates_per_step`): rollout order, or a permutation
   seeded by `seed`, the rollout id, the pass and the data-parallel rank
   (`shuffle_minibatches`);
2. cuts each pass into minibatches of `global_batch_size / dp` samples, one
   optimizer step each (`minibatch_size`);
3. runs each minibatch's micro-batches (padded, or packed with
   `use_sequence_packing`) through Megatron's schedule with the role's loss
   in the per-token form, `(loss_sum, count, metrics)`: Megatron sums the
   gradients over micro-batches and data-parallel ranks and divides them
   once by the step's total count, so the gradient is that of the exact
   mean of the step (`aggregation.loss_sum_and_count`, every aggregation mode);
4. takes the optimizer step (clipping, learning-rate schedule);
5. keeps each step's metric numerators and count, which `reduce_metrics`
   turns into the same exact per-step means on every rank, averaged over the
   steps of the rollout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.megatron.batch import RolloutBatch
from tandem.megatron.worker._trainee import Trainee
from tandem.megatron.worker.forward import plan_micro_batches, run_micro_batches
from tandem.megatron.worker.response_outputs import ResponseOutputs
from tandem.megatron.worker.train_clock import timed_part

COUNT = "count"
"""The key under which each step's loss denominator travels with the metric numerators."""

RoleLoss = Callable[
    [RolloutBatch, ResponseOutputs], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
]
"""`loss(micro_batch, outputs) -> (loss_sum, count, metric numerators)`, as `role_losses.critic_loss`
and `role_losses.actor_loss`."""


@dataclass
class StepSums:
    """What one rank's optimizer steps leave behind for `reduce_metrics`.

    Attributes:
        per_step: for each optimizer step, this rank's sum over its micro-batches of
            each metric's numerator and of the loss count (`COUNT`); empty off the
            pipeline's last stage.
        grad_norms: the gradient norm of each step (the same on every rank).
        lr: the learning rate of the last step.
    """

    per_step: list[dict[str, float]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lr: float = 0.0


def minibatch_size(global_batch_size: int, dp_size: int, samples: int) -> int:
    """Samples of one optimizer step on one rank; ValueError unless `samples` is a whole number of them."""
    if global_batch_size % dp_size:
        raise ValueError(
            f"global_batch_size: {global_batch_size} is not divisible by the data-parallel size {dp_size}"
        )
    size = global_batch_size // dp_size
    if samples % size:
        raise ValueError(
            f"global_batch_size: this rank got {samples} samples, not a multiple of global_batch_size / "
            f"data-parallel size = {size}; split each rollout evenly over the data-parallel ranks"
        )
    return size


def pass_order(n: int, *, shuffle: bool, seed: int, rollout_id: int, epoch: int, dp_rank: int) -> list[int]:
    """The order of this rank's `n` samples in pass `epoch`: as given, or a seeded permutation.

    Every rank of one data-parallel replica (its TP and PP ranks) gets the same
    order, since the seed depends on the data-parallel rank only.
    """
    if not shuffle:
        return list(range(n))
    # Tuples of ints hash the same in every process (no hash randomisation for ints).
    generator = torch.Generator().manual_seed(hash((seed, rollout_id, epoch, dp_rank)) & (2**63 - 1))
    return torch.randperm(n, generator=generator).tolist()


def train_step(
    trainee: Trainee,
    batch: RolloutBatch,
    loss_fn: RoleLoss,
    *,
    rollout_id: int,
    with_entropy: bool = False,
    passes: int | None = None,
) -> StepSums:
    """The optimizer steps of one rollout on this rank (stages 1-5 of the module docstring).

    `passes`: full passes over the rollout; None: `ppo_epochs` (the critic's are `WorkerConfig.critic_passes`).
    """
    from megatron.core import parallel_state as mpu

    config = trainee.config
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    size = minibatch_size(config.global_batch_size, dp_size, len(batch))

    def counted(
        mb: RolloutBatch, outputs: ResponseOutputs
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        loss_sum, count, metrics = loss_fn(mb, outputs)
        return loss_sum, count, {**metrics, COUNT: count.detach()}

    sums = StepSums(lr=trainee.optim.lr)
    for epoch in range(config.ppo_epochs if passes is None else passes):
        # 1. the order of this pass
        order = pass_order(
            len(batch),
            shuffle=config.shuffle_minibatches,
            seed=config.seed,
            rollout_id=rollout_id,
            epoch=epoch,
            dp_rank=dp_rank,
        )
        for start in range(0, len(batch), size):
            # 2. one minibatch, one optimizer step
            minibatch = batch.select(order[start : start + size])
            # 3. gradients of the step's exact mean loss
            with timed_part(trainee.clock, "passes"):
                trainee.optim.zero_grad(trainee.chunks)
                results = run_micro_batches(
                    trainee.chunks,
                    plan_micro_batches(
                        minibatch,
                        micro_batch_size=config.micro_batch_size,
                        max_tokens=config.micro_batch_tokens(forward_only=False),
                        packed=config.use_sequence_packing,
                    ),
                    role=trainee.role,
                    temperature=config.temperature,
                    backward=True,
                    loss_fn=counted,
                    with_entropy=with_entropy,
                    packed=config.use_sequence_packing,
                    log_probs_chunk_tokens=config.log_probs_chunk_tokens,
                    fused_log_probs=config.fused_log_probs,
                    head_at_responses=config.head_at_responses,
                )
            # 4. the optimizer step
            norm, sums.lr = trainee.optimizer_step()
            sums.grad_norms.append(norm)
            # 5. this rank's numerators and count of the step
            if results:
                sums.per_step.append(sum_to_host(results))
    return sums


def sum_to_host(results: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each metric summed over the micro-batches' results, with one device-to-host copy in all.

    A `float()` of each value would copy, and make the host wait for the GPU, once per
    metric and micro-batch.
    """
    totals: dict[str, Any] = {}
    for metrics in results:
        for name, value in metrics.items():
            # In float64, as Python floats would add them.
            value = value.to(torch.float64).reshape(()) if isinstance(value, torch.Tensor) else float(value)
            totals[name] = totals.get(name, 0.0) + value
    tensors = [v for v in totals.values() if isinstance(v, torch.Tensor)]
    device = tensors[0].device if tensors else None
    column = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in totals.values()])
    return dict(zip(totals, column.tolist(), strict=True))


def reduce_metrics(
    group: Any,
    sums: StepSums,
    *,
    step_metrics: Sequence[str],
    rollout: Mapping[str, torch.Tensor | float | None],
    last: bool,
) -> dict[str, float]:
    """One all-reduce over the role's world turning every rank's parts into the same figures everywhere.

    `step_metrics`: each is the exact mean of its step (numerators and counts
    summed over the data-parallel ranks of the last stage; tensor-parallel
    ranks hold copies), averaged over the steps. `rollout`: figures every
    last-stage rank already holds. Grad norm, learning rate and the number of optimizer steps
    (`optimizer_steps`: the critic takes `critic_updates_per_step` times the actor's): every rank holds them.
    """
    from megatron.core import parallel_state as mpu

    world = torch.distributed.get_world_size(group)
    tp = mpu.get_tensor_model_parallel_world_size()
    dp = mpu.get_data_parallel_world_size()
    steps = len(sums.grad_norms)
    columns = [COUNT, *step_metrics]
    table = torch.zeros(steps, len(columns), dtype=torch.float64)
    if last:
        for s, step in enumerate(sums.per_step):
            table[s] = torch.tensor([step.get(k, 0.0) for k in columns], dtype=torch.float64) / tp
    scalars = [float(v) / (tp * dp) if last and v is not None else 0.0 for v in rollout.values()]
    scalars += [sum(sums.grad_norms) / max(steps, 1) / world, sums.lr / world]
    vector = torch.cat([table.flatten(), torch.tensor(scalars, dtype=torch.float64)])
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    vector = vector.to(device)
    torch.distributed.all_reduce(vector, group=group)
    vector = vector.cpu()
    table = vector[: table.numel()].view(steps, len(columns))
    means = table[:, 1:] / table[:, :1].clamp(min=1.0)
    out = {name: float(means[:, i].mean()) if steps else 0.0 for i, name in enumerate(step_metrics)}
    tail = vector[table.numel() :].tolist()
    out |= dict(zip(rollout, tail[: len(rollout)], strict=True))
    out["lr"] = tail[-1]
    out["optimizer_steps"] = float(steps)
    if not math.isnan(tail[-2]):
        # NaN only when no norm was computed (clip_grad = 0): absent then, never a NaN metric.
        out["grad_norm"] = tail[-2]
    return out
