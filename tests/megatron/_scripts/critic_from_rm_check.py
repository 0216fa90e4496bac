"""Build critics from reward-model folders prepared by a test and save the values they compute.

Usage (under launch.py): critic_from_rm_check.py WORK_DIR PHASES
  WORK_DIR holds `inputs.pt` and one sequence-classification folder per name in
  `inputs["folders"]`; PHASES is a comma list of TPxPP (e.g. "1x1,2x1,1x2"). For each
  phase and folder this saves `WORK_DIR/out/<phase>/<folder>/rank<r>.pt` with, on the
  last pipeline stage: the values at every position of `inputs["square_tokens"]`
  (through the pipeline schedule), the forward-only values of the rollout batch, and
  the value head's weight and bias. The test compares them with transformers.
  With `inputs["two_labels"]` (a folder of a two-label classifier), layout 1x1 also
  writes `out/refused/rank<r>.txt`: the error that loading it into a critic raises.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.megatron.batch import RolloutBatch, unpad_responses
from tandem.megatron.models import build_model
from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.hf_weights import load_hf_checkpoint
from tandem.megatron.worker.forward import forward_only
from tandem.megatron.worker.parallel import destroy_distributed, init_distributed


def values_at_every_position(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor | None:
    """The critic's values `(b, s)` through the pipeline schedule; None off the last stage.

    The value head is replicated over tensor-parallel ranks, so each rank's output is whole.
    """
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
    return kept[0][..., 0]


def check_folder(folder: Path, inputs: dict[str, Any], out: Path) -> None:
    from megatron.core import parallel_state as mpu

    spec = ModelSpec.from_hf(folder)
    critic = build_model(spec, "critic", seed=5)
    load_hf_checkpoint(critic, spec, folder, "critic")
    batch = RolloutBatch(
        tokens=inputs["tokens"],
        response_lengths=inputs["response_lengths"],
        loss_masks=[torch.ones(n) for n in inputs["response_lengths"]],
        rewards=torch.zeros(len(inputs["tokens"])),
    )
    result: dict[str, Any] = {"all_positions": values_at_every_position(critic, inputs["square_tokens"])}
    padded = forward_only(critic, batch, role="critic", micro_batch_size=2)
    result["response_values"] = None if padded is None else unpad_responses(padded, batch.response_lengths)
    if mpu.is_pipeline_last_stage():
        head = critic.output_layer
        result["head"] = {"weight": head.weight.detach().clone(), "bias": head.bias.detach().clone()}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(_to_cpu(result), out / f"rank{dist.get_rank()}.pt")


def refuse(folder: Path, out: Path) -> None:
    """Load a classifier of two labels into a critic; write the error it raises (or "loaded")."""
    spec = ModelSpec.from_hf(folder)
    critic = build_model(spec, "critic")
    try:
        load_hf_checkpoint(critic, spec, folder, "critic")
        message = "loaded"
    except ValueError as exc:
        message = str(exc)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(message)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
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
        for name in inputs["folders"]:
            check_folder(work / name, inputs, work / "out" / f"{tp}x{pp}" / name)
        if (tp, pp) == (1, 1) and inputs.get("two_labels"):
            refuse(work / inputs["two_labels"], work / "out" / "refused" / f"rank{rank}.txt")
        destroy_distributed()


if __name__ == "__main__":
    main()
