"""Lifecycle: the order of its steps, idempotence, and what a failure in each step leaves behind."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import pytest

from tandem.lifecycle import Lifecycle, MemoryBackend, NoopBackend


class Boom(RuntimeError):
    """The injected failure."""


class Recorder:
    """A backend and the three hooks in one: every call lands in `log`; `fail` names steps that raise once."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.fail: set[str] = set()

    def _step(self, name: str) -> None:
        self.log.append(name)
        if name in self.fail:
            self.fail.discard(name)
            raise Boom(name)

    def region(self, tag: str) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def pause(self, tag: str | None = None) -> None:
        self._step(f"pause:{tag}")

    def resume(self, tag: str | None = None) -> None:
        self._step(f"resume:{tag}")

    def lifecycle(self, tags: list[str] | None = None) -> Lifecycle:
        return Lifecycle(
            self,
            tags=tags,
            clear_caches=lambda: self._step("clear"),
            destroy_process_groups=lambda: self._step("destroy"),
            reload_process_groups=lambda: self._step("reload"),
        )


def test_the_recorder_is_a_memory_backend() -> None:
    assert isinstance(Recorder(), MemoryBackend)
    assert isinstance(NoopBackend(), MemoryBackend)


def test_sleep_and_wake_run_their_steps_in_order() -> None:
    r = Recorder()
    lc = r.lifecycle()
    assert not lc.asleep
    lc.sleep()
    assert lc.asleep
    assert r.log == ["clear", "destroy", "pause:None"]
    r.log.clear()
    lc.wake_up()
    assert not lc.asleep
    assert r.log == ["resume:None", "clear", "reload"]


def test_a_wake_clears_with_its_own_hook_when_given_one() -> None:
    r = Recorder()
    lc = Lifecycle(
        r,
        clear_caches=lambda: r._step("clear"),
        clear_caches_on_wake=lambda: r._step("clear-on-wake"),
        reload_process_groups=lambda: r._step("reload"),
    )
    lc.sleep()
    assert r.log == ["clear", "pause:None"]
    r.log.clear()
    lc.wake_up()
    assert r.log == ["resume:None", "clear-on-wake", "reload"]


def test_sleep_when_asleep_does_nothing_and_wake_when_awake_only_reloads_groups() -> None:
    r = Recorder()
    lc = r.lifecycle()
    lc.wake_up()
    assert r.log == ["reload"]
    lc.sleep()
    r.log.clear()
    lc.sleep()
    assert r.log == []
    assert lc.asleep


def test_tags_are_paused_in_order_and_resumed_in_order() -> None:
    r = Recorder()
    lc = r.lifecycle(["weights", "grads", "optimizer"])
    lc.sleep()
    lc.wake_up()
    assert r.log == [
        "clear", "destroy", "pause:weights", "pause:grads", "pause:optimizer",
        "resume:weights", "resume:grads", "resume:optimizer", "clear", "reload",
    ]  # fmt: skip


def test_last_timings_name_each_step_of_the_last_call_and_omit_a_step_that_failed() -> None:
    r = Recorder()
    lc = r.lifecycle(["weights", "optimizer"])
    assert lc.last_timings == {}
    lc.sleep()
    sleep_timings = lc.last_timings
    assert list(sleep_timings) == [
        "clear_caches", "destroy_process_groups", "pause:weights", "pause:optimizer", "total",
    ]  # fmt: skip
    assert all(t >= 0 for t in sleep_timings.values())
    assert sleep_timings["total"] >= sum(t for k, t in sleep_timings.items() if k != "total")
    lc.sleep()  # already asleep: nothing ran
    assert lc.last_timings == {}
    r.fail.add("resume:optimizer")
    with pytest.raises(Boom):
        lc.wake_up()
    assert list(lc.last_timings) == ["resume:weights"]
    lc.wake_up()
    assert list(lc.last_timings) == ["resume:optimizer", "clear_caches", "reload_process_groups", "total"]
    lc.wake_up()  # awake: only the groups
    assert list(lc.last_timings) == ["reload_process_groups", "total"]
    # A copy: changing it changes nothing inside.
    lc.last_timings.clear()
    assert list(lc.last_timings) == ["reload_process_groups", "total"]


@pytest.mark.parametrize("step", ["clear", "destroy", "pause:None"])
def test_a_failed_sleep_stays_awake_and_a_retry_finishes_it(step: str) -> None:
    r = Recorder()
    lc = r.lifecycle()
    r.fail.add(step)
    with pytest.raises(Boom):
        lc.sleep()
    assert not lc.asleep  # the memory did not move
    lc.sleep()
    assert lc.asleep
    assert r.log.count("pause:None") == (2 if step == "pause:None" else 1)


@pytest.mark.parametrize("step", ["resume:None", "clear", "reload"])
def test_a_failed_wake_tells_the_truth_and_a_retry_repairs_it(step: str) -> None:
    r = Recorder()
    lc = r.lifecycle()
    lc.sleep()
    r.fail.add(step)
    r.log.clear()
    with pytest.raises(Boom):
        lc.wake_up()
    # The memory is back unless resume itself failed; asleep follows the memory.
    assert lc.asleep == (step == "resume:None")
    r.log.clear()
    lc.wake_up()
    assert not lc.asleep
    expected = ["resume:None", "clear", "reload"] if step == "resume:None" else ["reload"]
    assert r.log == expected


def test_a_sleep_that_failed_half_way_is_finished_or_undone() -> None:
    r = Recorder()
    lc = r.lifecycle(["weights", "grads"])
    r.fail.add("pause:grads")
    with pytest.raises(Boom):
        lc.sleep()
    assert lc.asleep, "weights are on the host"
    r.log.clear()
    lc.sleep()
    assert r.log == ["clear", "destroy", "pause:grads"]
    lc.wake_up()

    r.fail.add("pause:grads")
    with pytest.raises(Boom):
        lc.sleep()
    r.log.clear()
    lc.wake_up()  # undoes the half sleep: only what was paused is resumed
    assert r.log == ["resume:weights", "clear", "reload"]
    assert not lc.asleep


@pytest.mark.parametrize("tags", [[], "weights", ["a", "a"], ["a", ""]])
def test_bad_tags_are_refused(tags: object) -> None:
    with pytest.raises(ValueError, match="tags"):
        Lifecycle(NoopBackend(), tags=tags)  # type: ignore[arg-type]


def test_parts_of_the_memory_can_sleep_and_wake_alone() -> None:
    r = Recorder()
    lc = r.lifecycle(["weights", "grads", "optimizer"])
    lc.sleep()
    r.log.clear()
    lc.wake_up(["weights"])  # e.g. to export the weights while the rest stays away
    assert r.log == ["resume:weights", "clear", "reload"]
    assert lc.asleep and lc.paused_tags == {"grads", "optimizer"}
    r.log.clear()
    lc.sleep(["weights"])
    assert r.log == ["clear", "destroy", "pause:weights"]
    r.log.clear()
    lc.sleep(["optimizer", "grads"])  # already away
    assert r.log == []
    lc.wake_up()
    assert not lc.asleep


def test_choosing_tags_needs_a_lifecycle_with_tags() -> None:
    with pytest.raises(ValueError, match="moves all memory at once"):
        Recorder().lifecycle().wake_up(["weights"])
    with pytest.raises(ValueError, match="choose among"):
        Recorder().lifecycle(["weights"]).sleep(["grads"])
    with pytest.raises(ValueError, match="choose among"):
        Recorder().lifecycle(["weights"]).sleep("weights")  # type: ignore[arg-type]


def test_process_groups_false_moves_memory_and_leaves_the_groups_as_they_are() -> None:
    r = Recorder()
    lc = r.lifecycle(tags=["weights", "optimizer"])
    lc.sleep()
    r.log.clear()
    lc.wake_up(["weights"], process_groups=False)  # a weight export that needs no collective
    assert r.log == ["resume:weights", "clear"]
    assert "reload_process_groups" not in lc.last_timings
    r.log.clear()
    lc.sleep(["weights"], process_groups=False)
    assert r.log == ["clear", "pause:weights"]
    assert "destroy_process_groups" not in lc.last_timings
    r.log.clear()
    lc.wake_up()  # the default brings the groups back with the memory
    assert r.log == ["resume:weights", "resume:optimizer", "clear", "reload"]
    r.log.clear()
    lc.wake_up(process_groups=False)  # awake already: nothing at all
    assert r.log == []
