"""Build the actor and critic in bf16 on this rank and record every parameter's dtype and the values' dtype.

Usage (through launch.py): python launch.py 1 dtype_check.py HF_DIR OUT.pt
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tandem.megatron.batch import RolloutBatch
from tandem.megatron.models import build_model
from tandem.megatron.models.hf_config import ModelSpec
from tandem.megatron.models.hf_weights import load_hf_checkpoint
from tandem.megatron.worker.forward import forward_only
from tandem.megatron.worker.parallel import destroy_distributed, init_distributed


def main() -> None:
    hf_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    init_distributed(
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
    )
    spec = ModelSpec.from_hf(hf_dir)
    result: dict[str, object] = {}
    for role in ("actor", "critic"):
        model = build_model(spec, role, params_dtype=torch.bfloat16)
        load_hf_checkpoint(model, spec, hf_dir, role)
        result[role] = {name: str(p.dtype) for name, p in model.named_parameters()}
        if role == "critic":
            batch = RolloutBatch(
                tokens=[torch.arange(6), torch.arange(5)],
                response_lengths=[3, 2],
                loss_masks=[torch.ones(3), torch.ones(2)],
                rewards=torch.zeros(2),
            )
            values = forward_only(model, batch, role="critic", micro_batch_size=2)
            result["values_dtypes"] = [str(v.dtype) for v in values]
    torch.save(result, out)
    destroy_distributed()


if __name__ == "__main__":
    main()
