"""A model saved before its first optimizer step resumes and trains as if never stopped (one rank, gloo).

Usage (through launch.py): python launch.py 1 resume_before_step_check.py PHASE HF_DIR CKPT_DIR OUT.pt
  PHASE `straight`: save rollout 0 before any optimizer step (as the actor is saved during a
  critic-only warm-up), then train rollout 1; `resumed`: a fresh process loads that checkpoint and
  trains rollout 1. Each writes its state after the step (weights, optimizer state, schedule) to OUT.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tandem.megatron.batch import RolloutBatch
from tandem.megatron.config import WorkerConfig
from tandem.megatron.worker import TrainWorker
from tandem.megatron.worker.optimizer import inner_torch_optimizers

VOCAB = 64


def batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, VOCAB, (3 + n,), generator=g) for n in (4, 2, 5, 3)]
    return RolloutBatch(
        tokens, [4, 2, 5, 3], [torch.ones(n) for n in (4, 2, 5, 3)], torch.randn(4, generator=g)
    )


def main() -> None:
    phase, hf_dir, ckpt, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    config = WorkerConfig(
        hf_checkpoint=str(hf_dir),
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        device="cpu",
        params_dtype="float32",
        advantage_estimator="grpo",
        n_samples_per_prompt=2,
        save=str(ckpt),
        load=str(ckpt) if phase == "resumed" else None,
    )
    worker = TrainWorker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    worker.init(config, "actor", os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if phase == "straight":
        worker.save_model(0)
    else:
        assert worker.load_model() == 0
    metrics = worker.train(1, batch()).metrics
    # The CPU's torch AdamW steps fused, also after the checkpoint's load (`optimizer.step_fused`).
    trainee = worker._trainee
    assert trainee is not None
    for inner in inner_torch_optimizers(trainee.optim.optimizer):
        assert all(g["fused"] is True and g["foreach"] is False for g in inner.param_groups), inner
    torch.save({"state": worker.state_snapshot(), "metrics": metrics}, out)
    worker.shutdown()


if __name__ == "__main__":
    main()
