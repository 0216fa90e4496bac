"""`foreign_gpu_bytes`: what processes outside the run hold on this process's GPUs, from nvidia-smi's lists
(faked here: the CPU has none), and None where the run's own processes are not among them."""

from __future__ import annotations

import pytest

from tandem.megatron.runtime import gpu_memory
from tandem.megatron.runtime.gpu_memory import foreign_gpu_bytes

GPUS = {"0": "GPU-aaaa", "1": "GPU-bbbb"}
APPS = [
    "101, GPU-aaaa, 30000",  # the run's: an actor worker
    "102, GPU-aaaa, 9000",  # the run's: its engine
    "7, GPU-aaaa, 2048",  # a notebook on the run's GPU
    "8, GPU-aaaa, 512",  # and a process that touched CUDA once
    "9, GPU-bbbb, 40000",  # another job, on a GPU this process does not see
]


def fake_smi(gpus: dict[str, str], apps: list[str] | None) -> object:
    def smi(*args: str) -> list[str] | None:
        if args[0] == "--query-gpu=uuid":
            chosen = args[2].split(",") if len(args) > 2 else list(gpus)
            return [gpus[i] for i in chosen]
        return apps

    return smi


@pytest.mark.parametrize("visible", ["0", None])
def test_only_others_memory_on_a_visible_gpu_counts(
    monkeypatch: pytest.MonkeyPatch, visible: str | None
) -> None:
    monkeypatch.setattr(gpu_memory, "_nvidia_smi", fake_smi(GPUS, APPS))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    held = foreign_gpu_bytes({101, 102})
    if visible == "0":
        assert held == (2048 + 512) * 2**20, "the two outside processes on GPU 0; GPU 1's job is not seen"
    else:
        assert held == 40000 * 2**20, "both GPUs seen: the one with the most held by others"


def test_nothing_to_tell_without_the_runs_own_pids_or_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    # A container's pid namespace: nvidia-smi lists host pids, none of them the run's.
    monkeypatch.setattr(gpu_memory, "_nvidia_smi", fake_smi(GPUS, APPS))
    assert foreign_gpu_bytes({5001, 5002}) is None
    monkeypatch.setattr(gpu_memory, "_nvidia_smi", fake_smi(GPUS, None))
    assert foreign_gpu_bytes({101}) is None
    # Only the run on its GPU: nothing foreign.
    monkeypatch.setattr(gpu_memory, "_nvidia_smi", fake_smi(GPUS, APPS[:2]))
    assert foreign_gpu_bytes({101, 102}) == 0
