"""Release/resume of the embedded engine as a state machine, with failures injected into the weight copies.

Whatever sequence of releases, resumes and generations runs, and wherever a copy of
the weights fails half-way: `released_tags()` tells the truth, released weights hold
no memory, resumed weights are bit-identical to the originals, and generation either
refuses (memory released) or reproduces the reference responses.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tandem.lifecycle import PinnedHostBackend
from tandem.ppo.engines import (
    MEMORY_TAGS,
    EmbeddedEngine,
    EngineMemoryReleasedError,
    EngineOptions,
    SamplingParams,
)

from .conftest import make_tiny_model, random_prompts, save_model


class InjectedFailure(RuntimeError):
    """A failure planted by the test."""


class FlakyPinnedHostBackend(PinnedHostBackend):
    """Pinned-host backend whose next pause or resume fails at its `fail_at`-th tensor copy."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.fail_at: int | None = None
        self._copies_done = 0
        real_copy = self._copier.copy

        def copy(s: Any, buffer: Any, to_host: bool, *, non_blocking: bool) -> None:
            if self.fail_at is not None:
                self._copies_done += 1
                if self._copies_done >= self.fail_at:
                    self.fail_at = None
                    raise InjectedFailure(f"copy {self._copies_done} failed")
            real_copy(s, buffer, to_host, non_blocking=non_blocking)

        self._copier.copy = copy  # type: ignore[method-assign]

    def arm(self, at: int) -> None:
        self.fail_at, self._copies_done = at, 0


@functools.cache
def _model_dir() -> str:
    folder = Path(tempfile.mkdtemp(prefix="tandem-engine-machine-"))
    return save_model(make_tiny_model("llama", seed=3), folder / "model")


PROMPTS = random_prompts(6, seed=40)
PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
tag_sets = st.lists(st.sampled_from(MEMORY_TAGS), min_size=1, max_size=2, unique=True)


class EngineMemoryMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.backend = FlakyPinnedHostBackend()
        self.engine = EmbeddedEngine(_model_dir(), EngineOptions(device="cpu"), memory_backend=self.backend)
        self.originals = {n: p.detach().clone() for n, p in self.engine.model.state_dict().items()}
        self.reference = [g.token_ids for g in self.engine.generate(PROMPTS, PARAMS)]
        self.released: set[str] = set()

    @rule(tags=tag_sets, fail_at=st.none() | st.integers(min_value=1, max_value=12))
    def release(self, tags: list[str], fail_at: int | None) -> None:
        weights_move = "weights" in tags and "weights" not in self.released
        if fail_at is not None:
            self.backend.arm(fail_at)
        try:
            self.engine.release_memory(tags)  # type: ignore[arg-type]
        except InjectedFailure:
            assert weights_move, "only a weight copy can fail"
            self.released |= {"kv_cache"} & set(tags)  # the KV cache goes first
        else:
            self.released |= set(tags)
        finally:
            self.backend.fail_at = None

    @rule(tags=tag_sets, fail_at=st.none() | st.integers(min_value=1, max_value=12))
    def resume(self, tags: list[str], fail_at: int | None) -> None:
        weights_move = "weights" in tags and "weights" in self.released
        if fail_at is not None:
            self.backend.arm(fail_at)
        try:
            self.engine.resume_memory(tags)  # type: ignore[arg-type]
        except InjectedFailure:
            assert weights_move, "only a weight copy can fail"  # weights first: nothing else moved
        else:
            self.released -= set(tags)
        finally:
            self.backend.fail_at = None

    @rule()
    def generate(self) -> None:
        if self.released:
            with pytest.raises(EngineMemoryReleasedError):
                self.engine.generate(PROMPTS, PARAMS)
        else:
            assert [g.token_ids for g in self.engine.generate(PROMPTS, PARAMS)] == self.reference

    @invariant()
    def released_tags_tell_the_truth(self) -> None:
        assert set(self.engine.released_tags()) == self.released

    @invariant()
    def weights_are_gone_or_intact(self) -> None:
        state = self.engine.model.state_dict()
        if "weights" in self.released:
            assert all(t.untyped_storage().nbytes() == 0 for t in state.values())
        else:
            for name, original in self.originals.items():
                assert torch.equal(state[name], original), name


EngineMemoryMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineMemory = EngineMemoryMachine.TestCase
