"""Whether this machine has CUDA, and the refusal that torch_memory_saver's paths give without it.

A module of its own so that the backend factory and the torch_memory_saver backend
both use it without importing each other.
"""

from __future__ import annotations


def cuda_available() -> bool:
    """Whether this machine has a usable CUDA device (imports torch)."""
    import torch

    return torch.cuda.is_available()


def require_cuda(what: str) -> None:
    """Raise a ValueError naming `what` (a flag or function) when there is no CUDA device.

    torch_memory_saver must never be imported or preloaded without CUDA: a process
    started with its LD_PRELOAD hook on such a machine dies before Python starts.
    """
    if not cuda_available():
        raise ValueError(
            f"{what}: torch_memory_saver needs a CUDA GPU and none is available here; "
            "use offload_backend='pinned_host' (works on CPU and GPU) or 'none' instead"
        )
