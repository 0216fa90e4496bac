"""`PhasePeak`: a phase's transient bytes from the CUDA allocator's peak, and nothing without CUDA;
`PhasePeaks`: each phase's largest."""

from __future__ import annotations

import pytest
import torch

from tandem.megatron.runtime.gpu_memory import PhasePeak, PhasePeaks


def test_without_cuda_a_phase_reports_no_figure() -> None:
    # The CPU (or a process that never touched CUDA) has no allocator figures: None, not 0.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is in use in this process")
    with PhasePeak() as peak:
        scratch = torch.zeros(1 << 20)
        del scratch
    assert peak.nbytes is None and peak.cached is None
    peaks = PhasePeaks()
    with peaks.measure("train"):
        torch.zeros(1 << 20)
    assert peaks.as_dict() == {}, "no figure is kept where there is none"
    assert peaks.cached() is None


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


@pytest.mark.gpu
def test_each_phase_keeps_its_largest_peak() -> None:
    peaks = PhasePeaks()
    for phase, nbytes in (("train", 4 << 20), ("train", 2 << 20), ("log_probs", 1 << 20)):
        with peaks.measure(phase):
            scratch = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            del scratch
    assert peaks.as_dict() == {"train": 4 << 20, "log_probs": 1 << 20}


@pytest.mark.gpu
def test_a_phase_reports_what_its_allocator_keeps_cached_after_it() -> None:
    torch.cuda.empty_cache()
    freed = 64 << 20  # a large block: the allocator keeps it cached once freed
    peaks = PhasePeaks()
    with peaks.measure("train"):
        scratch = torch.empty(freed, dtype=torch.uint8, device="cuda")
        del scratch
    cached = peaks.cached()
    assert cached is not None and cached >= freed
    torch.cuda.empty_cache()
    with peaks.measure("log_probs"):
        pass
    assert peaks.cached() == cached, "the largest so far is kept"
