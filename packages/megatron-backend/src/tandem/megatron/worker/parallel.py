"""Start and stop torch.distributed plus Megatron's parallel state in one train worker process.

One call per process: `init_distributed` (on the address and `free_port` that
rank 0 picked) joins the default process group
(gloo on CPU, NCCL on GPU), builds Megatron's tensor/pipeline/data-parallel
groups (data-parallel size = world_size / (TP × PP)) and seeds the RNG
tracker; `destroy_distributed` undoes both.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.megatron.models._cpu_compat import cpu_compat_active, enable_cpu_compat


def free_port() -> int:
    """A TCP port free on this node right now (rank 0's rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    seed: int = 1234,
    backend: str | None = None,
    local_rank: int | None = None,
    timeout_minutes: int = 30,
) -> None:
    """Join the default process group and build Megatron's parallel groups and RNG tracker.

    Args:
        rank: this process's rank in `[0, world_size)`.
        world_size: number of processes of the model (TP × PP × DP).
        master_addr: address of rank 0's rendezvous store.
        master_port: a free TCP port on `master_addr`.
        tensor_parallel_size: Megatron tensor-parallel size (TP).
        pipeline_parallel_size: Megatron pipeline-parallel size (PP).
        seed: seed of the CPU generator and Megatron's RNG tracker (equal on all ranks,
            so that replicated weights start equal).
        backend: torch.distributed backend; None picks "nccl" with CUDA, "gloo" without.
        local_rank: CUDA device index of this process; None takes `LOCAL_RANK` from the
            environment, else 0 (a Ray worker sees only its own GPU).
        timeout_minutes: timeout of the process groups.
    """
    for name, value in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
        ("world_size", world_size),
    ):
        if value < 1:
            raise ValueError(f"init_distributed: `{name}` is {value}; it must be at least 1")
    if world_size % (tensor_parallel_size * pipeline_parallel_size):
        raise ValueError(
            f"init_distributed: world_size {world_size} is not a multiple of "
            f"tensor_parallel_size × pipeline_parallel_size = {tensor_parallel_size * pipeline_parallel_size}; "
            "change the parallel sizes or the number of workers"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"init_distributed: rank {rank} is outside [0, {world_size})")

    on_cpu = enable_cpu_compat()
    if backend is None:
        backend = "gloo" if on_cpu else "nccl"
    if backend == "nccl" and on_cpu:
        raise ValueError("init_distributed: backend 'nccl' needs CUDA; pass backend='gloo' or None on CPU")
    if not on_cpu:
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)

    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if dist.is_initialized():
        raise ValueError(
            "init_distributed: torch.distributed is already initialised in this process; "
            "call destroy_distributed() first"
        )
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=timeout_minutes),
    )
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
        # Gloo side-groups only serve Megatron's distributed optimizer, which we do not use.
        create_gloo_process_groups=False,
    )
    # Same seed on every rank: replicated weights (and the CPU-initialised master
    # weights that Megatron splits over TP) start equal everywhere.
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=cpu_compat_active(), force_reset_rng=True
    )


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state and the default process group (if any)."""
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
