"""Small helpers of the train worker: rendezvous port, GPU memory figures, argument forms, pickling."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable
from typing import Any

import torch

from tandem.megatron.batch import RolloutBatch
from tandem.megatron.config import Role, WorkerConfig


def keep_tensor_pickles_portable() -> None:
    """Make tensors this process pickles loadable by processes that never import Megatron.

    Importing megatron.core replaces `torch.storage._load_from_bytes` (what a pickled
    CPU storage names as its loader) with its own safe loader, so every tensor this
    worker returns through Ray would name `megatron.core.safe_globals` and make the
    receiver (driver, rollout engine) import Megatron to unpickle it. A loader that
    calls the same safe function but carries torch's own name keeps loading safe
    here and makes pickles name `torch.storage._load_from_bytes` again.
    """
    import torch.storage

    current = torch.storage._load_from_bytes
    if getattr(current, "__module__", "") == "torch.storage":
        return

    def _load_from_bytes(b: bytes) -> Any:
        return current(b)

    _load_from_bytes.__module__ = "torch.storage"
    _load_from_bytes.__qualname__ = "_load_from_bytes"
    torch.storage._load_from_bytes = _load_from_bytes


def free_port() -> int:
    """A TCP port free on this node right now (rank 0's rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


def load_hf(model: torch.nn.Module, spec: Any, hf_dir: str, role: Role) -> None:
    """Load a Hugging Face folder into this rank's stage (the models engineer's loader)."""
    from tandem.megatron.hf_weights import load_hf_checkpoint

    load_hf_checkpoint(model, spec, hf_dir, role)


def send_chunk(target: Any, named: list[tuple[str, torch.Tensor]]) -> None:
    """Hand one chunk of HF-named tensors to an engine: a local object, or a Ray actor (CPU copies, waited for)."""
    method = target.update_weights_from_tensors
    remote: Callable[..., Any] | None = getattr(method, "remote", None)
    if remote is None:
        method(named)
        return
    import ray

    ray.get(remote([(name, t.detach().to("cpu")) for name, t in named]))


def _nvidia_smi(*args: str) -> list[str] | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", *args, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()


def process_gpu_bytes() -> int | None:
    """GPU memory the driver attributes to this process; None when nvidia-smi lists no such pid."""
    for line in _nvidia_smi("--query-compute-apps=pid,used_memory") or []:
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(used.strip()) * 1024**2
    return None


def device_used_bytes() -> int | None:
    """Memory in use on this worker's GPU (all processes), from nvidia-smi without touching CUDA."""
    device = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    lines = _nvidia_smi("--query-gpu=memory.used", "-i", device)
    return int(lines[0].strip()) * 1024**2 if lines else None


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


def resolve_batch(data: Any) -> RolloutBatch:
    """This rank's `RolloutBatch` from any of the forms `TrainWorker.train` accepts."""
    import ray

    from megatron.core import parallel_state as mpu
    from tandem.value_transfer import Box

    if isinstance(data, list | tuple):
        dp_size = mpu.get_data_parallel_world_size()
        if len(data) != dp_size:
            raise ValueError(
                f"data_ref: got {len(data)} per-rank batches for {dp_size} data-parallel ranks; "
                "split the rollout into one batch per data-parallel rank"
            )
        data = data[mpu.get_data_parallel_rank()]
    if isinstance(data, Box):
        data = data.get()
    if isinstance(data, ray.ObjectRef):
        data = ray.get(data)
    if not isinstance(data, RolloutBatch):
        raise TypeError(
            f"data_ref: expected a RolloutBatch (or a ref, Box or per-rank list of one), got {data!r}"
        )
    return data
