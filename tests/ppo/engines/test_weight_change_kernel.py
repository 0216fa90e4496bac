"""The weight sync's counting copy as a Triton kernel (`_weight_change_kernel`) against the torch path.

On a CUDA host the kernel is compiled and runs on the GPU (a `gpu` test); elsewhere it runs in
Triton's interpreter, in the subprocess of test_decode_kernels_interpreted.py (here it skips).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tandem.ppo.engines._weight_changes import count_and_copy

from .conftest import INTERPRETED, patch_interpreter_numerics

pytestmark = (
    pytest.mark.gpu
    if torch.cuda.is_available() and not INTERPRETED
    else pytest.mark.skipif(
        not INTERPRETED, reason="no GPU: run in Triton's interpreter by test_decode_kernels_interpreted.py"
    )
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
FEW = settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])


@FEW
@given(
    size=st.sampled_from([1, 7, 8, 9, 8191, 8192, 8193, 20_000]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    source_dtype=st.sampled_from([None, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_copies_and_counts_as_the_torch_path(
    size: int, dtype: torch.dtype, source_dtype: torch.dtype | None, seed: int
) -> None:
    from tandem.ppo.engines._weight_change_kernel import copy_and_count

    with pytest.MonkeyPatch.context() as patch:
        if INTERPRETED:
            patch_interpreter_numerics(patch)  # fp32 -> bf16 rounds to nearest even, as on the GPU
        g = torch.Generator().manual_seed(seed)
        ours = torch.randn(size, generator=g).to(dtype).to(DEVICE)
        reference = ours.clone()
        bits = torch.zeros(math.ceil(size / 8), dtype=torch.uint8, device=DEVICE)
        ref_bits = bits.clone()
        counts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
        ref_counts = counts.clone()
        for _ in range(3):  # the second and third syncs meet bits already set
            source = ours.clone().to(source_dtype or dtype)
            moved = torch.rand(size, generator=g) < 0.3
            source[moved.to(DEVICE)] += torch.randn(int(moved.sum()), generator=g).to(DEVICE, source.dtype)
            copy_and_count(ours, source, bits, counts)
            count_and_copy(reference, source, ref_bits, ref_counts)
            assert torch.equal(ours.view(torch.uint8), reference.view(torch.uint8))
            assert torch.equal(bits, ref_bits)
            assert counts.tolist() == ref_counts.tolist()
