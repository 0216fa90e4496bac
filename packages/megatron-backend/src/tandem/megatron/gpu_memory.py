"""GPU memory figures of one process and of its GPU, as nvidia-smi reports them (no CUDA call)."""

from __future__ import annotations

import os
import subprocess

__all__ = ["all_devices_used_bytes", "device_used_bytes", "process_gpu_bytes"]


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
    """Memory in use on this process's GPU (all processes), from nvidia-smi without touching CUDA."""
    device = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    lines = _nvidia_smi("--query-gpu=memory.used", "-i", device)
    return int(lines[0].strip()) * 1024**2 if lines else None


def all_devices_used_bytes() -> list[int] | None:
    """Memory in use on each GPU this process can see, from nvidia-smi; None without GPUs or nvidia-smi."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    args = ["--query-gpu=memory.used"] + (["-i", visible] if visible else [])
    lines = _nvidia_smi(*args)
    if not lines:
        return None
    return [int(line.strip()) * 1024**2 for line in lines if line.strip()]
