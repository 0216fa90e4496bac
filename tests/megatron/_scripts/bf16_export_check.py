"""A bf16 model split over pipeline stages exports every HF tensor, bit for bit, on every rank.

Usage (through launch.py): python launch.py NPROC bf16_export_check.py HF_DIR PP OUT_DIR
The actor and the critic are built in bf16 with PP = `PP` (TP 1), loaded from the
bf16 HF checkpoint and exported again with `export_hf_weights`; each rank saves what
it received to `OUT_DIR/rank<r>.pt` (name -> tensor, on CPU), which the test
compares with the checkpoint. Stages receive tensors they do not own from the
others: in the model's dtype (bf16), not fp32.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tandem.megatron.models import build_model
from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.hf_weights import export_hf_weights, load_hf_checkpoint
from tandem.megatron.worker.parallel import destroy_distributed, init_distributed

CHUNK_BYTES = 1 << 16


def main() -> None:
    hf_dir, pp, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    rank = int(os.environ["RANK"])
    init_distributed(
        rank,
        int(os.environ["WORLD_SIZE"]),
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        pipeline_parallel_size=pp,
    )
    spec = ModelSpec.from_hf(hf_dir)
    result: dict[str, dict[str, torch.Tensor]] = {}
    for role in ("actor", "critic"):
        model = build_model(spec, role, params_dtype=torch.bfloat16)
        load_hf_checkpoint(model, spec, hf_dir, role)
        tensors: dict[str, torch.Tensor] = {}
        for chunk in export_hf_weights(model, spec, CHUNK_BYTES):
            for name, tensor in chunk:
                if name in tensors:
                    raise AssertionError(f"{name} exported twice")
                tensors[name] = tensor.detach().to("cpu", copy=True)
        result[role] = tensors
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")
    destroy_distributed()


if __name__ == "__main__":
    main()
