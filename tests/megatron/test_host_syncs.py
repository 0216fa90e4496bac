"""A train() on the GPU waits for the GPU a few times per optimizer step, not per micro-batch.

A host-to-GPU copy from pageable memory (a micro-batch's tokens, its loss mask,
the index that picks its targets) or a `float()` of a GPU value makes the host
wait until the stream has run dry; once per micro-batch, that leaves the GPU idle
while the host queues the next kernels (docs/benchmarks.md, the 1.2 B probe's
profile: 341 `cudaStreamSynchronize` in one `train()` of 32 micro-batch passes).
`bench/train_profile.py --tiny` profiles one `train()` of a tiny model on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _waits(tmp_path: Path, samples: int, packed: bool = False) -> dict:
    """The host's waits for the GPU in one profiled train() of `samples` samples, micro batch 1 (one optimizer step)."""
    out = tmp_path / f"profile_{samples}_{packed}.json"
    cmd = [
        sys.executable,
        "bench/train_profile.py",
        "--tiny",
        "--samples",
        str(samples),
        "--micro-batch-size",
        "1",
        "--iters",
        "1",
        "--out",
        str(out),
        "--workdir",
        str(tmp_path),
        *(["--packed", "--varied-lengths"] if packed else []),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    syncs = json.loads(out.read_text())["profile"]["host_syncs"]
    syncs["waits"] = sum(
        syncs.get(k, {}).get("count", 0) for k in ("cudaStreamSynchronize", "cudaDeviceSynchronize")
    )
    return syncs


@pytest.mark.parametrize("packed", [False, True])
def test_a_train_step_does_not_wait_for_the_gpu_per_micro_batch(tmp_path: Path, packed: bool) -> None:
    # 16 and 48 samples: 32 and 96 micro-batch passes (forward-only and training). A wait per
    # micro-batch would add at least 64 waits; what an optimizer step waits for stays the same.
    # Packed: each attention layer reads its samples' boundaries from the host (`packing.segments_of`),
    # not back from the GPU, which would be a wait a layer and micro-batch.
    few, many = _waits(tmp_path, 16, packed), _waits(tmp_path, 48, packed)
    assert many["waits"] - few["waits"] < 48 - 16, (few, many)
