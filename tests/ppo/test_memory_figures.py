"""`measure_memory`'s capacity: the GPU's memory less what processes outside the run hold on it, over stand-in
roles (the answers a train group and the engines give on a GPU)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from tandem.ppo.config import PPOConfig
from tandem.ppo.config.flag_help import help_text
from tandem.ppo.loop.memory_figures import MemoryFigures, measure_memory
from tandem.ppo.loop.memory_model import format_bytes
from tandem.ppo.loop.memory_planner import plan_memory
from tandem.ppo.loop.out_of_memory import out_of_memory, out_of_memory_note
from tandem.ppo.loop.schedule import StepFacts, StepSchedule, step_schedule
from tandem.ppo.loop.step_plans import StepPlans
from tandem.ppo.run.errors import failure_line

GIB = 2**30


class FakeGroup:
    """A train group's answers, one rank, with the pids it reports and what its worker sees of others."""

    def __init__(self, role: str, pid: int | None, foreign: int | None) -> None:
        self.role, self.pid, self.foreign = role, pid, foreign
        self.asked_pids: list[int] | None = None

    def run(self, method: str, *args: Any) -> list[Any]:
        if method == "foreign_gpu_bytes":
            self.asked_pids = list(args[0])
        answers: dict[str, Any] = {
            "memory_tags": ["weights", "optimizer"],
            "state_nbytes": {"weights": GIB, "optimizer": 2 * GIB},
            "gpu_memory": {"context": GIB // 2, "pid": self.pid},
            "phase_peaks": {"train": 3 * GIB},
            "foreign_gpu_bytes": self.foreign,
        }
        return [answers[method]]


class FakeGpus:
    reward_model = None
    teacher = None

    def __init__(self, groups: list[FakeGroup]) -> None:
        self.groups = groups

    def models(self) -> list[FakeGroup]:
        return self.groups


def engine(pid: int | None) -> dict[str, float]:
    stats = {"allocated_gib": 4.0, "reserved_gib": 4.0, "kv_cache_gib": 2.0, "total_gib": 80.0}
    return stats if pid is None else {**stats, "pid": pid}


def test_the_capacity_leaves_what_others_hold(caplog: pytest.LogCaptureFixture) -> None:
    actor, critic = FakeGroup("actor", 11, 3 * GIB), FakeGroup("critic", 12, 2 * GIB)
    with caplog.at_level(logging.INFO, logger="tandem.ppo.loop.memory_figures"):
        figures = measure_memory(
            FakeGpus([actor, critic]), engine_stats=[engine(10)], gpu_memory_gib=None, margin_gib=4
        )
    assert actor.asked_pids == [10, 11, 12], "the engines' and every worker's pids are the run's"
    assert figures.budget.capacity == 80 * GIB - 3 * GIB, "the most any worker saw held by others"
    assert figures.budget.available == 73 * GIB
    assert "processes outside the run hold 3.00 GiB" in caplog.text
    # A stated capacity stands where the GPU has it; past what the run has of the GPU it is cut there.
    stated = measure_memory(
        FakeGpus([actor, critic]), engine_stats=[engine(10)], gpu_memory_gib=60, margin_gib=4
    )
    assert stated.budget.capacity == 60 * GIB
    with caplog.at_level(logging.WARNING, logger="tandem.ppo.loop.memory_figures"):
        cut = measure_memory(
            FakeGpus([actor, critic]), engine_stats=[engine(10)], gpu_memory_gib=79, margin_gib=4
        )
    assert cut.budget.capacity == 77 * GIB and "--gpu-memory-gib 79 is more than the 77.0 GiB" in caplog.text


def test_without_the_runs_pids_nothing_is_taken_off() -> None:
    # An engine that reports no pid (or a worker in a pid namespace of its own): nothing tells the run's
    # processes from the others', so the whole GPU is the capacity and the margin covers the rest.
    actor = FakeGroup("actor", 11, 3 * GIB)
    figures = measure_memory(
        FakeGpus([actor]), engine_stats=[engine(None)], gpu_memory_gib=None, margin_gib=4
    )
    assert figures.budget.capacity == 80 * GIB and actor.asked_pids is None
    unknown = FakeGroup("actor", None, 3 * GIB)
    assert (
        measure_memory(
            FakeGpus([unknown]), engine_stats=[engine(10)], gpu_memory_gib=None, margin_gib=4
        ).budget.capacity
        == 80 * GIB
    )


def test_a_gpu_full_of_others_is_refused() -> None:
    actor = FakeGroup("actor", 11, 80 * GIB)
    with pytest.raises(
        ValueError, match=r"other processes hold 80\.0 GiB, the GPU's whole memory; free the GPU"
    ):
        measure_memory(FakeGpus([actor]), engine_stats=[engine(10)], gpu_memory_gib=None, margin_gib=4)


# --- an out-of-memory error in a step: the turn, the plan's figures, the flags that give room -------------


def worker_error(cause: BaseException) -> BaseException:
    """The exception the driver meets when a worker's call raised `cause`: Ray's `RayTaskError`, of the
    cause's class where it can be, with the cause kept."""
    from ray.exceptions import RayTaskError

    error = RayTaskError(
        "TrainWorkerHost.run", "Traceback ...", cause, proctitle="ray::TrainWorkerHost", pid=4242
    )
    return error.as_instanceof_cause()


def _oom() -> BaseException:
    import torch

    return torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.30 GiB. GPU 0 has a total capacity"
    )


def test_an_out_of_memory_error_is_known_raised_here_or_in_a_worker() -> None:
    assert out_of_memory(_oom())
    assert out_of_memory(worker_error(_oom())), "the worker's exception, kept by Ray as the cause"
    try:
        try:
            raise _oom()
        except Exception as inner:
            raise RuntimeError("the train turn failed") from inner
    except RuntimeError as chained:
        assert out_of_memory(chained)
    assert not out_of_memory(worker_error(ValueError("--micro-batch-size: give a positive count")))
    assert not out_of_memory(RuntimeError("NCCL error"))


def _flags(text: str) -> set[str]:
    return set(re.findall(r"--[a-z][a-z0-9-]+", text))


def _planned_step() -> tuple[StepSchedule, MemoryFigures]:
    """A shared KL-first step's schedule and the figures of stand-in roles on an 80 GiB GPU, 4 GiB kept free."""
    schedule = step_schedule(StepFacts(colocate=True, offload_train=True, critic=True, kl_first=True))
    figures = measure_memory(
        FakeGpus([FakeGroup("actor", 11, 0), FakeGroup("critic", 12, 0)]),
        engine_stats=[engine(10)],
        gpu_memory_gib=None,
        margin_gib=4,
    )
    return schedule, figures


def test_the_note_gives_the_plans_figures_for_the_turn_and_real_flags() -> None:
    schedule, figures = _planned_step()
    plan = plan_memory(schedule, figures.model, figures.budget)
    index = next(i for i, t in enumerate(schedule.turns) if (t.role, t.work) == ("actor", "train"))
    planned = plan.turns[index]
    note = out_of_memory_note(
        index, schedule.turns[index], plan=plan, figures=figures, memory_plan="fit", offload_train=True
    )
    assert note.startswith(f"out of GPU memory in turn {index} of the step (actor: ")
    assert f"put at {format_bytes(max(planned.peaks.values()))}" in note, "the plan's peak for this turn"
    assert "of the 76.0 GiB it may fill (80.0 GiB less --memory-margin-gib 4)" in note
    assert "RUN_DIR/memory_plan.json" in note
    notes = [note] + [
        out_of_memory_note(
            index, schedule.turns[index], plan=None, figures=None, memory_plan=mode, offload_train=o
        )
        for mode, o in (("fit", True), ("whole", True), ("whole", False))
    ]
    assert "first step" in notes[1] and "--offload-train puts each to sleep" in notes[3]
    # The default, auto: its first step measures where it may plan; where it took no plan, whole roles.
    first, unplanned = (
        out_of_memory_note(
            index,
            schedule.turns[index],
            plan=None,
            figures=None,
            memory_plan="auto",
            offload_train=True,
            measuring=measuring,
        )
        for measuring in (True, False)
    )
    assert "first step" in first and "(--memory-plan auto)" in first
    assert unplanned == notes[2], "as whole-role sleeping"
    notes += [first, unplanned]
    parser_flags = _flags(
        help_text("train", PPOConfig(hf_checkpoint="", rollout_batch_size=8, global_batch_size=8))
    )
    for text in notes:
        assert _flags(text) and _flags(text) <= parser_flags, _flags(text) - parser_flags


def test_a_failed_step_carries_the_note_to_the_commands_line() -> None:
    # The driver adds the note to the exception the turn raised; the command's one line keeps it.
    error = worker_error(_oom())
    error.add_note("out of GPU memory in turn 3 of the step (actor: train); raise --memory-margin-gib")
    said = failure_line(error)
    assert said is not None
    status, line = said
    assert line.startswith("a train worker (pid 4242): CUDA out of memory. Tried to allocate 2.30 GiB")
    assert status == 1 and line.endswith(
        "(out of GPU memory in turn 3 of the step (actor: train); raise --memory-margin-gib)"
    )


class FailingTurns:
    """A step's turns whose every turn raises `error` (a worker's out-of-memory error, or another)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def take(self, turn: Any) -> None:
        raise self.error


class PlannedGpus:
    """The roles on the GPUs as the step sees them: the plan it runs (None: the whole-role schedule)."""

    def __init__(self, plan: Any) -> None:
        self.plan, self.entered = plan, []

    def enter(self, index: int) -> None:
        self.entered.append(index)


def test_the_step_adds_the_note_to_a_turns_out_of_memory_error_only() -> None:
    from tandem.ppo.loop.driver import PPODriver

    schedule, figures = _planned_step()
    driver = PPODriver.__new__(PPODriver)  # the turn's wrapper only: no validation, no Ray
    driver.config = PPOConfig(hf_checkpoint="", rollout_batch_size=8, global_batch_size=8, memory_plan="fit")
    driver.gpus = PlannedGpus(plan_memory(schedule, figures.model, figures.budget))  # type: ignore[assignment]
    driver.plans = StepPlans(lambda: driver.config, Path("unused"))
    driver.plans.figures = figures
    error = worker_error(_oom())
    with pytest.raises(type(error)) as raised:
        driver.take_turn(FailingTurns(error), 3, schedule.turns[3])  # type: ignore[arg-type]
    assert driver.gpus.entered == [3], "the plan's moves come before the turn's work"  # type: ignore[attr-defined]
    (note,) = raised.value.__notes__
    assert (
        note.startswith("out of GPU memory in turn 3 of the step (actor: ")
        and "--memory-margin-gib 4" in note
    )
    other = worker_error(ValueError("--micro-batch-size: give a positive count"))
    with pytest.raises(type(other)) as raised_other:
        driver.take_turn(FailingTurns(other), 3, schedule.turns[3])  # type: ignore[arg-type]
    assert not getattr(raised_other.value, "__notes__", None), "another error goes on as it was"
