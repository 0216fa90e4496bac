"""`PhasePeak`: a phase's transient bytes from the CUDA allocator's peak, and nothing without CUDA."""

from __future__ import annotations

import pytest
import torch

from tandem.megatron.runtime.gpu_memory import PhasePeak


def test_without_cuda_a_phase_reports_no_figure() -> None:
    # The CPU (or a process that never touched CUDA) has no allocator figures: None, not 0.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is in use in this process")
    with PhasePeak() as peak:
        scratch = torch.zeros(1 << 20)
        del scratch
    assert peak.nbytes is None


@pytest.mark.gpu
def test_a_phase_reports_its_peak_above_what_was_allocated_as_it_began() -> None:
    resident = torch.zeros(1 << 20, device="cuda")  # allocated before: not part of the phase
    transient = 4 << 20  # bytes: a multiple of the allocator's 512-byte rounding
    with PhasePeak() as peak:
        scratch = torch.empty(transient, dtype=torch.uint8, device="cuda")
        del scratch
        kept = torch.empty(1 << 10, dtype=torch.uint8, device="cuda")  # smaller than the peak
    assert peak.nbytes == transient
    del resident, kept
