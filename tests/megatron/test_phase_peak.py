"""`PhasePeak`: a phase's transient bytes from the CUDA allocator's peaks (allocated and reserved), and
nothing without CUDA; `PhasePeaks`: each phase's largest."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.megatron.runtime.gpu_memory import PhasePeak, PhasePeaks, phase_part, resident_change


class FakeAllocator:
    """torch.cuda's allocator figures for `PhasePeak`: tensors (`allocated`) in segments taken from the driver
    (`reserved`), with the peak statistics `reset_peak_memory_stats` starts again."""

    def __init__(self, allocated: int, reserved: int) -> None:
        self.allocated, self.reserved = allocated, reserved
        self.reset_peak_memory_stats()

    def reset_peak_memory_stats(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def take(self, nbytes: int, *, new_segment: int = 0) -> None:
        """A tensor of `nbytes`, in the cache's free blocks or in a `new_segment` from the driver."""
        self.allocated += nbytes
        self.reserved += new_segment
        assert self.allocated <= self.reserved, "the fake's tensors outgrow its segments"
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def give(self, nbytes: int) -> None:
        self.allocated -= nbytes  # the block stays cached: reserved unchanged

    def empty_cache(self) -> None:
        self.reserved = self.allocated  # the cached blocks back to the driver (each a segment of its own)

    def memory_allocated(self) -> int:
        return self.allocated

    def memory_reserved(self) -> int:
        return self.reserved

    def max_memory_allocated(self) -> int:
        return self.peak_allocated

    def max_memory_reserved(self) -> int:
        return self.peak_reserved


MIB = 2**20


def test_a_phase_counts_the_segments_it_took_where_they_exceed_its_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fragmented phase: 40 MiB of tensors at its peak took 64 MiB of new segments from the driver. The
    # GPU held the 64, so the plan must count them: the allocated peak alone would leave 24 MiB unplanned.
    cuda = FakeAllocator(allocated=100 * MIB, reserved=100 * MIB)
    monkeypatch.setattr(PhasePeak, "_cuda", staticmethod(lambda: cuda))
    with PhasePeak() as peak:
        cuda.take(30 * MIB, new_segment=32 * MIB)
        cuda.take(10 * MIB, new_segment=32 * MIB)
        cuda.give(40 * MIB)
    assert peak.nbytes == 64 * MIB
    assert peak.cached == 64 * MIB, "what the phase leaves cached"


def test_a_phase_in_a_kept_cache_counts_its_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    # A phase that reuses 48 MiB its process kept cached takes no new segment: its transient is its tensors'
    # rise (the plan counts the kept cache beside it, as `cache`).
    cuda = FakeAllocator(allocated=100 * MIB, reserved=148 * MIB)
    monkeypatch.setattr(PhasePeak, "_cuda", staticmethod(lambda: cuda))
    peaks = PhasePeaks()
    with peaks.measure("train"):
        cuda.take(40 * MIB)
        cuda.give(40 * MIB)
    with peaks.measure("log_probs"):
        cuda.take(40 * MIB)
        cuda.take(20 * MIB, new_segment=20 * MIB)  # past the cache: 12 MiB more than it held
        cuda.give(60 * MIB)
    assert peaks.as_dict() == {"train": 40 * MIB, "log_probs": 60 * MIB}


@pytest.mark.parametrize(
    ("temporaries", "after", "transient"),
    [
        (20, 0, 40),  # the backward's activations are the phase's peak
        (50, 0, 50),  # the optimizer step's temporaries, beside its new moments, are
        (20, 45, 45),  # a rise after the step, above the grown state
    ],
)
def test_state_a_phase_creates_and_keeps_is_resident_not_its_transient(
    monkeypatch: pytest.MonkeyPatch, temporaries: int, after: int, transient: int
) -> None:
    # The first train of a model: 40 MiB of activations come and go, then the optimizer's first step
    # creates 30 MiB of Adam moments, which stay, with some temporaries that go. The memory plan counts
    # the moments among the model's resident tags, measured after the step; counted in the transient too,
    # it would refuse a turn that fits (at 3B on an 80 GB card, 23 GiB twice).
    cuda = FakeAllocator(allocated=100 * MIB, reserved=200 * MIB)
    monkeypatch.setattr(PhasePeak, "_cuda", staticmethod(lambda: cuda))
    peaks = PhasePeaks()
    with peaks.measure("train"):
        cuda.take(40 * MIB)
        cuda.give(40 * MIB)
        with resident_change():
            cuda.take(30 * MIB)  # the moments
            cuda.take(temporaries * MIB)
            cuda.give(temporaries * MIB)
        cuda.take(after * MIB)
        cuda.give(after * MIB)
    assert peaks.as_dict() == {"train": transient * MIB}
    # Outside a phase it changes nothing: the next phase starts from the moments, and a later step
    # (no new state) keeps its temporaries as transient.
    with peaks.measure("log_probs"), resident_change():
        cuda.take(25 * MIB)
        cuda.give(25 * MIB)
    assert peaks.as_dict()["log_probs"] == 25 * MIB
    with resident_change():
        cuda.take(5 * MIB)
    assert peaks.as_dict() == {"train": transient * MIB, "log_probs": 25 * MIB}


@settings(max_examples=200, deadline=None)
@given(
    activations=st.integers(0, 64),
    moments=st.integers(1, 64),
    temporaries=st.integers(0, 64),
    after=st.integers(0, 64),
)
def test_the_plans_sum_covers_the_first_train_and_is_exact_for_the_next(
    activations: int, moments: int, temporaries: int, after: int
) -> None:
    # The plan's figure for a train turn is the model's resident state, measured after the phase, plus
    # the phase's transient. In the first train (the moments made by its optimizer step) that sum must
    # cover what the allocator held at its peak, so that the plan never lets a turn run out of memory;
    # in a later train, with the moments there from its start, it is the peak itself.
    cuda = FakeAllocator(allocated=100 * MIB, reserved=400 * MIB)
    state = 100 * MIB

    def train(*, first: bool) -> int:
        # The phase's transient, as measured.
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(PhasePeak, "_cuda", staticmethod(lambda: cuda))
            with PhasePeak() as peak:
                cuda.take(activations * MIB)
                cuda.give(activations * MIB)
                with resident_change():
                    if first:
                        cuda.take(moments * MIB)
                    cuda.take(temporaries * MIB)
                    cuda.give(temporaries * MIB)
                cuda.take(after * MIB)
                cuda.give(after * MIB)
        assert peak.nbytes is not None
        return peak.nbytes

    # What the allocator held at each train's peak (the block resets its statistics as it goes).
    first_peak = state + max(activations, moments + temporaries, moments + after) * MIB
    transient = train(first=True)
    state += moments * MIB
    assert state + transient >= first_peak, "the plan would let the first train run out of memory"
    # It over-counts by the activations' lead over the rises beside the moments, at most the moments (the
    # peak came before they existed), never the moments twice.
    lead = min(moments, max(0, activations - max(temporaries, after)))
    assert state + transient == first_peak + lead * MIB
    transient = train(first=False)
    assert state + transient == state + max(activations, temporaries, after) * MIB


def test_state_grown_in_new_segments_leaves_their_rounding_a_rise(monkeypatch: pytest.MonkeyPatch) -> None:
    # The moments' 30 MiB took a new 32 MiB segment: 2 MiB of it is the phase's, counted as a rise.
    cuda = FakeAllocator(allocated=100 * MIB, reserved=100 * MIB)
    monkeypatch.setattr(PhasePeak, "_cuda", staticmethod(lambda: cuda))
    with PhasePeak() as peak, resident_change():
        cuda.take(30 * MIB, new_segment=32 * MIB)
    assert peak.nbytes == 2 * MIB


@settings(max_examples=200, deadline=None)
@given(
    passes=st.lists(st.integers(0, 64), min_size=1, max_size=4),
    state=st.integers(1, 64),
    temporaries=st.integers(0, 32),
    cached=st.integers(0, 96),
    empties=st.booleans(),
)
def test_a_trains_passes_and_steps_are_measured_apart_and_cover_a_step_that_wakes_its_state(
    passes: list[int], state: int, temporaries: int, cached: int, empties: bool
) -> None:
    # A train whose optimizer state (`state` MiB) sleeps through its passes: each minibatch's activations
    # come and go, then the state wakes for its step (beside the step's temporaries) and sleeps after it
    # (a sleep may hand the cached blocks back: `empties`). The plan holds the train at its tags awake plus
    # the larger of the passes' figure and the state with the step's: that sum must cover every moment, and be
    # the peak itself.
    cuda = FakeAllocator(allocated=100 * MIB, reserved=(100 + cached) * MIB)
    peaks = PhasePeaks()
    highest = reserved = 100 * MIB

    def take(nbytes: int) -> None:  # in the cache's free blocks, the rest in a new segment
        nonlocal highest, reserved
        cuda.take(nbytes * MIB, new_segment=max(0, nbytes * MIB - (cuda.reserved - cuda.allocated)))
        highest, reserved = max(highest, cuda.allocated), max(reserved, cuda.reserved)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PhasePeak, "_cuda", staticmethod(lambda: cuda))
        with peaks.measure("train", outside="passes"):
            for activations in passes:
                take(activations)
                cuda.give(activations * MIB)
                with resident_change():  # the state wakes
                    take(state)
                with phase_part("optimizer_step"), resident_change():  # as `Trainee.optimizer_step` has it
                    take(temporaries)
                    cuda.give(temporaries * MIB)
                with resident_change():  # and sleeps again
                    cuda.give(state * MIB)
                    if empties:
                        cuda.empty_cache()
    figures = peaks.as_dict()
    step, rest = figures["train/optimizer_step"], figures["train/passes"]
    assert figures["train"] == max(rest, step)
    assert rest >= max(passes) * MIB
    # The step's own temporaries, not the passes' segments it found cached (and took first).
    assert step == temporaries * MIB
    # The plan's sum covers what the tensors reached, and never passes the segments the process held.
    planned = 100 * MIB + max(rest, state * MIB + step)
    assert highest <= planned <= max(reserved, 100 * MIB + max(max(passes), state + temporaries) * MIB)


def test_a_trains_parts_figures_by_hand() -> None:
    # 40 MiB of activations, a step that wakes 30 MiB of state with 10 MiB of temporaries, then 35 MiB of
    # activations: the passes' figure is 40, the step's 10, the train's 40; the woken state is resident.
    cuda = FakeAllocator(allocated=100 * MIB, reserved=300 * MIB)
    peaks = PhasePeaks()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PhasePeak, "_cuda", staticmethod(lambda: cuda))
        with peaks.measure("train", outside="passes"):
            cuda.take(40 * MIB)
            cuda.give(40 * MIB)
            with resident_change():
                cuda.take(30 * MIB)
            with phase_part("optimizer_step"):
                cuda.take(10 * MIB)
                cuda.give(10 * MIB)
                with pytest.raises(RuntimeError, match="parts do not nest"), phase_part("inner"):
                    pass
            with resident_change():
                cuda.give(30 * MIB)
            cuda.take(35 * MIB)
            cuda.give(35 * MIB)
        with peaks.measure("log_probs", outside="passes"):  # no parts: no split figures
            cuda.take(5 * MIB)
            cuda.give(5 * MIB)
    assert peaks.as_dict() == {
        "train": 40 * MIB,
        "train/optimizer_step": 10 * MIB,
        "train/passes": 40 * MIB,
        "log_probs": 5 * MIB,
    }
    # Without the resident change the woken state would count as the step's transient (30 + 10).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PhasePeak, "_cuda", staticmethod(lambda: cuda))
        with PhasePeak() as peak:
            cuda.take(30 * MIB)
            with phase_part("optimizer_step"):
                cuda.take(10 * MIB)
                cuda.give(10 * MIB)
            cuda.give(30 * MIB)
    assert peak.parts == {"optimizer_step": 40 * MIB} and peak.outside == 30 * MIB


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
