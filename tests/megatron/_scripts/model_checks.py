"""Run our Megatron models on checkpoints prepared by a test and save what they compute.

Usage (under launch.py): model_checks.py WORK_DIR PHASES
  WORK_DIR holds `inputs.pt` (written by the test) and one HF checkpoint folder per
  family; PHASES is a comma list of TPxPP, e.g. "1x1,2x1,1x2" (data-parallel size
  is whatever is left of the world size). For each phase and family this saves
  `WORK_DIR/out/<phase>/<family>/rank<r>.pt` with, where this rank has them:
  full logits, forward-only log-probs / entropies / values, the exported HF
  tensors (actor and critic) with the chunk sizes, and the gradients of a test
  loss exported under HF names. The test compares them with transformers.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.megatron.batch import RolloutBatch, unpad_responses
from tandem.megatron.models import build_model
from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.hf_weights import export_hf_weights, load_hf_checkpoint
from tandem.megatron.worker.forward import forward_only, micro_batches, run_micro_batches
from tandem.megatron.worker.parallel import destroy_distributed, init_distributed
from tandem.megatron.worker.response_outputs import ResponseOutputs

CHUNK_BYTES = 6000


def full_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits `(b, s, vocab)` through the pipeline schedule, gathered over TP; None off the last stage."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    kept: list[torch.Tensor] = []

    device = next(model.parameters()).device

    def step(it: Any, stage: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        x = next(it).to(device)
        out = stage(x, torch.arange(x.shape[1], device=device).expand_as(x), None)

        def keep(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            kept.append(output.detach())
            return output.new_zeros(()), {}

        return out, keep

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([tokens]),
            model=[model],
            num_microbatches=1,
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
            forward_only=True,
        )
    if not mpu.is_pipeline_last_stage():
        return None
    local = kept[0]
    tp = mpu.get_tensor_model_parallel_world_size()
    if tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def exported(model: torch.nn.Module, spec: ModelSpec) -> tuple[dict[str, torch.Tensor], list[int]]:
    tensors: dict[str, torch.Tensor] = {}
    sizes = []
    for chunk in export_hf_weights(model, spec, CHUNK_BYTES):
        sizes.append(sum(t.numel() * t.element_size() for _, t in chunk))
        for name, t in chunk:
            assert name not in tensors, name
            tensors[name] = t.clone()
    return tensors, sizes


def reduce_grads_like_megatron(model: torch.nn.Module, spec: ModelSpec, role: str) -> None:
    """What Megatron's `finalize_model_grads` adds after backward (the worker's DDP set-up runs it).

    q/k layernorm weights are replicated over TP but each rank sees only its
    heads: their grads are summed over TP. A tied head on PP > 1 lives on the
    first and the last stage: the two halves of its grad are summed.
    """
    from megatron.core import parallel_state as mpu

    if mpu.get_tensor_model_parallel_world_size() > 1:
        for name, p in model.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                dist.all_reduce(p.grad, group=mpu.get_tensor_model_parallel_group())
    tied_across_stages = (
        role == "actor" and spec.tie_word_embeddings and mpu.get_pipeline_model_parallel_world_size() > 1
    )
    if tied_across_stages and (mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage()):
        shared = model.shared_embedding_or_output_weight()
        dist.all_reduce(shared.grad, group=mpu.get_embedding_group())


def exported_grads(model: torch.nn.Module, spec: ModelSpec, role: str) -> dict[str, torch.Tensor]:
    """The gradients, exported under HF names (parameters temporarily swapped for their grads)."""
    reduce_grads_like_megatron(model, spec, role)
    params = list(model.parameters())
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad if p.grad is not None else torch.zeros_like(p)
    try:
        return exported(model, spec)[0]
    finally:
        for p, d in zip(params, saved, strict=True):
            p.data = d


def _mark(what: str) -> None:
    if os.environ.get("MODEL_CHECKS_TRACE"):
        print(f"rank {dist.get_rank()}: {what}", flush=True)


def check_family(family_dir: Path, inputs: dict[str, Any], out: Path) -> None:
    from megatron.core import parallel_state as mpu

    spec = ModelSpec.from_hf(family_dir)
    temperature = inputs["temperature"]
    batch = RolloutBatch(
        tokens=inputs["tokens"],
        response_lengths=inputs["response_lengths"],
        loss_masks=inputs["loss_masks"],
        rewards=torch.zeros(len(inputs["tokens"])),
    )
    result: dict[str, Any] = {}

    # Actor: logits, forward-only log-probs, entropies, export, gradients of a test loss.
    actor = build_model(spec, "actor")
    load_hf_checkpoint(actor, spec, family_dir, "actor")
    _mark("logits")
    result["logits"] = full_logits(actor, inputs["square_tokens"])
    result["log_probs"] = per_sample(
        forward_only(actor, batch, role="actor", temperature=temperature, micro_batch_size=2), batch
    )
    entropies: list[torch.Tensor] = []

    def keep_entropy(
        mb: RolloutBatch, outputs: ResponseOutputs
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        assert outputs.entropy is not None
        entropies.extend(unpad_responses(outputs.entropy.detach(), mb.response_lengths))
        return torch.zeros(()), torch.zeros((), dtype=torch.int64), {"n": len(mb)}

    metrics = run_micro_batches(
        actor,
        micro_batches(batch, 2),
        role="actor",
        temperature=temperature,
        loss_fn=keep_entropy,
        with_entropy=True,
    )
    result["entropy"] = entropies if mpu.is_pipeline_last_stage() else None
    result["entropy_metrics"] = metrics
    _mark("export")
    result["actor_export"], result["actor_chunk_sizes"] = exported(actor, spec)
    _mark("train")

    def actor_loss(
        mb: RolloutBatch, outputs: ResponseOutputs
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        assert outputs.log_probs is not None and outputs.entropy is not None
        # A plain sum: without DDP's finalisation the gradients are those of the returned sums.
        mask = mb.padded_loss_mask(outputs.log_probs.device)
        loss = ((outputs.log_probs + 0.1 * outputs.entropy) * mask).sum()
        return loss, torch.ones((), dtype=torch.int64), {}

    run_micro_batches(
        actor,
        micro_batches(batch, 2),
        role="actor",
        temperature=temperature,
        backward=True,
        loss_fn=actor_loss,
        with_entropy=True,
    )
    _mark("grads")
    result["actor_grads"] = exported_grads(actor, spec, "actor")
    _mark("critic")
    del actor

    # Critic: values, export (backbone + score head), gradients of a test loss.
    critic = build_model(spec, "critic")
    load_hf_checkpoint(critic, spec, family_dir, "critic")
    result["values"] = per_sample(
        forward_only(critic, batch, role="critic", temperature=temperature, micro_batch_size=2), batch
    )
    result["critic_export"], _ = exported(critic, spec)
    if mpu.is_pipeline_last_stage():
        head = critic.output_layer
        result["critic_head"] = {
            "weight_shape": tuple(head.weight.shape),
            "bias_shape": tuple(head.bias.shape),
            "weight_dtype": str(head.weight.dtype),
            "is_embedding": any(head.weight is p for n, p in critic.named_parameters() if "embedding" in n),
        }

    def critic_loss(
        mb: RolloutBatch, outputs: ResponseOutputs
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        assert outputs.values is not None
        mask = mb.padded_loss_mask(outputs.values.device)
        return ((outputs.values - 0.5) ** 2 * mask).sum(), torch.ones((), dtype=torch.int64), {}

    run_micro_batches(critic, micro_batches(batch, 2), role="critic", backward=True, loss_fn=critic_loss)
    result["critic_grads"] = exported_grads(critic, spec, "critic")
    del critic

    # A critic saved from its export loads back with its head (score.weight / score.bias).
    saved = out.parent.parent / f"critic-{family_dir.name}"
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        saved.mkdir(parents=True, exist_ok=True)
        save_file(result["critic_export"], str(saved / "model.safetensors"))
        shutil.copy(family_dir / "config.json", saved / "config.json")
    dist.barrier()
    reloaded = build_model(spec, "critic", seed=99)
    load_hf_checkpoint(reloaded, spec, saved, "critic")
    result["reloaded_values"] = per_sample(
        forward_only(reloaded, batch, role="critic", micro_batch_size=3), batch
    )
    out.mkdir(parents=True, exist_ok=True)
    torch.save(to_cpu(result), out / f"rank{dist.get_rank()}.pt")


def per_sample(padded: torch.Tensor | None, batch: RolloutBatch) -> list[torch.Tensor] | None:
    """`forward_only`'s padded rows cut to each response (None off the last stage)."""
    return None if padded is None else unpad_responses(padded, batch.response_lengths)


def to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    return value


def main() -> None:
    work = Path(sys.argv[1])
    phases = [tuple(int(x) for x in p.split("x")) for p in sys.argv[2].split(",")]
    ports = [int(p) for p in os.environ["LAUNCH_PORTS"].split(",")]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inputs = torch.load(work / "inputs.pt")
    for (tp, pp), port in zip(phases, ports, strict=False):
        init_distributed(
            rank, world, os.environ["MASTER_ADDR"], port, tensor_parallel_size=tp, pipeline_parallel_size=pp
        )
        for family in inputs["families"]:
            check_family(work / family, inputs, work / "out" / f"{tp}x{pp}" / family)
        destroy_distributed()


if __name__ == "__main__":
    main()
