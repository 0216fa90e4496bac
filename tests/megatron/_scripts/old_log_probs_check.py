"""The actor's old log-probs and the critic's old values from their update's own forward against a
forward of their own (CPU, gloo).

Usage (under launch.py): old_log_probs_check.py WORK_DIR PHASES
  WORK_DIR holds `hf/` (a small HF checkpoint); PHASES is a comma list of TPxPP.
For each phase and policy loss (PPO's clipped ratio, GSPO's), one rollout's training through
the worker's own stages (`roles.train_actor` on a `build_trainee` model: one PPO epoch, one
optimizer step, KL loss and entropy on) with `reuse_old_log_probs` False and True, from the
same weights: the metrics and every trained weight, and how many forward-only passes ran,
in `WORK_DIR/out/<phase>-<loss>-rank<r>.pt` as `{name: (computed, reused)}`. Then the critic's
(`roles.train_critic`, value clipping on, γ and λ below 1) with `reuse_old_values` False and True:
the same, with its old values and returns and the values it sends the actor, in
`WORK_DIR/out/<phase>-critic-rank<r>.pt`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.lifecycle import NoopBackend
from tandem.megatron.batch import RolloutBatch
from tandem.megatron.config import WorkerConfig
from tandem.megatron.worker import roles
from tandem.megatron.worker._trainee import build_trainee
from tandem.megatron.worker.parallel import destroy_distributed, init_distributed

VOCAB = 64


def make_batch(seed: int) -> RolloutBatch:
    """Four samples of uneven lengths; masks with holes."""
    g = torch.Generator().manual_seed(seed)
    tokens, lengths, masks = [], [], []
    for _ in range(4):
        prompt = int(torch.randint(1, 6, (1,), generator=g))
        response = int(torch.randint(2, 8, (1,), generator=g))
        tokens.append(torch.randint(0, VOCAB, (prompt + response,), generator=g))
        lengths.append(response)
        masks.append((torch.rand(response, generator=g) > 0.2).float())
    return RolloutBatch(tokens, lengths, masks, torch.randn(4, generator=g))


def train(work: Path, phase: str, loss_type: str) -> None:
    from megatron.core import parallel_state as mpu

    dp = mpu.get_data_parallel_world_size()
    base = dict(
        hf_checkpoint=str(work / "hf"),
        rollout_batch_size=4 * dp,
        global_batch_size=4 * dp,  # one optimizer step per rollout
        micro_batch_size=2,
        device="cpu",
        params_dtype="float32",
        lr=1e-3,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coef=0.01,
        loss_type=loss_type,
        loss_aggregation="sample_mean" if loss_type == "gspo" else "token_mean",
    )
    batch = make_batch(500 + mpu.get_data_parallel_rank())
    forward_only = roles.forward_only
    results = []
    for reuse in (False, True):
        passes = 0

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal passes
            passes += 1
            return forward_only(*args, **kwargs)

        roles.forward_only = counted  # type: ignore[assignment]
        try:
            config = WorkerConfig(**base, reuse_old_log_probs=reuse)  # type: ignore[arg-type]
            trainee = build_trainee(config, "actor", NoopBackend(), on_gpu=False)  # type: ignore[arg-type]
            result = roles.train_actor(trainee, batch, dist.group.WORLD, rank=dist.get_rank(), rollout_id=0)
        finally:
            roles.forward_only = forward_only  # type: ignore[assignment]
        weights = {k: v for k, v in trainee.snapshot().items() if k.startswith("weights/")}
        metrics = {f"metric:{k}": torch.tensor(float(v)) for k, v in result.metrics.items()}
        results.append(weights | metrics | {"forward_only_passes": torch.tensor(passes)})
    computed, reused = results
    out = work / "out"
    out.mkdir(exist_ok=True)
    saved = {k: (computed[k], reused.get(k)) for k in computed}
    torch.save(saved, out / f"{phase}-{loss_type}-rank{dist.get_rank()}.pt")


def train_critic(work: Path, phase: str) -> None:
    """The critic's rollout with `reuse_old_values` False and True, saved as `train` saves the actor's."""
    from megatron.core import parallel_state as mpu

    dp = mpu.get_data_parallel_world_size()
    batch = make_batch(700 + mpu.get_data_parallel_rank())
    forward_only, pack_values = roles.forward_only, roles.pack_values
    results = []
    for reuse in (False, True):
        passes = 0
        targets: dict[str, torch.Tensor] = {}

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal passes
            passes += 1
            return forward_only(*args, **kwargs)

        def kept(batch: RolloutBatch, targets: dict[str, torch.Tensor] = targets) -> None:
            targets.update(old_values=batch.old_values, returns=batch.returns)  # type: ignore[arg-type]

        roles.forward_only = counted  # type: ignore[assignment]
        roles.pack_values = lambda values: [v.detach().clone() for v in values]  # type: ignore[assignment,misc]
        try:
            config = WorkerConfig(
                hf_checkpoint=str(work / "hf"),
                rollout_batch_size=4 * dp,
                global_batch_size=4 * dp,  # one optimizer step per rollout
                micro_batch_size=2,
                device="cpu",
                params_dtype="float32",
                critic_lr=1e-2,
                gamma=0.9,
                lambd=0.8,
                value_clip=0.2,
                reuse_old_values=reuse,
            )
            trainee = build_trainee(config, "critic", NoopBackend(), on_gpu=False)  # type: ignore[arg-type]
            result = roles.train_critic(
                trainee, batch, dist.group.WORLD, rank=dist.get_rank(), rollout_id=0, on_targets=kept
            )
        finally:
            roles.forward_only = forward_only  # type: ignore[assignment]
            roles.pack_values = pack_values  # type: ignore[assignment]
        weights = {k: v for k, v in trainee.snapshot().items() if k.startswith("weights/")}
        metrics = {f"metric:{k}": torch.tensor(float(v)) for k, v in result.metrics.items()}
        sent = {} if result.values is None else {"sent_values": torch.cat(result.values.values)}
        results.append(weights | metrics | sent | targets | {"forward_only_passes": torch.tensor(passes)})
    computed, reused = results
    out = work / "out"
    out.mkdir(exist_ok=True)
    saved = {k: (computed[k], reused.get(k)) for k in computed}
    torch.save(saved, out / f"{phase}-critic-rank{dist.get_rank()}.pt")


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
        for loss_type in ("ppo", "gspo"):
            train(work, phase, loss_type)
        train_critic(work, phase)
        destroy_distributed()


if __name__ == "__main__":
    main()
