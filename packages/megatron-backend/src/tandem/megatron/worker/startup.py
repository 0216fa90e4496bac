"""A train worker's start-up: what `TrainWorker.init` does to its process around building the trainee.

In `init`'s order: the device it runs on (`resolve_device`), the role's world
with reloadable process groups (`join_world`), the GPU figures of its CUDA
context (`gpu_start`), tensor pickles that never name Megatron
(`keep_tensor_pickles_portable`) and the sleep / wake lifecycle over the
trainee's memory tags (`build_lifecycle`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.storage

from tandem.lifecycle import (
    Lifecycle,
    MemoryBackend,
    clear_torch_caches,
    destroy_all,
    reload_all,
    reloadable_groups,
)
from tandem.megatron.choices import Role
from tandem.megatron.config import WorkerConfig
from tandem.megatron.runtime.gpu_memory import device_used_bytes, process_gpu_bytes
from tandem.megatron.worker.parallel import init_distributed

__all__ = [
    "build_lifecycle",
    "clear_caches",
    "gpu_start",
    "join_world",
    "keep_tensor_pickles_portable",
    "resolve_device",
]

# A full collection here walks ~0.5 M objects (torch, Megatron, Ray): freezing the
# survivors keeps each sleep's and wake's collection to what was made since.
clear_caches = functools.partial(clear_torch_caches, freeze_survivors=True)
"""Collect and empty torch's caches, freezing what survives (the lifecycle's `clear_caches`)."""


def resolve_device(config: WorkerConfig) -> str:
    """ "cuda" or "cpu" for this worker, checked against what it sees (`device`)."""
    has_cuda = torch.cuda.is_available()
    if config.device == "cuda" and not has_cuda:
        raise ValueError("device: 'cuda' but this worker sees no GPU; give it a GPU or use device='auto'")
    if config.device == "cpu" and has_cuda:
        raise ValueError(
            "device: 'cpu' on a worker that sees a GPU; Megatron's CPU path runs only without CUDA "
            "(start the worker with num_gpus=0) or use device='auto'"
        )
    return "cuda" if has_cuda else "cpu"


def join_world(
    config: WorkerConfig, role: Role, rank: int, world_size: int, master_addr: str, master_port: int
) -> Any:
    """Join the role's world (its TP / PP layout, `seed`); returns a process group of all its ranks.

    Megatron's groups (and ours) are made reloadable so that sleep can tear their communicators down.
    """
    tp, pp = config.topology(role)
    with reloadable_groups(local_single_rank=config.local_single_rank_groups):
        init_distributed(
            rank,
            world_size,
            master_addr,
            master_port,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            seed=config.seed,
        )
        return torch.distributed.new_group(ranks=list(range(world_size)))


def gpu_start(device_before_context: int | None) -> dict[str, int | None]:
    """Make the CUDA context exist; this process's GPU bytes then and the context's size.

    `device_before_context`: the whole GPU's used bytes before this worker touched it
    (None where nvidia-smi cannot tell). Keys as `TrainWorker.gpu_memory`'s.
    """
    torch.zeros(1, device="cuda")  # the CUDA context exists from here on
    after = device_used_bytes()
    return {
        "process_baseline": process_gpu_bytes(),
        "device_before_context": device_before_context,
        "context": None if after is None or device_before_context is None else after - device_before_context,
    }


def build_lifecycle(backend: MemoryBackend, tags: Sequence[str], config: WorkerConfig) -> Lifecycle:
    """The sleep / wake lifecycle of the trainee's memory `tags` in `backend`, with the process groups."""
    return Lifecycle(
        backend,
        tags=tags,
        clear_caches=clear_caches,
        # A wake frees nothing on the device; syncing it would wait for the optimizer state
        # coming back in the background (background_optimizer_wake).
        clear_caches_on_wake=functools.partial(clear_torch_caches, freeze_survivors=True, device=False),
        destroy_process_groups=functools.partial(
            destroy_all, keep_single_rank=config.keep_single_rank_groups
        ),
        reload_process_groups=reload_all,
    )


def keep_tensor_pickles_portable() -> None:
    """Make tensors this process pickles loadable by processes that never import Megatron.

    Importing megatron.core replaces `torch.storage._load_from_bytes` (what a pickled
    CPU storage names as its loader) with its own safe loader, so every tensor this
    worker returns through Ray would name `megatron.core.safe_globals` and make the
    receiver (driver, rollout engine) import Megatron to unpickle it. A loader that
    calls the same safe function but carries torch's own name keeps loading safe
    here and makes pickles name `torch.storage._load_from_bytes` again.
    """
    current = torch.storage._load_from_bytes
    if getattr(current, "__module__", "") == "torch.storage":
        return

    def _load_from_bytes(b: bytes) -> Any:
        return current(b)

    _load_from_bytes.__module__ = "torch.storage"
    _load_from_bytes.__qualname__ = "_load_from_bytes"
    torch.storage._load_from_bytes = _load_from_bytes
