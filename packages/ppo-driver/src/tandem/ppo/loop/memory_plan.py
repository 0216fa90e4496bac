"""The step's memory plan: which memory tags sleep at each turn of the schedule, the peaks it gives, and its check.

Today's shared mode puts whole roles to sleep at each turn (`schedule.Turn`'s wake and
sleep); resident mode moves nothing. A plan sits between them: a `MemoryPlan` says, at
each turn of one step, which tags of a `MemoryModel` (per role and memory tag, the bytes
it holds on one GPU; per phase, its transient peak above them) are asleep. This module
holds what a plan is and what it costs; `memory_planner.plan_memory` chooses one.

- what one turn touches and holds with some tags asleep: `turn_memory` (`turn_needs`,
  `turn_peaks`);
- `handover_peaks`: the most a turn's entry holds when its sleeps and wakes run at once
  (`PlannedTurn.at_once`), one role's copy to the host beside another's copy back: what
  the turn before holds once its train role has handed its cached blocks back, and what
  wakes for this turn;
- the fixed plans: `resident_plan` (nothing moves; every train role keeps its allocator's
  cache, `MemoryPlan.keeps_cache`), `shared_plan` (everything a turn does not touch sleeps:
  shared mode by tag) and `schedule_plan` (today's, from the schedule's wakes and sleeps);
  `capacity_range`, the least and the most memory a plan can use.

`check_plan` replays a plan (a computed one or a fixed one) and refuses one whose peak at
some turn passes the budget, that sleeps what a turn touches, or that wakes in the
background what it may not, with the numbers, before the step runs. Pure: no Ray, no
torch. It lives beside the schedule, not in tandem.lifecycle: which tags a turn touches is
the PPO step's knowledge, and when to sleep is the driver's plan, not the lifecycle's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace

from tandem.megatron.choices import memory_tag_kind
from tandem.ppo.loop.memory_model import (
    STEP_KINDS,
    GpuBudget,
    MemoryModel,
    TagRef,
    format_bytes,
)
from tandem.ppo.loop.schedule import TRAIN_ROLES, Residents, Role, StepSchedule, Turn, residents_at_each_turn
from tandem.ppo.loop.turn_memory import (
    role_idle,
    step_candidates,
    turn_peaks,
    turn_refusal,
    walk_schedule,
)

__all__ = [
    "MemoryPlan",
    "PlanError",
    "PlannedTurn",
    "capacity_range",
    "check_plan",
    "counting_caches",
    "handover_peaks",
    "resident_plan",
    "schedule_plan",
    "shared_plan",
]


class PlanError(ValueError):
    """A memory plan that does not fit the GPU at some turn, or sleeps what a turn touches."""


@dataclass(frozen=True)
class PlannedTurn:
    """One turn of the plan: the tags it touches (`needs`), those asleep while it works, and its peak on
    each set of GPUs (`StepSchedule.gpus`)."""

    turn: Turn
    needs: frozenset[TagRef]
    asleep: frozenset[TagRef]
    peaks: Mapping[str, int]
    at_once: bool = field(default=False, compare=False)
    """The sleeps and wakes that enter this turn may run at once (`handover_peaks` fits the budget);
    `plan_memory` decides it, a fixed plan never has it. Two plans are equal when they sleep the same tags
    at each turn, however they move them."""
    handover: Mapping[str, int] = field(default_factory=dict, compare=False)
    """`handover_peaks` for this turn, where `plan_memory` made it (empty for a fixed plan)."""
    at_step: frozenset[TagRef] = frozenset()
    """Tags of the turn's train role, among those `asleep`, that wake for each of its optimizer steps alone and
    sleep again after it (`STEP_KINDS`: the optimizer's state, which only the step reads): the train's passes
    run without them, its steps with them and without the passes' activations (`MemoryModel.train_splits`).
    The turn's peak is the larger of the two. `plan_memory` uses it only for a train that fits no other
    way."""
    prefetch: frozenset[TagRef] = field(default=frozenset(), compare=False)
    """Tags that wake entering this turn in the background: a train role that does not compute in it
    wakes them while the turn works, for the next turn, which needs them (`plan_memory(prefetch=True)`
    brings a wake forward so where this turn has room for it). They are awake in `asleep`'s sense here,
    counted in this turn's peak, and waited for as the next turn is entered."""


@dataclass(frozen=True)
class MemoryPlan:
    """The tags asleep at each turn of one step. The step repeats, so the state before the first turn is
    the one after the last (`moves(0)` goes from the last turn's state)."""

    schedule: StepSchedule
    turns: tuple[PlannedTurn, ...]
    planned_roles: frozenset[Role] | None = field(default=None, compare=False)
    """The roles whose tags the plan chose (`plan_memory`'s); None: every role's. The others wake and sleep
    whole, as the schedule says. Two plans are equal when they sleep the same tags at each turn."""
    keeps_cache: frozenset[Role] = field(default=frozenset(), compare=False)
    """The train roles that keep their allocator's cache after their work (no `empty_cache`), where the plan has
    room for it at every turn (`RoleMemory.cache` counted at each, `plan_memory`'s choice): the next phase
    of theirs then allocates nothing anew, as in resident mode. The others hand it back after each turn
    they compute in, and the plan counts only their transients."""

    def moves(self, index: int) -> tuple[frozenset[TagRef], frozenset[TagRef]]:
        """What goes to sleep and what wakes before turn `index` (sleeps first, so the peak never passes
        the turn's own)."""
        before = self.turns[index - 1].asleep
        now = self.turns[index].asleep
        return now - before, before - now

    def moved(self) -> frozenset[TagRef]:
        """The tags asleep at some turn; the rest stay resident for the whole step."""
        return frozenset().union(*(t.asleep for t in self.turns))

    def together(self, index: int) -> bool:
        """Whether entering turn `index` moves tags of two planned train roles, and may move them at once (the
        engines' moves, where the plan chooses them, go one after the other)."""
        sleep, wake = self.moves(index)
        planned = self.planned_roles
        moved = sleep | (wake - self.turns[index].prefetch)
        roles = {role for role, _ in moved if role in TRAIN_ROLES and (planned is None or role in planned)}
        return self.turns[index].at_once and len(roles) > 1

    def describe(self) -> str:
        """One line a turn: "critic: wake, train, sleep | asleep actor/optimizer, engine/kv_cache | peak 10.0 GiB"
        (MiB below a GiB)."""
        lines: list[str] = []
        for t in self.turns:
            asleep = ", ".join(f"{r}/{g}" for r, g in sorted(t.asleep)) or "nothing"
            at_once = " | moves at once" if self.together(len(lines)) else ""
            background = ", ".join(f"{r}/{g}" for r, g in sorted(t.prefetch))
            prefetch = f" | wakes in the background {background}" if background else ""
            if t.at_step:
                prefetch += (
                    f" | wakes for the optimizer step {', '.join(f'{r}/{g}' for r, g in sorted(t.at_step))}"
                )
            lines.append(
                f"{t.turn.describe()} | asleep {asleep} | peak {format_bytes(max(t.peaks.values(), default=0))}"
                f"{at_once}{prefetch}"
            )
        if self.keeps_cache:
            lines.append(f"caches kept: {', '.join(sorted(self.keeps_cache))}")
        return "\n".join(lines)


def handover_peaks(plan: MemoryPlan, index: int, memory: MemoryModel) -> dict[str, int]:
    """The most each set of GPUs holds while turn `index` is entered with its sleeps and wakes at once: what
    the turn before holds (what sleeps is still there; a train role that computed in it hands its cached
    blocks back first, other roles still computing keep their transients) and every tag of the planned
    roles that wakes for this one. The other roles wake as a whole after (the turn's own wake), once the
    moves are done."""
    schedule = plan.schedule
    before = residents_at_each_turn(schedule)[index - 1]
    role = before.turn.role
    handed_back = role if role in TRAIN_ROLES and role not in plan.keeps_cache else None
    peaks = turn_peaks(
        schedule,
        before,
        plan.turns[index - 1].asleep,
        memory,
        handed_back=handed_back,
        cached=plan.keeps_cache,
        at_step=plan.turns[index - 1].at_step,
    )
    for role, tag in plan.moves(index)[1] - plan.turns[index].prefetch:  # the background wakes come after
        if plan.planned_roles is None or role in plan.planned_roles:
            gpus = schedule.gpus(role)
            peaks[gpus] = peaks.get(gpus, 0) + memory.nbytes((role, tag))
    return peaks


def counting_caches(plan: MemoryPlan, memory: MemoryModel) -> MemoryPlan:
    """`plan`'s turns' peaks and handovers recounted with its `keeps_cache`."""
    steps = residents_at_each_turn(plan.schedule)
    turns = tuple(
        replace(
            t,
            peaks=turn_peaks(
                plan.schedule, steps[i], t.asleep, memory, cached=plan.keeps_cache, at_step=t.at_step
            ),
            handover=handover_peaks(plan, i, memory),
        )
        for i, t in enumerate(plan.turns)
    )
    return replace(plan, turns=turns)


def check_plan(plan: MemoryPlan, memory: MemoryModel, budget: GpuBudget) -> MemoryPlan:
    """`plan` once every turn's peak fits `budget` and no turn sleeps a tag it touches; PlanError with the
    numbers (which turn, which phase, bytes needed and available, what is asleep) otherwise."""
    walk = walk_schedule(plan.schedule, memory)
    if len(walk) != len(plan.turns):
        raise PlanError(f"the plan has {len(plan.turns)} turns, its schedule {len(walk)}")
    for index, ((residents, needs), planned) in enumerate(zip(walk, plan.turns, strict=True)):
        unknown = sorted(planned.asleep - set(memory.tags()))
        if unknown:
            raise PlanError(
                f"turn {index} ({residents.turn.describe()!r}) sleeps {unknown}, which the model lacks"
            )
        wrong_step = sorted(
            ref
            for ref in planned.at_step
            if ref[0] in plan.keeps_cache
            or ref not in planned.asleep
            or ref[0] != residents.turn.role
            or residents.turn.work != "train"
            or memory_tag_kind(ref[1]) not in STEP_KINDS
            or ref[0] not in memory.train_splits
        )
        if wrong_step:
            raise PlanError(
                f"turn {index} ({residents.turn.describe()!r}) wakes {wrong_step} for its optimizer steps alone, "
                f"which are not asleep there, or not of the state ({', '.join(STEP_KINDS)}) of the role that "
                "trains in it, or whose role's passes and step were not measured apart (train_splits), or whose "
                "role keeps its allocator's cache (keeps_cache)"
            )
        clash = sorted((planned.asleep - planned.at_step) & needs)
        if clash:
            raise PlanError(f"turn {index} ({residents.turn.describe()!r}) sleeps {clash}, which it touches")
        wrong = sorted(
            ref
            for ref in planned.prefetch
            if ref not in plan.moves(index)[1]
            or ref[0] not in TRAIN_ROLES
            or not role_idle(ref[0], residents, needs)
        )
        if wrong:
            raise PlanError(
                f"turn {index} ({residents.turn.describe()!r}) wakes {wrong} in the background, which are not "
                "a train role's wakes entering it, or whose role computes in it or has tags it touches"
            )
        why = turn_refusal(
            plan.schedule, index, residents, planned.asleep, memory, budget, plan.keeps_cache, planned.at_step
        )
        if why is not None:
            raise PlanError(why)
    for index, planned in enumerate(plan.turns):  # after every turn's own peak: a handover holds more
        handover = handover_peaks(plan, index, memory) if planned.at_once else {}
        over = [(gpus, peak) for gpus, peak in sorted(handover.items()) if peak > budget.available]
        if over:
            gpus, peak = over[0]
            raise PlanError(
                f"turn {index} ({planned.turn.describe()!r}) entered with its sleeps and wakes at once needs "
                f"{peak} bytes ({peak / 2**30:.2f} GiB) on the {gpus} GPUs (the turn before's peak and what "
                f"wakes); {budget.available} bytes ({budget.available / 2**30:.2f} GiB) available. Plan it for "
                "this budget, or move them one after the other (at_once=False)"
            )
    return plan


def resident_plan(schedule: StepSchedule, memory: MemoryModel) -> MemoryPlan:
    """The plan that moves nothing (resident mode): every train role keeps its allocator's cache."""
    plan = _fixed_plan(schedule, memory, lambda residents, needs: frozenset())
    kept = frozenset(r for r in TRAIN_ROLES if r in memory.roles)
    return counting_caches(replace(plan, keeps_cache=kept), memory)


def shared_plan(schedule: StepSchedule, memory: MemoryModel) -> MemoryPlan:
    """The plan that moves everything: at each turn, every tag the turn does not touch asleep (today's shared
    mode, by tag); the least any plan holds at each turn."""
    every = frozenset(memory.tags())
    return _fixed_plan(schedule, memory, lambda residents, needs: every - needs)


def schedule_plan(schedule: StepSchedule, memory: MemoryModel) -> MemoryPlan:
    """Today's plan, from the schedule's wakes and sleeps: every tag of a role asleep while the role is, but for
    what a turn touches (a weight sync brings an asleep actor's weights back for its length). A role without a
    turn in the schedule, the actor of a critic-only warm-up, is counted resident."""
    roles = {t.role for t in schedule.turns}

    def asleep(residents: Residents, needs: frozenset[TagRef]) -> frozenset[TagRef]:
        return frozenset(r for r in memory.tags() if r[0] in roles and r[0] not in residents.awake) - needs

    return _fixed_plan(schedule, memory, asleep)


def capacity_range(
    schedule: StepSchedule, memory: MemoryModel, *, planned_roles: Collection[Role] | None = None
) -> tuple[int, int]:
    """The bytes a GPU needs, less its margin, for `plan_memory` to fit: (the least, with every tag of the
    planned roles that a turn does not touch asleep, their caches handed back and each train's optimizer state
    woken for its steps alone where the model has its `train_splits`; the most it can use, with
    none of them asleep and every planned train role's cache kept). The other roles sleep as the schedule
    says at both ends."""
    planned = set(memory.roles) if planned_roles is None else set(planned_roles)
    whole, every = schedule_plan(schedule, memory), shared_plan(schedule, memory)

    def worst(
        keep_planned: Callable[[PlannedTurn, PlannedTurn], frozenset[TagRef]], cached: Collection[Role] = ()
    ) -> int:
        def asleep(index: int) -> frozenset[TagRef]:
            others = frozenset(r for r in whole.turns[index].asleep if r[0] not in planned)
            return others | keep_planned(whole.turns[index], every.turns[index])

        steps = residents_at_each_turn(schedule)
        return max(
            max(turn_peaks(schedule, r, asleep(i), memory, cached=cached).values())
            for i, r in enumerate(steps)
        )

    def least_with_step_wakes() -> int:
        # Every tag of the planned roles a turn does not touch asleep, and a train's optimizer state woken
        # for its steps alone where that lowers its peak (`PlannedTurn.at_step`).
        worst_peak = 0
        for index, residents in enumerate(residents_at_each_turn(schedule)):
            others = frozenset(r for r in whole.turns[index].asleep if r[0] not in planned)
            asleep = others | frozenset(r for r in every.turns[index].asleep if r[0] in planned)
            peak = max(turn_peaks(schedule, residents, asleep, memory).values())
            at_step = frozenset(step_candidates(residents, memory, planned))
            if at_step:
                woken = max(
                    turn_peaks(schedule, residents, asleep | at_step, memory, at_step=at_step).values()
                )
                peak = min(peak, woken)
            worst_peak = max(worst_peak, peak)
        return worst_peak

    least = least_with_step_wakes()
    most = worst(lambda w, e: frozenset(), [r for r in TRAIN_ROLES if r in planned and r in memory.roles])
    return least, most


def _fixed_plan(
    schedule: StepSchedule,
    memory: MemoryModel,
    asleep_at: Callable[[Residents, frozenset[TagRef]], frozenset[TagRef]],
) -> MemoryPlan:
    turns = []
    for residents, needs in walk_schedule(schedule, memory):
        asleep = asleep_at(residents, needs)
        turns.append(
            PlannedTurn(residents.turn, needs, asleep, turn_peaks(schedule, residents, asleep, memory))
        )
    return MemoryPlan(schedule, tuple(turns))
