"""Packed micro-batches against padded ones: outputs, losses and gradients of both roles (CPU, gloo).

Usage (under launch.py): packing_check.py WORK_DIR PHASES
  WORK_DIR holds `hf/` (a small HF checkpoint); PHASES is a comma list of TPxPP.
For each phase, attention ("sdpa", "local") and role, one model computes with
padded and with packed micro-batches (uneven: 2, 3 and 1 samples of uneven lengths):

- without pipelining, the model output of every sample's tokens, also from a
  packed row with filler tokens at its end (`output...`, `filled...`), and, as a
  control that the comparison can fail, from the packed row run as one plain
  sequence (`leaky...`: samples attend across boundaries and positions run on);
- `forward_only`'s response log-probs (actor) or values (critic), and the same at other
  micro-batch sizes;
- one optimizer step's backward (`run_micro_batches` with `role_losses.actor_loss`
  with KL loss and entropy / `role_losses.critic_loss`, Megatron DDP): the metrics
  of each micro-batch and every gradient;
- the actor's, in both layouts, with its vocabulary head over every position
  (`head_at_responses=False`) against the head at the response positions alone
  (the default; `head...` names), after checking that the head then saw only
  those rows.

Writes `WORK_DIR/out/<phase>-<attention>-<role>-rank<r>.pt`: `{name: (padded, packed)}`.

Then, per phase and role, the whole training of one rollout as the worker runs
it (`roles.train_critic` / `roles.train_actor` on a `build_trainee` model, two
optimizer steps) with `use_sequence_packing` off and on: the metrics and every
trained weight, in `WORK_DIR/out/<phase>-train-<role>-rank<r>.pt`.
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

from tandem.lifecycle import NoopBackend
from tandem.megatron.batch import RolloutBatch
from tandem.megatron.config import WorkerConfig
from tandem.megatron.models import build_model, unwrap_model
from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.hf_weights import load_hf_checkpoint
from tandem.megatron.models.packing import pack_lengths, pack_tokens, packed_seq_params, position_ids
from tandem.megatron.worker import role_losses, roles
from tandem.megatron.worker._trainee import build_trainee
from tandem.megatron.worker.forward import (
    _padded_tokens,
    forward_only,
    micro_batches,
    micro_batches_by_tokens,
    run_micro_batches,
)
from tandem.megatron.worker.optimizer import wrap_ddp
from tandem.megatron.worker.parallel import destroy_distributed, init_distributed

VOCAB = 64


def make_batch(seed: int) -> RolloutBatch:
    """Six samples of uneven lengths (3 to 12 tokens); masks with holes."""
    g = torch.Generator().manual_seed(seed)
    tokens, lengths, masks = [], [], []
    for _ in range(6):
        prompt = int(torch.randint(1, 6, (1,), generator=g))
        response = int(torch.randint(1, 8, (1,), generator=g))
        tokens.append(torch.randint(0, VOCAB, (prompt + response,), generator=g))
        lengths.append(response)
        masks.append((torch.rand(response, generator=g) > 0.2).float())
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


def raw_outputs(model: Any, mb: RolloutBatch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The model output of each sample's tokens, padded against packed (one stage only)."""
    gpt = unwrap_model(model)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        tokens = _padded_tokens(mb, torch.device("cpu"))
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        padded = gpt(tokens, positions, None)
        lengths = [int(t.numel()) for t in mb.tokens]
        for name, multiple, params in (("output", 1, True), ("filled", 7, True), ("leaky", 1, False)):
            row = pack_lengths(lengths, multiple)
            assert (row.pad > 0) == (name == "filled" and sum(lengths) % 7 != 0)
            packed = gpt(
                pack_tokens(mb.tokens, row).unsqueeze(0),
                position_ids(row).unsqueeze(0),
                None,
                packed_seq_params=packed_seq_params(row) if params else None,
            )
            assert packed.shape[:2] == (1, row.total), packed.shape
            out |= {
                f"{name}{i}": (padded[i, :n], packed[0, offset : offset + n])
                for i, (n, offset) in enumerate(zip(row.lengths, row.offsets, strict=True))
            }
    return out


def step(
    ddp: Any,
    config: WorkerConfig,
    role: str,
    mbs: list[RolloutBatch],
    packed: bool,
    head_at_responses: bool = True,
) -> dict[str, Any]:
    """Metrics of each micro-batch and the gradients of one backward over `mbs`."""
    ddp.zero_grad_buffer()
    loss = role_losses.critic_loss if role == "critic" else role_losses.actor_loss
    metrics = run_micro_batches(
        ddp,
        mbs,
        role=role,  # type: ignore[arg-type]
        backward=True,
        loss_fn=partial(loss, config),
        with_entropy=role == "actor",
        packed=packed,
        head_at_responses=head_at_responses,
    )
    out: dict[str, Any] = {
        f"grad:{name}": p.main_grad.detach().clone() for name, p in ddp.module.named_parameters()
    }
    for i, m in enumerate(metrics):
        out |= {f"mb{i}:{k}": torch.as_tensor(v).detach().clone().float() for k, v in m.items()}
    return out


def check(work: Path, phase: str, attention: str, role: str) -> None:
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
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coef=0.01,
        value_clip=0.2,
    )
    model = build_model(spec, role, attention=attention)  # type: ignore[arg-type]
    load_hf_checkpoint(model, spec, hf, role)  # type: ignore[arg-type]
    ddp = wrap_ddp(model, use_distributed_optimizer=False)
    dp_rank = mpu.get_data_parallel_rank()
    batch = with_targets(make_batch(100 + dp_rank), ddp, role, seed=200 + dp_rank)
    mbs = [batch.select([0, 1]), batch.select([2, 3, 4]), batch.select([5])]
    saved: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        for j, mb in enumerate(mbs):
            saved |= {f"mb{j}:{k}": v for k, v in raw_outputs(ddp, mb).items()}
    last = mpu.is_pipeline_last_stage()
    both = [forward_only(ddp, batch, role=role, micro_batch_size=3, packed=p) for p in (False, True)]  # type: ignore[arg-type]
    # Forward-only passes of one sample and of the whole batch: what a forward-only micro-batch
    # size of its own (`log_probs_micro_batch_size`) changes is the work a pass does, not its outputs.
    sizes = [forward_only(ddp, batch, role=role, micro_batch_size=n) for n in (1, len(batch))]  # type: ignore[arg-type]
    if last:
        assert both[0] is not None and both[1] is not None
        saved["forward_only"] = (both[0], both[1])
        assert sizes[0] is not None and sizes[1] is not None
        saved["one:forward_only_sizes"] = (sizes[0], both[0])
        saved["all:forward_only_sizes"] = (sizes[1], both[0])
    head = unwrap_model(ddp).output_layer if last and role == "actor" else None
    seen: list[int] = []
    hook = None if head is None else head.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[0]))
    padded, packed = (step(ddp, config, role, mbs, packed=p) for p in (False, True))
    assert padded.keys() == packed.keys()
    saved |= {k: (padded[k], packed[k]) for k in padded}
    if hook is not None:
        # The head saw each micro-batch's response positions alone, in both layouts.
        hook.remove()
        assert seen == [sum(mb.response_lengths) for mb in mbs] * 2, seen
    if role == "actor":
        for layout in (False, True):
            whole = step(ddp, config, role, mbs, packed=layout, head_at_responses=False)
            default = padded if not layout else packed
            saved |= {f"head{int(layout)}:{k}": (whole[k], default[k]) for k in whole}
    out = work / "out"
    out.mkdir(exist_ok=True)
    torch.save(saved, out / f"{phase}-{attention}-{role}-rank{dist.get_rank()}.pt")


def train(work: Path, phase: str, role: str) -> None:
    """One rollout's training through the worker's own stages, padded then packed, from the same weights."""
    from megatron.core import parallel_state as mpu

    dp = mpu.get_data_parallel_world_size()
    base = dict(
        hf_checkpoint=str(work / "hf"),
        rollout_batch_size=6 * dp,
        global_batch_size=3 * dp,
        micro_batch_size=2,
        device="cpu",
        params_dtype="float32",
        lr=1e-3,
        critic_lr=1e-3,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coef=0.01,
        value_clip=0.2,
    )
    batch = make_batch(300 + mpu.get_data_parallel_rank())
    # Micro-batches cut by tokens: 14 a training pass (padded: at most two short samples, or one
    # long one), 30 a forward-only pass; against two samples each.
    dynamic = {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 14, "log_probs_max_tokens_per_gpu": 30}
    variants = {
        "padded": {},
        "packed": {"use_sequence_packing": True},
        "dynamic": dynamic,
        "dynamic_packed": {**dynamic, "use_sequence_packing": True},
    }
    results = {}
    for variant, fields in variants.items():
        config = WorkerConfig(**base, **fields)  # type: ignore[arg-type]
        trainee = build_trainee(config, role, NoopBackend(), on_gpu=False)  # type: ignore[arg-type]
        run = roles.train_critic if role == "critic" else roles.train_actor
        result = run(trainee, batch, dist.group.WORLD, rank=dist.get_rank(), rollout_id=0)
        weights = {k: v for k, v in trainee.snapshot().items() if k.startswith("weights/")}
        metrics = {f"metric:{k}": torch.tensor(float(v)) for k, v in result.metrics.items()}
        results[variant] = weights | metrics
    padded = results["padded"]
    assert all(r.keys() == padded.keys() for r in results.values())
    torch.save(
        {k: (padded[k], results["packed"][k]) for k in padded},
        work / "out" / f"{phase}-train-{role}-rank{dist.get_rank()}.pt",
    )
    # The first minibatch's cuts (samples per micro-batch), fixed size against by tokens.
    first = batch.select(range(base["global_batch_size"] // dp))  # type: ignore[operator]
    cuts = {
        "cuts@dynamic": (
            torch.tensor([len(mb) for mb in micro_batches(first, 2)]),
            torch.tensor([len(mb) for mb in micro_batches_by_tokens(first, 14, packed=False)]),
        ),
        "cuts@dynamic_packed": (
            torch.tensor([len(mb) for mb in micro_batches(first, 2)]),
            torch.tensor([len(mb) for mb in micro_batches_by_tokens(first, 14, packed=True)]),
        ),
    }
    torch.save(
        {f"{k}@{v}": (padded[k], results[v][k]) for v in ("dynamic", "dynamic_packed") for k in padded}
        | cuts,
        work / "out" / f"{phase}-train-dynamic-{role}-rank{dist.get_rank()}.pt",
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
        for attention in ("sdpa", "local"):
            for role in ("actor", "critic"):
                check(work, phase, attention, role)
        for role in ("actor", "critic"):
            train(work, phase, role)
        destroy_distributed()


if __name__ == "__main__":
    main()
