"""Stateful test of Lifecycle over random sleeps, wakes, training steps and failures in any step.

The memory backend is the real PinnedHostBackend on CPU tensors, wrapped so that
every call is recorded and any step can be told to fail (before it has any effect,
which is the backend contract). Checked after every step: the backend never sees
a pause of what is paused nor a resume of what is awake, `asleep` equals the
backend's real state, a wake when awake only reloads the process groups, and the
training state comes back bit-identical, views included.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import ClassVar

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tandem.lifecycle import Lifecycle, PinnedHostBackend

STEPS = ["clear_caches", "destroy_process_groups", "pause", "resume", "reload_process_groups"]


class Injected(RuntimeError):
    """A failure the test asked for."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


class FaultyBackend:
    """The real backend behind a recorder that can fail any call before it acts."""

    def __init__(self, inner: PinnedHostBackend, fail: set[str]) -> None:
        self.inner = inner
        self.fail = fail
        self.calls: list[tuple[str, str | None]] = []
        self.violations: list[str] = []

    def region(self, tag: str) -> AbstractContextManager[None]:
        return self.inner.region(tag)

    def _tags(self, tag: str | None) -> set[str]:
        return set(self.inner.tags) if tag is None else {tag}

    def pause(self, tag: str | None = None) -> None:
        self.calls.append(("pause", tag))
        if self._tags(tag) & self.inner.paused_tags:
            self.violations.append(f"pause({tag!r}) while paused: {sorted(self.inner.paused_tags)}")
        if "pause" in self.fail:
            self.fail.discard("pause")
            raise Injected("pause")
        self.inner.pause(tag)

    def resume(self, tag: str | None = None) -> None:
        self.calls.append(("resume", tag))
        if self._tags(tag) - self.inner.paused_tags:
            self.violations.append(f"resume({tag!r}) while awake: {sorted(self.inner.paused_tags)}")
        if "resume" in self.fail:
            self.fail.discard("resume")
            raise Injected("resume")
        self.inner.resume(tag)


class LifecycleMachine(RuleBasedStateMachine):
    """One model: a flat parameter buffer with views, a flat grad buffer, lazily created optimizer state."""

    tags: ClassVar[list[str] | None] = None

    @initialize()
    def build(self) -> None:
        self.flat_params = torch.randn(64)
        self.params = [self.flat_params[:40].view(5, 8), self.flat_params[40:]]
        self.flat_grads = torch.zeros(64, dtype=torch.bfloat16)
        self.optimizer_state: dict[str, torch.Tensor] = {}
        self.fail: set[str] = set()
        self.groups_alive = True
        self.hook_calls: list[str] = []
        inner = PinnedHostBackend()
        weights = "weights" if self.tags else "all"
        inner.register(weights, self.params)
        inner.register("grads" if self.tags else "all", [self.flat_grads])
        inner.register("optimizer" if self.tags else "all", lambda: list(self.optimizer_state.values()))
        self.backend = FaultyBackend(inner, self.fail)
        self.lifecycle = Lifecycle(
            self.backend,
            tags=self.tags,
            clear_caches=lambda: self._hook("clear_caches"),
            destroy_process_groups=lambda: self._hook("destroy_process_groups"),
            reload_process_groups=lambda: self._hook("reload_process_groups"),
        )
        self.expected = self._snapshot()

    def _hook(self, name: str) -> None:
        self.hook_calls.append(name)
        if name in self.fail:
            self.fail.discard(name)
            raise Injected(name)
        if name == "destroy_process_groups":
            self.groups_alive = False
        elif name == "reload_process_groups":
            self.groups_alive = True

    def _tensors(self) -> dict[str, list[torch.Tensor]]:
        """The backend's tags and the tensors each one owns."""
        by_tag = {
            "weights": [self.flat_params],
            "grads": [self.flat_grads],
            "optimizer": list(self.optimizer_state.values()),
        }
        return by_tag if self.tags else {"all": [t for ts in by_tag.values() for t in ts]}

    def _snapshot(self) -> dict[str, list[torch.Tensor]]:
        return {tag: [_bytes(t) for t in ts] for tag, ts in self._tensors().items()}

    @rule(step=st.sampled_from(STEPS))
    def arm_failure(self, step: str) -> None:
        self.fail.add(step)

    @rule()
    def sleep(self) -> None:
        was_fully_asleep = self.backend.inner.paused_tags == set(self.backend.inner.tags)
        calls_before = (len(self.backend.calls), len(self.hook_calls))
        try:
            self.lifecycle.sleep()
        except Injected:
            return
        if was_fully_asleep:
            assert (len(self.backend.calls), len(self.hook_calls)) == calls_before, "sleep when asleep acted"
        assert not self.groups_alive

    @rule()
    def wake_up(self) -> None:
        was_awake = not self.backend.inner.paused_tags
        calls_before, hooks_before = len(self.backend.calls), len(self.hook_calls)
        try:
            self.lifecycle.wake_up()
        except Injected:
            return
        if was_awake:
            assert len(self.backend.calls) == calls_before, "wake when awake touched the memory"
            assert self.hook_calls[hooks_before:] == ["reload_process_groups"]
        assert self.groups_alive

    @precondition(lambda self: not self.backend.inner.paused_tags)
    @rule(value=st.floats(-4, 4, allow_nan=False), new_state=st.booleans())
    def train_step(self, value: float, new_state: bool) -> None:
        """What a training step does while awake: write weights through a view, grads, optimizer state."""
        self.params[0][1, 2] = value
        self.flat_grads.add_(value)
        if new_state and len(self.optimizer_state) < 4:
            self.optimizer_state[f"s{len(self.optimizer_state)}"] = torch.full((16,), value)
        for t in self.optimizer_state.values():
            t.mul_(0.5)
        self.expected = self._snapshot()

    @invariant()
    def backend_never_repeats_a_move(self) -> None:
        assert self.backend.violations == []

    @invariant()
    def asleep_tells_the_truth(self) -> None:
        assert self.lifecycle.asleep == bool(self.backend.inner.paused_tags)

    @invariant()
    def memory_is_away_or_bit_identical(self) -> None:
        for tag, tensors in self._tensors().items():
            if tag in self.backend.inner.paused_tags:
                assert all(t.untyped_storage().nbytes() == 0 for t in tensors), tag
            else:
                for t, e in zip(tensors, self.expected[tag], strict=True):
                    assert torch.equal(_bytes(t), e), tag
        if self.flat_params.untyped_storage().nbytes():
            # the views still alias the flat buffer
            assert self.params[1].data_ptr() == self.flat_params.data_ptr() + 40 * 4


class LifecycleMachineWithTags(LifecycleMachine):
    """The same model paused tag by tag, so that a sleep can fail half-way, and parts can move alone."""

    tags: ClassVar[list[str] | None] = ["weights", "grads", "optimizer"]

    @rule(some=st.lists(st.sampled_from(["weights", "grads", "optimizer"]), min_size=1, unique=True))
    def sleep_some(self, some: list[str]) -> None:
        others = {t: t in self.backend.inner.paused_tags for t in self._tensors() if t not in some}
        already = set(some) <= self.backend.inner.paused_tags
        calls_before = (len(self.backend.calls), len(self.hook_calls))
        try:
            self.lifecycle.sleep(some)
        except Injected:
            return
        if already:
            assert (len(self.backend.calls), len(self.hook_calls)) == calls_before
        else:
            assert not self.groups_alive
        assert set(some) <= self.backend.inner.paused_tags
        assert others == {t: t in self.backend.inner.paused_tags for t in others}, "other tags moved"

    @rule(some=st.lists(st.sampled_from(["weights", "grads", "optimizer"]), min_size=1, unique=True))
    def wake_some(self, some: list[str]) -> None:
        others = {t: t in self.backend.inner.paused_tags for t in self._tensors() if t not in some}
        none_paused = not set(some) & self.backend.inner.paused_tags
        calls_before, hooks_before = len(self.backend.calls), len(self.hook_calls)
        try:
            self.lifecycle.wake_up(some)
        except Injected:
            return
        if none_paused:
            assert len(self.backend.calls) == calls_before
            assert self.hook_calls[hooks_before:] == ["reload_process_groups"]
        assert not set(some) & self.backend.inner.paused_tags
        assert others == {t: t in self.backend.inner.paused_tags for t in others}, "other tags moved"
        assert self.groups_alive


class LifecycleMachineWithFrozenBase(LifecycleMachineWithTags):
    """A LoRA model: a frozen base (tag "base", registered `frozen`) beside the trained tags.

    The base never changes, so it is copied to the host at most once, whatever the sleeps, wakes and
    failures; every wake brings it back from that copy. Writes into it while awake (as an engine's merges
    would be) are undone by `refresh` or dropped by the next pause.
    """

    tags: ClassVar[list[str] | None] = ["base", "weights", "grads", "optimizer"]

    @initialize()
    def build(self) -> None:
        self.flat_base = torch.randn(48)
        self.base = [self.flat_base[:32].view(4, 8), self.flat_base[32:]]
        self.base_bytes = [_bytes(self.flat_base)]
        self.base_dirty = False
        super().build()
        self.backend.inner.register("base", self.base, frozen=True)

    def _tensors(self) -> dict[str, list[torch.Tensor]]:
        # The base is checked against itself unless it holds writes (until a refresh or a pause).
        return ({} if self.base_dirty else {"base": [self.flat_base]}) | super()._tensors()

    def _snapshot(self) -> dict[str, list[torch.Tensor]]:
        # Whatever was written into the base since, a wake brings the base itself back.
        return {**super()._snapshot(), "base": self.base_bytes}

    def _base_awake(self) -> bool:
        return "base" not in self.backend.inner.paused_tags

    # As an engine merges into its base: only once the host copy exists (`retain`).
    @precondition(lambda self: self._base_awake() and self.backend.inner.copied_to_host("base") > 0)
    @rule(value=st.floats(-4, 4, allow_nan=False))
    def write_into_the_base(self, value: float) -> None:
        self.base[1][3] = value
        self.base_dirty = True

    @precondition(lambda self: self._base_awake())
    @rule()
    def retain_the_base(self) -> None:
        self.backend.inner.retain("base")

    @precondition(lambda self: self._base_awake() and self.backend.inner.copied_to_host("base") > 0)
    @rule()
    def refresh_the_base(self) -> None:
        self.backend.inner.refresh("base", [self.flat_base])
        self.base_dirty = False

    @invariant()
    def the_base_is_copied_to_the_host_once_at_most(self) -> None:
        assert self.backend.inner.copied_to_host("base") in (0, 48 * 4)
        if not self._base_awake():
            self.base_dirty = False  # what was written into it went with the GPU memory


_settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestLifecycleMachine = LifecycleMachine.TestCase
TestLifecycleMachine.settings = _settings
TestLifecycleMachineWithTags = LifecycleMachineWithTags.TestCase
TestLifecycleMachineWithTags.settings = _settings
TestLifecycleMachineWithFrozenBase = LifecycleMachineWithFrozenBase.TestCase
TestLifecycleMachineWithFrozenBase.settings = _settings
