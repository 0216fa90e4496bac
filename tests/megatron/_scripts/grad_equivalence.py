"""Gradients of one optimizer step: the train step's per-token-loss path against the previous aggregation.

Usage (under launch.py): grad_equivalence.py WORK_DIR PHASES
  WORK_DIR holds `hf/` (a small HF checkpoint); PHASES is a comma list of TPxPP.
For each phase, role and loss aggregation mode, two copies of the same model
(Megatron DDP, so data-parallel reduction and finalisation run as in the
worker) compute the gradient of one optimizer step over uneven micro-batches:

- reference: the aggregation the train step used before it handed the
  denominators to Megatron, kept here as it was: the step's denominator
  all-reduced over the data-parallel group beforehand, each micro-batch's loss
  divided by it, times the data-parallel size (DDP averages) and times the
  number of micro-batches (Megatron divides a two-output loss by it);
- new: `forward.run_micro_batches` with `role_losses.actor_loss` / `role_losses.critic_loss`,
  which return `(sum, count, metrics)` and let Megatron divide once.

Writes `WORK_DIR/out/<phase>-<role>-<mode>-rank<r>.pt` with both gradients by name.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.megatron.algorithms.kl import approx_kl
from tandem.megatron.algorithms.losses import policy_loss, value_loss_and_metrics
from tandem.megatron.batch import RolloutBatch, pad_responses
from tandem.megatron.config import WorkerConfig
from tandem.megatron.models import build_model, unwrap_model
from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.hf_weights import load_hf_checkpoint
from tandem.megatron.worker import role_losses
from tandem.megatron.worker.forward import _padded_tokens, forward_only, run_micro_batches
from tandem.megatron.worker.optimizer import wrap_ddp
from tandem.megatron.worker.parallel import destroy_distributed, init_distributed
from tandem.megatron.worker.response_outputs import ResponseOutputs, response_outputs

VOCAB = 64


# --- the previous aggregation, as it was (roles.py / losses.py before the per-token-loss path) ------------
def old_loss_denominator(loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    mask = loss_mask.detach() != 0
    if mode == "token_mean":
        return mask.sum().to(torch.float32)
    return mask.any(dim=-1).sum().to(torch.float32)


def old_aggregate_loss(
    per_token: torch.Tensor, loss_mask: torch.Tensor, mode: str, count: torch.Tensor
) -> torch.Tensor:
    mask = loss_mask.detach().to(per_token.device) != 0
    masked = torch.where(mask, per_token, 0.0)
    if mode == "token_mean":
        total = masked.sum()
    else:
        tokens_per_sample = mask.sum(dim=-1).clamp(min=1).to(per_token.dtype)
        total = (masked.sum(dim=-1) / tokens_per_sample).sum()
    return total / count.to(device=total.device, dtype=total.dtype).clamp(min=1.0)


def old_loss_of(
    config: WorkerConfig, mb: RolloutBatch, outputs: ResponseOutputs, count: torch.Tensor
) -> torch.Tensor:
    mode = config.loss_aggregation
    mask = pad_responses(mb.loss_masks)
    if outputs.values is not None:
        assert mb.old_values is not None and mb.returns is not None
        per_token, _ = value_loss_and_metrics(outputs.values, mb.old_values, mb.returns, config.value_clip)
        return old_aggregate_loss(per_token, mask, mode, count)
    assert outputs.log_probs is not None and mb.old_log_probs is not None and mb.advantages is not None
    per_token, _ = policy_loss(outputs.log_probs, mb.old_log_probs, mb.advantages, config.eps_clip)
    loss = old_aggregate_loss(per_token, mask, mode, count)
    assert mb.ref_log_probs is not None and outputs.entropy is not None
    kl = old_aggregate_loss(
        approx_kl(outputs.log_probs, mb.ref_log_probs, config.kl_loss_type), mask, mode, count
    )
    entropy = old_aggregate_loss(outputs.entropy, mask, mode, count)
    return loss + config.kl_loss_coef * kl - config.entropy_coef * entropy


def old_step_gradients(ddp: Any, config: WorkerConfig, role: str, mbs: list[RolloutBatch]) -> None:
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp = mpu.get_data_parallel_world_size()
    count = torch.stack(
        [old_loss_denominator(pad_responses(mb.loss_masks), config.loss_aggregation) for mb in mbs]
    ).sum()
    dist.all_reduce(count, group=mpu.get_data_parallel_group())
    device = next(ddp.parameters()).device
    # The tokenizer's vocabulary: Megatron's padding rows past it stay out of the softmax, as in the worker.
    vocab_size = unwrap_model(ddp).tandem_vocab_size

    def loss_func(
        mb: RolloutBatch, tokens: torch.Tensor, output: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        outputs = response_outputs(
            mb,
            tokens,
            output,
            role=role,  # type: ignore[arg-type]
            temperature=1.0,
            with_entropy=role == "actor",
            vocab_size=vocab_size,
        )
        # DDP averages over the data-parallel ranks; Megatron divides by the number of micro-batches.
        return old_loss_of(config, mb, outputs, count) * dp * len(mbs), {}

    def forward_step(data_iterator: Any, stage: torch.nn.Module) -> tuple[Any, Any]:
        mb = next(data_iterator)
        tokens = _padded_tokens(mb, device)
        position_ids = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
        return stage(tokens, position_ids, None), partial(loss_func, mb, tokens)

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=[ddp],
        num_microbatches=len(mbs),
        seq_length=max(int(t.numel()) for mb in mbs for t in mb.tokens),
        micro_batch_size=max(len(mb) for mb in mbs),
        forward_only=False,
    )


# --- the set-up -------------------------------------------------------------------------------------------
def make_batch(seed: int) -> RolloutBatch:
    """Six samples of uneven lengths; masks with holes, and one sample with no trainable token."""
    g = torch.Generator().manual_seed(seed)
    tokens, lengths, masks = [], [], []
    for i in range(6):
        prompt, response = (
            int(torch.randint(2, 5, (1,), generator=g)),
            int(torch.randint(1, 7, (1,), generator=g)),
        )
        tokens.append(torch.randint(0, VOCAB, (prompt + response,), generator=g))
        lengths.append(response)
        mask = (torch.rand(response, generator=g) > 0.3).float()
        masks.append(torch.zeros(response) if i == 4 else mask)
    return RolloutBatch(tokens, lengths, masks, torch.randn(6, generator=g))


def with_targets(batch: RolloutBatch, model: Any, role: str, seed: int) -> RolloutBatch:
    """Targets near the model's own outputs, so that some ratios and values clip and some do not."""
    g = torch.Generator().manual_seed(seed)
    outputs = forward_only(model, batch, role=role, micro_batch_size=2)  # type: ignore[arg-type]
    shape = (len(batch), batch.max_response_length)
    if outputs is None:  # not the last stage: the loss never runs here
        outputs = torch.zeros(shape)
    noise = torch.randn(shape, generator=g) * 0.3
    if role == "critic":
        return batch.with_targets(old_values=outputs + noise, returns=torch.randn(shape, generator=g))
    return batch.with_targets(
        old_log_probs=outputs + noise,
        ref_log_probs=outputs - noise,
        advantages=torch.randn(shape, generator=g),
    )


def build(spec: ModelSpec, hf: Path, role: str, *, per_token: bool) -> Any:
    model = build_model(spec, role, calculate_per_token_loss=per_token)  # type: ignore[arg-type]
    load_hf_checkpoint(model, spec, hf, role)  # type: ignore[arg-type]
    return wrap_ddp(model, use_distributed_optimizer=False)


def grads(ddp: Any) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.detach().clone() for name, p in ddp.module.named_parameters()}


def check(work: Path, phase: str, role: str, mode: str) -> None:
    from megatron.core import parallel_state as mpu

    hf = work / "hf"
    spec = ModelSpec.from_hf(hf)
    config = dataclasses.replace(
        WorkerConfig(
            hf_checkpoint=str(hf),
            rollout_batch_size=6,
            global_batch_size=6,
            device="cpu",
            params_dtype="float32",
        ),
        loss_aggregation=mode,  # type: ignore[arg-type]
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coef=0.01,
        value_clip=0.2,
    )
    old, new = build(spec, hf, role, per_token=False), build(spec, hf, role, per_token=True)
    dp_rank = mpu.get_data_parallel_rank()
    batch = with_targets(make_batch(100 + dp_rank), new, role, seed=200 + dp_rank)
    # Micro-batches of 2, 3 and 1 samples: uneven in samples and tokens.
    mbs = [batch.select([0, 1]), batch.select([2, 3, 4]), batch.select([5])]
    for ddp in (old, new):
        ddp.zero_grad_buffer()
    old_step_gradients(old, config, role, mbs)
    loss = role_losses.critic_loss if role == "critic" else role_losses.actor_loss
    run_micro_batches(
        new,
        mbs,
        role=role,
        backward=True,
        loss_fn=partial(loss, config),
        with_entropy=role == "actor",  # type: ignore[arg-type]
    )
    out = work / "out"
    out.mkdir(exist_ok=True)
    torch.save(
        {"old": grads(old), "new": grads(new)}, out / f"{phase}-{role}-{mode}-rank{dist.get_rank()}.pt"
    )


def main() -> None:
    work = Path(sys.argv[1])
    phases = sys.argv[2].split(",")
    ports = [int(p) for p in os.environ["LAUNCH_PORTS"].split(",")]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for phase, port in zip(phases, ports, strict=False):
        tp, pp = (int(x) for x in phase.split("x"))
        init_distributed(
            rank, world, os.environ["MASTER_ADDR"], port, tensor_parallel_size=tp, pipeline_parallel_size=pp
        )
        for role in ("actor", "critic"):
            for mode in ("sample_mean", "token_mean"):
                check(work, phase, role, mode)
        destroy_distributed()


if __name__ == "__main__":
    main()
