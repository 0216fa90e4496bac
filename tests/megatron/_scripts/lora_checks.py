"""LoRA on our Megatron models and in the train worker, saved for tests/megatron/test_lora.py to compare.

Usage (under launch.py, 2 processes): lora_checks.py HF_DIR WORK_DIR
  One rendezvous port per torch.distributed initialisation (MASTER_PORT, then LAUNCH_PORTS):

  - `model-2x1` / `model-1x1` (TP 2, then TP 1 with data parallel 2): a base actor, and the same
    actor with adapters whose B matrices are set to fixed values (drawn whole, then split as TP
    splits them, so both layouts hold the same adapters); logits with adapters, with adapters
    off and of the base; the loss of a fixed batch and its gradients; the merged HF export and
    the adapters in PEFT's names; the same for a critic (values, value-head gradients).
  - `actor-straight` / `actor-resumed`, `critic-straight` / `critic-resumed` (TP 2): the train
    worker with LoRA (the actor with a KL loss, so the reference is the base with adapters off)
    trains rollout 0, saves, trains rollout 1; a fresh worker loads rollout 0 and trains
    rollout 1 again. Also a sleep and a wake between the two, the reference log-probs, the
    memory tags, and the log-probs refused while the base alone sleeps.

Each phase writes WORK_DIR/<phase>-rank<r>.pt. No Ray here: the records that would cross Ray
as Boxes (`pack_values`) are kept as plain lists of tensors.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
from model_checks import exported, full_logits, to_cpu

from tandem.megatron.batch import RolloutBatch
from tandem.megatron.config import WorkerConfig
from tandem.megatron.models import build_model
from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.hf_weights import export_lora_adapters, load_hf_checkpoint
from tandem.megatron.models.lora import adapters, adapters_disabled, apply_lora
from tandem.megatron.models.lora_spec import HF_LINEARS, LoraSettings
from tandem.megatron.worker import TrainWorker
from tandem.megatron.worker.forward import micro_batches, run_micro_batches
from tandem.megatron.worker.parallel import destroy_distributed, init_distributed
from tandem.megatron.worker.response_outputs import ResponseOutputs

VOCAB = 64
SETTINGS = LoraSettings(rank=4, alpha=8.0, dropout=0.0, targets=HF_LINEARS)


def ports() -> list[int]:
    return [int(os.environ["MASTER_PORT"]), *map(int, os.environ["LAUNCH_PORTS"].split(","))]


def batch(seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = [4, 2, 5, 3]
    tokens = [torch.randint(0, VOCAB, (3 + n,), generator=g) for n in lengths]
    masks = [torch.ones(n) for n in lengths]
    masks[1][-1] = 0
    return RolloutBatch(tokens, lengths, masks, torch.randn(4, generator=g), sample_indices=[0, 1, 2, 3])


def set_adapters(model: torch.nn.Module) -> None:
    """Fixed, TP-independent B matrices: each drawn whole from a seeded generator, then this rank's rows."""
    from megatron.core import parallel_state as mpu

    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    for name, adapter in adapters(model):
        layer = model.decoder.layers[int(name.split(".")[2])].layer_number
        for part, b in adapter.b.items():
            rows = b.shape[0] * (tp if adapter.parallel == "column" else 1)
            g = torch.Generator().manual_seed(zlib.crc32(f"{layer}/{part}".encode()))
            full = torch.randn(rows, b.shape[1], generator=g) * 0.05
            local = full.chunk(tp, dim=0)[tp_rank] if adapter.parallel == "column" else full
            with torch.no_grad():
                b.copy_(local)


def adapter_grads(model: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The adapters' gradients, gathered and named as the adapters (parameters swapped for their grads)."""
    params = [p for _, a in adapters(model) for p in a.parameters()]
    saved = [p.data for p in params]
    for p in params:
        assert p.grad is not None
        p.data = p.grad
    try:
        return {n: t for chunk in export_lora_adapters(model, spec, SETTINGS, 1 << 20) for n, t in chunk}
    finally:
        for p, d in zip(params, saved, strict=True):
            p.data = d


def model_phase(hf: Path, tp: int, port: int, out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_distributed(rank, world, "127.0.0.1", port, tensor_parallel_size=tp)
    spec = ModelSpec.from_hf(hf)
    tokens = torch.stack([torch.arange(3, 11), torch.arange(20, 28)])
    result: dict[str, Any] = {}

    base = build_model(spec, "actor")
    load_hf_checkpoint(base, spec, hf, "actor")
    result["base_logits"] = full_logits(base, tokens)
    del base

    actor = build_model(spec, "actor")
    load_hf_checkpoint(actor, spec, hf, "actor")
    apply_lora(actor, spec, SETTINGS, seed=3)
    result["initial_logits"] = full_logits(actor, tokens)
    set_adapters(actor)
    result["logits"] = full_logits(actor, tokens)
    with adapters_disabled(actor):
        result["off_logits"] = full_logits(actor, tokens)
    result["trainable"] = sorted(n for n, p in actor.named_parameters() if p.requires_grad)
    losses: list[torch.Tensor] = []

    def actor_loss(
        mb: RolloutBatch, outputs: ResponseOutputs
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        assert outputs.log_probs is not None
        loss = (outputs.log_probs * mb.padded_loss_mask(outputs.log_probs.device)).sum()
        losses.append(loss.detach())
        return loss, torch.ones((), dtype=torch.int64), {}

    data = batch(1)
    run_micro_batches(actor, micro_batches(data, 2), role="actor", backward=True, loss_fn=actor_loss)
    result["loss"] = losses
    result["frozen_grads"] = [
        n for n, p in actor.named_parameters() if not p.requires_grad and p.grad is not None
    ]
    result["grads"] = adapter_grads(actor, spec)
    result["merged"], _ = exported(actor, spec)
    result["adapters"] = {
        n: t for chunk in export_lora_adapters(actor, spec, SETTINGS, 1 << 20) for n, t in chunk
    }
    del actor

    critic = build_model(spec, "critic")
    load_hf_checkpoint(critic, spec, hf, "critic")
    apply_lora(critic, spec, SETTINGS, seed=3)
    set_adapters(critic)
    critic_losses: list[torch.Tensor] = []

    def critic_loss(
        mb: RolloutBatch, outputs: ResponseOutputs
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        assert outputs.values is not None
        loss = ((outputs.values - 0.5) ** 2 * mb.padded_loss_mask(outputs.values.device)).sum()
        critic_losses.append(loss.detach())
        return loss, torch.ones((), dtype=torch.int64), {}

    run_micro_batches(critic, micro_batches(data, 2), role="critic", backward=True, loss_fn=critic_loss)
    result["critic_loss"] = critic_losses
    result["critic_trainable_with_grads"] = sorted(
        n for n, p in critic.named_parameters() if p.grad is not None
    )
    result["critic_grads"] = adapter_grads(critic, spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(to_cpu(result), out)
    del critic
    destroy_distributed()


def log_probs(worker: TrainWorker, rollout_id: int) -> dict[str, Any]:
    """The actor's old and reference log-probs of `batch(10)` (`compute_log_probs`), as lists of tensors."""
    record = worker.compute_log_probs(rollout_id, batch(10))
    assert record is not None
    return {"old": record.log_probs, "reference": record.ref_log_probs}


def worker_config(hf: Path, ckpt: Path, *, load: bool) -> WorkerConfig:
    return WorkerConfig(
        hf_checkpoint=str(hf),
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        global_batch_size=4,
        micro_batch_size=2,
        device="cpu",
        params_dtype="float32",
        tensor_model_parallel_size=2,
        advantage_estimator="gae",
        use_kl_loss=True,
        kl_loss_coef=0.1,
        lr=0.05,
        critic_lr=0.05,
        lora_rank=4,
        lora_alpha=8.0,
        critic_lora_rank=4,
        critic_lora_target_modules=("linear_qkv", "down_proj"),
        save=str(ckpt / "actor"),
        load=str(ckpt / "actor") if load else None,
        critic_save=str(ckpt / "critic"),
        critic_load=str(ckpt / "critic") if load else None,
    )


def worker_phase(hf: Path, work: Path, role: str, resumed: bool, port: int, out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = worker_config(hf, work / "ckpt", load=resumed)
    worker = TrainWorker(rank, world)
    start = worker.init(config, role, "127.0.0.1", port)  # type: ignore[arg-type]
    result: dict[str, Any] = {"start": start}
    if not resumed:
        if role == "actor":
            result["log_probs_before"] = log_probs(worker, 0)
        result["metrics0"] = worker.train(0, batch(10)).metrics
        worker.save_model(0)
        worker.sleep()
        result["asleep_nbytes"] = worker.host_buffer_bytes()
        worker.wake_up()
    result["metrics1"] = worker.train(1, batch(11)).metrics
    result["state"] = worker.state_snapshot()
    result["nbytes"] = worker.state_nbytes()
    result["memory_tags"] = worker.memory_tags()
    if role == "actor":
        # The base is a weight tag: asleep, the log-probs are refused (and nothing else moved).
        worker.sleep(["base"])
        try:
            worker.compute_log_probs(2, batch(10))
        except RuntimeError as err:
            result["refused_with_base_asleep"] = str(err)
        worker.wake_up(["base"])
        result["log_probs_after"] = log_probs(worker, 2)
    worker.sleep()
    worker.wake_up()
    result["state_after_wake"] = worker.state_snapshot()
    result["copied_to_host"] = worker.bytes_copied_to_host()
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(to_cpu(result), out)
    worker.shutdown()


def main() -> None:
    from tandem.megatron.worker import roles

    # Where roles looks it up (it imports the name): the records keep plain lists of tensors.
    roles.pack_values = lambda values: [v.detach().cpu() for v in values]  # type: ignore[assignment,misc]
    hf, work = Path(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    port = iter(ports())
    for tp in (2, 1):
        model_phase(hf, tp, next(port), work / f"model-{tp}x1-rank{rank}.pt")
    for role in ("actor", "critic"):
        for resumed in (False, True):
            phase = f"{role}-{'resumed' if resumed else 'straight'}"
            worker_phase(hf, work, role, resumed, next(port), work / f"{phase}-rank{rank}.pt")


if __name__ == "__main__":
    main()
