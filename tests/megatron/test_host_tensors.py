"""`host_tensors.zero_copy`: CPU tensors that pickle their bytes out of band and come back equal."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.models.host_tensors import zero_copy

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.bool]


def _round_trip(obj: object) -> tuple[object, list[pickle.PickleBuffer], bytes]:
    """Pickle as Ray does (protocol 5, buffers out of band), then load with those buffers."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=buffers), buffers, data


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    transpose=st.booleans(),
)
def test_a_tensor_comes_back_equal_with_its_bytes_out_of_band(
    dtype: torch.dtype, shape: list[int], transpose: bool
) -> None:
    tensor = (torch.randn(shape) * 100).to(dtype)
    if transpose and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)  # not contiguous
    back, buffers, _ = _round_trip([("w", zero_copy(tensor))])
    ((name, got),) = back  # type: ignore[misc]
    assert name == "w" and isinstance(got, torch.Tensor)
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert torch.equal(got, tensor)
    assert len(buffers) == 1  # the bytes travelled out of band, not inside the pickle


def test_a_large_tensor_is_not_copied_into_the_pickle() -> None:
    tensor = torch.randn(1 << 18).to(torch.bfloat16)  # 512 KiB
    _, buffers, data = _round_trip(zero_copy(tensor))
    assert len(data) < 1024 and buffers[0].raw().nbytes == tensor.numel() * 2
    # A plain tensor, for contrast, carries its bytes inside the pickle.
    assert len(pickle.dumps(tensor, protocol=5)) > tensor.numel() * 2


def test_bad_input_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="complex"):
        zero_copy(torch.zeros(2, dtype=torch.complex64))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="copy it to the CPU first"):
            zero_copy(torch.zeros(2, device="cuda"))


def test_the_bench_runs_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "host_tensors.json"
    bench = Path(__file__).resolve().parents[2] / "bench" / "host_tensor_bench.py"
    command = [
        sys.executable,
        str(bench),
        "--mib",
        "64",
        "--chunk-mib",
        "32",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"pickled tensors", "zero_copy"} and all(r["seconds"] > 0 for r in rows.values())
