"""Run our Megatron actor and critic on a real pretrained checkpoint and save what a test compares with transformers.

Usage (under launch.py): real_model_checks.py HF_DIR WORK_DIR PHASES
  WORK_DIR holds `inputs.pt` (token ids, response lengths, the temperature, the
  vocabulary multiple); PHASES is a comma list of TPxPP. For each phase this saves
  `WORK_DIR/out/<phase>/rank<r>.pt`, small enough for a 135M-parameter model:
  full logits (padded vocabulary) of `square_tokens` and the response log-probs /
  entropies (last stage), the critic's values, and the export checked here against
  the checkpoint's own safetensors, tensor by tensor (names, mismatches, and
  whether the actor's output head is the embedding: tied weights in and out).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

# The script's own folder is on sys.path: the same gathered-logits helper as the random models' checks.
from model_checks import full_logits

from tandem.megatron.batch import RolloutBatch, unpad_responses
from tandem.megatron.models import build_model
from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.hf_weights import SafetensorsReader, export_hf_weights, load_hf_checkpoint
from tandem.megatron.worker.forward import forward_only, micro_batches, run_micro_batches
from tandem.megatron.worker.parallel import destroy_distributed, init_distributed


def export_report(model: torch.nn.Module, spec: ModelSpec, reader: SafetensorsReader) -> dict[str, Any]:
    """Every exported tensor compared with the checkpoint's: names, shapes, bit-equality."""
    names, mismatched = [], []
    for chunk in export_hf_weights(model, spec, 64 * 1024**2):
        for name, tensor in chunk:
            names.append(name)
            if name not in reader or not torch.equal(tensor.cpu(), reader.get(name)):
                mismatched.append(name)
    return {"names": names, "mismatched": mismatched}


def check(hf_dir: Path, inputs: dict[str, Any], out: Path) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    spec = ModelSpec.from_hf(hf_dir)
    reader = SafetensorsReader(hf_dir)
    batch = RolloutBatch(
        tokens=inputs["tokens"],
        response_lengths=inputs["response_lengths"],
        loss_masks=[torch.ones(n) for n in inputs["response_lengths"]],
        rewards=torch.zeros(len(inputs["tokens"])),
    )
    temperature = inputs["temperature"]
    result: dict[str, Any] = {}
    actor = build_model(spec, "actor", vocab_multiple=inputs["vocab_multiple"])
    load_hf_checkpoint(actor, spec, hf_dir, "actor")
    result["embedding_rows"] = None
    if mpu.is_pipeline_first_stage():
        result["embedding_rows"] = actor.embedding.word_embeddings.weight.shape[0]
    if mpu.is_pipeline_last_stage():
        head = actor.output_layer.weight
        shared = actor.shared_embedding_or_output_weight()
        result["head_is_embedding"] = mpu.is_pipeline_first_stage() and head is None and shared is not None
        # The tied head's copy on a later stage holds the embedding's rows (padding included).
        real = reader.get("model.embed_tokens.weight")
        weight = shared if shared is not None else head
        result["head_equals_embedding"] = bool(torch.equal(weight[: real.shape[0]].cpu(), real))
        result["head_padding_is_zero"] = not weight[real.shape[0] :].any().item()
    result["logits"] = full_logits(actor, inputs["square_tokens"])
    padded = forward_only(actor, batch, role="actor", temperature=temperature, micro_batch_size=2)
    result["log_probs"] = None if padded is None else unpad_responses(padded, batch.response_lengths)
    entropies: list[torch.Tensor] = []

    def keep_entropy(mb: RolloutBatch, outputs: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        entropies.extend(unpad_responses(outputs.entropy.detach(), mb.response_lengths))
        return torch.zeros(()), torch.zeros((), dtype=torch.int64), {}

    with torch.no_grad():
        run_micro_batches(
            actor,
            micro_batches(batch, 2),
            role="actor",
            temperature=temperature,
            loss_fn=keep_entropy,
            with_entropy=True,
        )
    result["entropy"] = entropies if mpu.is_pipeline_last_stage() else None
    result["actor_export"] = export_report(actor, spec, reader)
    del actor

    critic = build_model(spec, "critic", vocab_multiple=inputs["vocab_multiple"])
    load_hf_checkpoint(critic, spec, hf_dir, "critic")
    values = forward_only(critic, batch, role="critic", micro_batch_size=2)
    result["values"] = None if values is None else unpad_responses(values, batch.response_lengths)
    result["critic_export"] = export_report(critic, spec, reader)
    if mpu.is_pipeline_last_stage():
        result["score"] = {k: v.detach().cpu().clone() for k, v in critic.output_layer.state_dict().items()}
    del critic
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{dist.get_rank()}.pt")


def main() -> None:
    hf_dir, work = Path(sys.argv[1]), Path(sys.argv[2])
    phases = [tuple(int(x) for x in p.split("x")) for p in sys.argv[3].split(",")]
    ports = [int(p) for p in os.environ["LAUNCH_PORTS"].split(",")]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inputs = torch.load(work / "inputs.pt")
    for (tp, pp), port in zip(phases, ports, strict=False):
        init_distributed(
            rank, world, os.environ["MASTER_ADDR"], port, tensor_parallel_size=tp, pipeline_parallel_size=pp
        )
        check(hf_dir, inputs, work / "out" / f"{tp}x{pp}")
        destroy_distributed()


if __name__ == "__main__":
    main()
