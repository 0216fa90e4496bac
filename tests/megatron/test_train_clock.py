"""`worker.train_clock.TrainClock`: a train's seconds by part, on a fake clock (no timed assertion).

- Drawn trains (hypothesis): parts and the gaps between them, each part any number of times; each part's
  figure is the sum of its blocks' seconds, `other` the gaps, and the parts with `other` sum to `total`.
- A part inside another, an unknown part and figures before `stop` are refused; a part that raises still
  counts its seconds.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.megatron.worker import train_clock
from tandem.megatron.worker.train_clock import TRAIN_TIME_PARTS, TrainClock, timed_part


class FakeTime:
    """`time.perf_counter` that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    clock = FakeTime()
    monkeypatch.setattr(train_clock.time, "perf_counter", clock)
    return clock


seconds = st.integers(0, 10**6).map(lambda us: us / 1e6)


@given(
    blocks=st.lists(st.tuples(st.sampled_from(TRAIN_TIME_PARTS), seconds, seconds), max_size=12),
    tail=seconds,
)
def test_each_parts_figure_is_the_sum_of_its_blocks_and_all_sum_to_the_total(
    blocks: list[tuple[str, float, float]], tail: float
) -> None:
    fake = FakeTime()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_clock.time, "perf_counter", fake)
        clock = TrainClock(torch.device("cpu"))
        expected: dict[str, float] = {}
        gaps = tail
        for name, gap, inside in blocks:
            fake.now += gap  # time outside any part
            gaps += gap
            with clock.part(name):
                fake.now += inside
            expected[name] = expected.get(name, 0.0) + inside
        fake.now += tail
        clock.stop()
        figures = clock.figures()
    assert figures.keys() == {*expected, "other", "total"}
    for name, total in expected.items():
        assert figures[name] == pytest.approx(total, abs=1e-9)
    assert figures["other"] == pytest.approx(gaps, abs=1e-9)
    assert figures["total"] == pytest.approx(gaps + sum(expected.values()), abs=1e-9)
    assert sum(v for k, v in figures.items() if k != "total") == pytest.approx(figures["total"], abs=1e-9)


def test_parts_do_not_nest_and_unknown_ones_are_refused(fake_time: FakeTime) -> None:
    clock = TrainClock(torch.device("cpu"))
    with (
        pytest.raises(ValueError, match="'optimizer_step' opened inside 'passes'; parts do not nest"),
        clock.part("passes"),
        clock.part("optimizer_step"),
    ):
        pass
    with pytest.raises(ValueError, match="'forward' is not one of"), clock.part("forward"):
        pass
    with pytest.raises(RuntimeError, match="call stop"):
        clock.figures()


def test_a_part_that_raises_counts_its_seconds_and_no_clock_times_nothing(fake_time: FakeTime) -> None:
    clock = TrainClock(torch.device("cpu"))
    with pytest.raises(KeyError), clock.part("passes"):
        fake_time.now += 2.0
        raise KeyError("boom")
    with timed_part(clock, "optimizer_step"):  # the part after it opens: the first one closed
        fake_time.now += 1.0
    with timed_part(None, "passes"):
        fake_time.now += 4.0
    clock.stop()
    assert clock.figures() == {"passes": 2.0, "optimizer_step": 1.0, "other": 4.0, "total": 7.0}
