"""A step's turns (`StepTurns`) keep the step's rollout only as long as someone holds the turns.

The driver drops each step's turns when the step ends; reference counting alone must then free the
rollout (its token ids, log-probs and the batches it keeps in Ray's object store). The turns once held
their work as bound methods, a reference cycle through every step's turns, so each step's rollout
waited for Python's cyclic collector, which on a driver's large heap runs rarely: the driver's RSS
grew linearly with the steps (docs/benchmarks.md, the soak).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from tandem.ppo.loop.schedule import Turn
from tandem.ppo.loop.turns import StepTurns


class _Gpus:
    """The roles, as the generate turn sees them: it only reports the turn done (`after`)."""

    def __init__(self) -> None:
        self.after_turns: list[Turn] = []

    def after(self, turn: Turn) -> None:
        self.after_turns.append(turn)


class _Sampled:
    """A stand-in for the step's rollout (`Sampled`)."""


@pytest.fixture
def no_cyclic_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("drawn_in_the_step", [True, False], ids=["drawn", "drawn-before"])
def test_a_steps_turns_free_its_rollout_without_the_cyclic_collector(
    no_cyclic_collector: None, drawn_in_the_step: bool
) -> None:
    rollout: Any = _Sampled()
    undrawn = [rollout]  # what `draw` hands out, once
    gpus = _Gpus()
    turn = Turn("engine", "generate", sleep_after=True)
    turns = StepTurns(
        gpus,  # type: ignore[arg-type]
        0,
        sampled=None if drawn_in_the_step else rollout,
        draw=undrawn.pop,
        start_next=None,
    )
    turns.take(turn)
    assert turns.rollout is rollout and gpus.after_turns == [turn]
    alive = weakref.ref(rollout)
    undrawn.clear()
    del rollout, turns
    assert alive() is None, [type(r).__name__ for r in gc.get_referrers(alive())]
