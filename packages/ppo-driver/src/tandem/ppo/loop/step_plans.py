"""Which steps run under the memory plan: the plan where the run can take one, whole-role sleeps elsewhere.

`StepPlans` is one start's memory plan as the driver's steps take it: before each step (`begin`) the plan
taken or not, after it (`end`) the figures grown with what the step needed, and an out-of-memory error's
note (`note`). After the first step of a start `--memory-plan fit` (`memory_figures.adopt_plans`) and
the default `auto` (`auto_plans`) measure the run's memory and plan each schedule the run takes from
those figures; where the figures cannot be had (a CPU run, engines that report no GPU memory) or the
plan is refused, `auto` keeps each role sleeping whole, as the first step did, and the log says why once.

A step is planned only where each of its works ran in an earlier step of the start, so that the
figures hold its peak (`begin_step`): the full step after `--num-critic-only-steps` of warm-up, whose
actor trains for the first time, runs with whole-role sleeps and measures, and the steps after it are
planned again with its figures. Where a later schedule's plan is refused (a phase grown past the room),
`auto` drops its plans and goes on with whole-role sleeps from that step on, as `--memory-plan whole`
would have run it, where `fit` stops before the step moves anything. docs/design.md, "The memory plan".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.ppo.loop.memory_figures import (
    MemoryFigures,
    adopt_plans,
    measured_figures,
    planned_roles,
    replan_if_grown,
    use_figures,
)
from tandem.ppo.loop.memory_plan import PlanError
from tandem.ppo.loop.memory_planner import plan_memory
from tandem.ppo.loop.out_of_memory import out_of_memory_note
from tandem.ppo.loop.schedule import Role, StepSchedule, Turn, Work

if TYPE_CHECKING:
    from tandem.ppo.loop.shared_gpus import SharedGpus

__all__ = ["StepPlans", "auto_plans", "begin_step"]

logger = logging.getLogger(__name__)


def auto_plans(
    gpus: SharedGpus, config: Any, run_dir: Path, schedule: StepSchedule
) -> tuple[MemoryFigures | None, str | None]:
    """`--memory-plan auto` after the first step: as `adopt_plans` where the run can plan, and `schedule` (the
    next step's) fits; else no plan, and why (the figures cannot be had: a CPU run, engines that report no
    GPU memory; or the plan is refused: the margin does not fit beside the models taking turns). Either
    is said once in the log; without a plan each role keeps sleeping whole, as the first step did."""
    try:
        figures = measured_figures(gpus, config)
        plan_memory(
            schedule,
            figures.model,
            figures.budget,
            planned_roles=planned_roles(schedule),
            prefetch=figures.prefetch,
        )
    except ValueError as exc:  # a PlanError too: the numbers of the turn that does not fit
        why = " ".join(str(exc).split())
        logger.info("memory plan (--memory-plan auto): none; each role keeps sleeping whole: %s", why)
        return None, why
    logger.info("memory plan (--memory-plan auto): planned from the first step's figures")
    use_figures(gpus, figures, run_dir)
    return figures, None


def begin_step(
    gpus: SharedGpus,
    schedule: StepSchedule,
    *,
    figures: MemoryFigures | None,
    ran: frozenset[tuple[Role, Work]],
    memory_plan: str,
    run_dir: Path,
) -> str | None:
    """The step about to run takes `schedule` (`SharedGpus.begin_step`: its plan, where the run plans); None,
    or under `--memory-plan auto` why its plan was refused.

    `figures`: the run's memory figures, where it plans; `ran`: the works its steps took so far in this
    start. A schedule with a work not in `ran` has no figure for that work's peak: its step runs with
    whole-role sleeps (`PlannedMoves.drop_plans`, every role back to the whole-role state the schedule
    starts from) and measures it, and the next step whose works all ran takes the plans again from the
    figures. A refused plan under `auto` drops the plans for the rest of the start (said once in the
    log); under `fit` its PlanError, with the numbers, stops the run before the step moves anything.
    """
    unmeasured = schedule.works() - ran
    if figures is not None and unmeasured:
        if gpus.planning is not None:
            logger.info(
                "memory plan: the step %r runs with whole-role sleeps: its %s ran in no step of this start "
                "before, so the plan has no figure for it; the steps after it are planned with its figures",
                schedule.describe(),
                ", ".join(sorted(f"{role}/{work}" for role, work in unmeasured)),
            )
            gpus.drop_plans(schedule)
    elif figures is not None and gpus.planning is None:  # the step after one that measured: planned again
        use_figures(gpus, figures, run_dir)
    try:
        gpus.begin_step(schedule)
    except PlanError as exc:
        if memory_plan != "auto":
            raise
        why = " ".join(str(exc).split())
        logger.warning(
            "memory plan (--memory-plan auto): the plan for %r is refused; each role sleeps whole from this "
            "step on, as under --memory-plan whole: %s",
            schedule.describe(),
            why,
        )
        gpus.drop_plans(schedule)
        gpus.begin_step(schedule)
        return why
    return None


class StepPlans:
    """One start's memory plan as its steps take it (`PPODriver.step`): `begin` before each step's turns,
    `end` after them, `note` for an out-of-memory error in one.

    `config`: the run's config as it is now (`memory_plan`, `may_plan_memory`, the capacity, margin and
    background wakes; read at each step: a bench's cells change the driver's between steps); `run_dir`:
    where RUN_DIR/memory_plan.json is kept.
    """

    def __init__(self, config: Callable[[], Any], run_dir: Path) -> None:
        self._config, self.run_dir = config, run_dir
        self.steps = 0
        """Steps taken since this start (the first runs the whole-role plan and measures the memory)."""
        self.ran: frozenset[tuple[Role, Work]] = frozenset()
        """The works this start's steps took (`StepSchedule.works`): a step with another runs whole and
        measures it (`begin_step`)."""
        self.figures: MemoryFigures | None = None
        """The memory plan's figures (`--memory-plan fit`, or `auto` where it plans), once measured."""
        self.none_because: str | None = None
        """Under `--memory-plan auto`, why the run took no plan after its first step (`auto_plans`), or dropped
        its plans at a later step whose plan was refused (`begin_step`); None before that step's end, or
        while it plans."""

    @property
    def config(self) -> Any:
        return self._config()

    def due(self, schedule: StepSchedule) -> bool:
        """Whether the memory plan is to be taken now, for a step of `schedule`: the run may plan
        (`may_plan_memory`), steps of this start have run and measured each of its works, and neither a
        plan nor (under `auto`) the reason for none is known."""
        return (
            self.config.may_plan_memory
            and self.steps > 0
            and schedule.works() <= self.ran
            and self.figures is None
            and self.none_because is None
        )

    def begin(self, gpus: SharedGpus, schedule: StepSchedule) -> None:
        """Before a step of `schedule`: the plan taken where it is due (from the first steps' own figures),
        then the step's (`begin_step`); a PlanError under `fit` names the numbers before anything moves."""
        if self.due(schedule):
            if self.config.memory_plan == "fit":
                self.figures = adopt_plans(gpus, self.config, self.run_dir)
            else:
                self.figures, self.none_because = auto_plans(gpus, self.config, self.run_dir, schedule)
        refused = begin_step(
            gpus,
            schedule,
            figures=self.figures,
            ran=self.ran,
            memory_plan=self.config.memory_plan,
            run_dir=self.run_dir,
        )
        if refused is not None:
            self.figures, self.none_because = None, refused

    def end(self, gpus: SharedGpus, schedule: StepSchedule) -> None:
        """After a step of `schedule`: its works known, and the next step's plan counts what it needed
        (`replan_if_grown`)."""
        self.steps += 1
        self.ran |= schedule.works()
        if self.figures is not None:
            self.figures = replan_if_grown(gpus, self.figures, self.run_dir)

    def note(self, gpus: SharedGpus, index: int, turn: Turn) -> str:
        """What an out-of-memory error in turn `index` of the step adds (`out_of_memory_note`)."""
        return out_of_memory_note(
            index,
            turn,
            plan=gpus.plan,
            figures=self.figures,
            memory_plan=self.config.memory_plan,
            measuring=self.config.may_plan_memory and self.none_because is None,
            offload_train=self.config.offload_train,
        )
