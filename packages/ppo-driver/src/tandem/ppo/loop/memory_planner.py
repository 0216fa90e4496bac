"""Choosing a step's memory plan: the fewest tags asleep at each turn that let it fit the GPU.

From a `MemoryModel` and a `GpuBudget` (the GPU's capacity less a stated margin),
`plan_memory` chooses at each turn the tags to have asleep (`memory_plan.MemoryPlan`):

- never a tag the turn itself touches (`turn_memory.turn_needs`);
- the fewest, in a fixed order (`eviction_key`): first what a sleep drops rather than copies
  (the engines' KV cache, gradients), then what the next turn does not touch, then by kind
  (`EVICTION_ORDER`: what costs nothing to drop, then optimizer moments before fp32 main
  parameters before weights), then what is used furthest ahead, the larger first: the
  shortest prefix of that order that lets the turn's peak fit. A worker splits its optimizer
  tags in pieces (`optimizer_pieces`: `optimizer_moments.0` …), so that prefix can end
  part-way through a kind: only the part a turn needs moves;
- the rest stays resident, but for a tag asleep on both sides of turns that do not touch
  it, which stays asleep through them (waking it there would move it twice for nothing);
- a train turn that does not fit even so keeps some of its role's optimizer state asleep
  through its forward and backward passes and wakes it for each optimizer step alone
  (`PlannedTurn.at_step`; the moments first, then the fp32 main parameters: `step_candidates`),
  the fewest that let it fit: the passes' activations and that state then never share the GPU.

With room for everything the plan moves nothing (`memory_plan.resident_plan`); with room for
each turn's own tags alone it sleeps everything else (`memory_plan.shared_plan`). Then three
passes, each within the budget:

- moves at once (`PlannedTurn.at_once`) where a turn's `handover_peaks` fit; otherwise the
  sleeps go first, so that no moment holds more than the turn after it;
- wakes in the background (`prefetch=True`, `PlannedTurn.prefetch`): a train role's wakes
  for a turn start a turn early where the turn before has room for them and the role does
  not compute in it, so its host-to-device copy runs beside that turn's work;
- kept caches (`MemoryPlan.keeps_cache`): a train role hands its allocator's cached blocks
  back after each turn it computes in, so that the next role's process can use them; where
  the plan has room for its cache at every turn (`RoleMemory.cache`), it keeps them, and its
  next phase allocates nothing anew, as in resident mode.

Pure: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

from tandem.megatron.choices import memory_tag_kind
from tandem.ppo.loop.memory_model import DROPPED_TAGS, EVICTION_ORDER, GpuBudget, MemoryModel, TagRef
from tandem.ppo.loop.memory_plan import (
    MemoryPlan,
    PlanError,
    PlannedTurn,
    counting_caches,
    handover_peaks,
    schedule_plan,
)
from tandem.ppo.loop.schedule import TRAIN_ROLES, Residents, Role, StepSchedule, residents_at_each_turn
from tandem.ppo.loop.turn_memory import role_idle, step_candidates, turn_peaks, turn_refusal, walk_schedule

__all__ = ["eviction_key", "plan_memory"]


def _next_use(walk: list[tuple[Residents, frozenset[TagRef]]], index: int, ref: TagRef) -> int:
    """Turns from `index` to the next that touches `ref` (cyclically: the next step's first turns follow)."""
    count = len(walk)
    for ahead in range(1, count + 1):
        if ref in walk[(index + ahead) % count][1]:
            return ahead
    return count + 1  # never touched in the step


def eviction_key(
    walk: list[tuple[Residents, frozenset[TagRef]]], index: int, ref: TagRef, memory: MemoryModel
) -> tuple[Any, ...]:
    """Where `ref` stands in turn `index`'s order of tags to sleep (smallest first): what a sleep drops rather
    than copies first (`DROPPED_TAGS`: the engines' KV cache, gradients), then untouched by the next turn,
    then by kind (`EVICTION_ORDER`), then the furthest next use, then the larger, then by name."""
    ahead = _next_use(walk, index, ref)
    kind = memory_tag_kind(ref[1])
    return (
        kind not in DROPPED_TAGS,
        ahead == 1,
        EVICTION_ORDER.index(kind),
        -ahead,
        -memory.nbytes(ref),
        ref,
    )


def plan_memory(
    schedule: StepSchedule,
    memory: MemoryModel,
    budget: GpuBudget,
    *,
    planned_roles: Collection[Role] | None = None,
    prefetch: bool = False,
) -> MemoryPlan:
    """The plan that sleeps, at each turn, the shortest prefix of `eviction_key`'s order that lets the turn fit,
    and keeps a tag asleep through turns that do not touch it between two turns that sleep it (waking it there
    would move it twice for nothing).

    `planned_roles`: the roles whose tags the plan chooses (None: every role); the others sleep as the
    schedule's wakes and sleeps say (`schedule_plan`), and their bytes count in every turn's peak.
    `prefetch`: bring a train role's wakes a turn forward, into the background of the turn before, where
    that turn has room for them (`PlannedTurn.prefetch`).

    PlanError, naming the turn and its numbers, when a turn does not fit even with every tag it does not
    touch asleep (before the step: nothing has moved).
    """
    walk = walk_schedule(schedule, memory)
    planned = set(memory.roles) if planned_roles is None else set(planned_roles)
    fixed = schedule_plan(schedule, memory)
    asleep: list[set[TagRef]] = []
    at_steps: list[frozenset[TagRef]] = []
    for index, (residents, needs) in enumerate(walk):
        candidates = sorted(
            (ref for ref in memory.tags() if ref not in needs and ref[0] in planned),
            key=lambda ref: eviction_key(walk, index, ref, memory),
        )
        chosen: set[TagRef] = {ref for ref in fixed.turns[index].asleep if ref[0] not in planned}
        peaks = turn_peaks(schedule, residents, frozenset(chosen), memory)
        for ref in candidates:
            gpus = schedule.gpus(ref[0])
            if peaks[gpus] <= budget.available:
                continue  # this tag's GPUs fit already: sleeping it frees nothing the turn lacks
            chosen.add(ref)
            peaks[gpus] -= memory.nbytes(ref)
        at_step: frozenset[TagRef] = frozenset()
        if any(peak > budget.available for peak in peaks.values()):
            at_step = _step_wakes(schedule, residents, frozenset(chosen), memory, budget, planned)
            chosen |= at_step
        why = turn_refusal(schedule, index, residents, frozenset(chosen), memory, budget, at_step=at_step)
        if why is not None:
            raise PlanError(f"{why}. Schedule: {schedule.describe()!r}")
        asleep.append(chosen)
        at_steps.append(at_step)
    _stay_asleep(walk, asleep, planned)
    turns = tuple(
        PlannedTurn(
            residents.turn,
            needs,
            frozenset(a),
            turn_peaks(schedule, residents, frozenset(a), memory, at_step=s),
            at_step=s,
        )
        for (residents, needs), a, s in zip(walk, asleep, at_steps, strict=True)
    )
    plan = MemoryPlan(schedule, turns, frozenset(planned))
    if prefetch:
        plan = _with_prefetches(plan, memory, budget)
    plan = _with_handovers(plan, memory, budget)
    return _keep_caches(plan, memory, budget)


def _step_wakes(
    schedule: StepSchedule,
    residents: Residents,
    asleep: frozenset[TagRef],
    memory: MemoryModel,
    budget: GpuBudget,
    planned: Collection[Role],
) -> frozenset[TagRef]:
    """The fewest of a train turn's `step_candidates` that, asleep through its passes and woken for its steps,
    let the turn fit with `asleep` asleep besides: the shortest prefix of their order; where none fits, all of
    them if that lowers the turn's peak (the refusal then names that figure), else none."""
    candidates = step_candidates(residents, memory, planned)
    chosen: list[TagRef] = []
    for ref in candidates:
        chosen.append(ref)
        trial = frozenset(chosen)
        peaks = turn_peaks(schedule, residents, asleep | trial, memory, at_step=trial)
        if all(peak <= budget.available for peak in peaks.values()):
            return trial
    if not chosen:
        return frozenset()
    before = max(turn_peaks(schedule, residents, asleep, memory).values())
    every = frozenset(chosen)
    after = max(turn_peaks(schedule, residents, asleep | every, memory, at_step=every).values())
    return every if after < before else frozenset()


def _with_prefetches(plan: MemoryPlan, memory: MemoryModel, budget: GpuBudget) -> MemoryPlan:
    """`plan` with its train roles' copied wakes in the background (`PlannedTurn.prefetch`): each turn's wakes
    of planned train roles that do not compute in the turn before are brought into it (the largest first,
    each where that turn's peak stays within `budget`; a tag that turn put to sleep stays awake instead: no
    move at all), and every copied wake entering a turn that neither touches the tag nor computes with its
    role runs in that turn's background. A dropped tag (`DROPPED_TAGS`) wakes at no cost, as its turn is
    entered."""
    turns = list(plan.turns)
    count = len(turns)
    if count < 2:
        return plan
    steps = residents_at_each_turn(plan.schedule)
    planned = plan.planned_roles
    for later in range(count):
        index = (later - 1) % count
        turn = turns[index]
        wakes = sorted(  # copied tags only (a dropped one wakes at no cost), the largest first
            (
                ref
                for ref in turn.asleep - turns[later].asleep
                if ref[0] in TRAIN_ROLES
                and (planned is None or ref[0] in planned)
                and role_idle(ref[0], steps[index], turn.needs)
                and memory_tag_kind(ref[1]) not in DROPPED_TAGS
                and ref not in turn.at_step
            ),
            key=lambda ref: (-memory.nbytes(ref), ref),
        )
        asleep = set(turn.asleep)
        for ref in wakes:
            trial = frozenset(asleep - {ref})
            peaks = turn_peaks(plan.schedule, steps[index], trial, memory, at_step=turn.at_step)
            if all(peak <= budget.available for peak in peaks.values()):
                asleep.discard(ref)
        turns[index] = replace(
            turn,
            asleep=frozenset(asleep),
            peaks=turn_peaks(plan.schedule, steps[index], frozenset(asleep), memory, at_step=turn.at_step),
        )
    # Every copied tag of a train role that wakes entering a turn which neither touches it nor computes with
    # its role wakes in the background of that turn (the plan's own early wakes, and those brought forward).
    for index, turn in enumerate(turns):
        woken = turns[index - 1].asleep - turn.asleep
        turns[index] = replace(
            turn,
            prefetch=frozenset(
                ref
                for ref in woken
                if ref[0] in TRAIN_ROLES
                and (planned is None or ref[0] in planned)
                and role_idle(ref[0], steps[index], turn.needs)
                and memory_tag_kind(ref[1]) not in DROPPED_TAGS
            ),
        )
    return replace(plan, turns=tuple(turns))


def _with_handovers(plan: MemoryPlan, memory: MemoryModel, budget: GpuBudget) -> MemoryPlan:
    """`plan` with each turn's `handover_peaks`, and its moves at once where they fit `budget`."""
    turns = []
    for index, turn in enumerate(plan.turns):
        handover = handover_peaks(plan, index, memory)
        fits = all(peak <= budget.available for peak in handover.values())
        turns.append(replace(turn, at_once=fits, handover=handover))
    return replace(plan, turns=tuple(turns))


def _keep_caches(plan: MemoryPlan, memory: MemoryModel, budget: GpuBudget) -> MemoryPlan:
    """`plan` with the planned train roles that may keep their allocator's cache (`MemoryPlan.keeps_cache`),
    the smallest cache first (then by name), but a role whose optimizer state wakes for its steps alone at some
    turn (`PlannedTurn.at_step`: its cache would hold that state as well): each role whose cache, counted at every turn, leaves every turn's peak and every
    handover the plan makes at once within `budget`; the turns' peaks and handovers then count the caches.
    The tags asleep and the moves at once stay the plan's."""
    roles = plan.planned_roles if plan.planned_roles is not None else frozenset(memory.roles)
    woken_at_step = {
        role for t in plan.turns for role, _ in t.at_step
    }  # their cache would hold that state too
    candidates = sorted(
        (r for r in roles if r in TRAIN_ROLES and r in memory.roles and r not in woken_at_step),
        key=lambda r: (memory.kept_cache(r), r),
    )
    kept: frozenset[Role] = frozenset()
    for role in candidates:
        trial = counting_caches(replace(plan, keeps_cache=kept | {role}), memory)
        if _fits(trial, budget):
            kept, plan = trial.keeps_cache, trial
    return plan


def _fits(plan: MemoryPlan, budget: GpuBudget) -> bool:
    """Whether every turn's peak, and every handover made at once, is within `budget`."""
    return all(
        peak <= budget.available
        for t in plan.turns
        for peak in (*t.peaks.values(), *(t.handover.values() if t.at_once else ()))
    )


def _stay_asleep(
    walk: list[tuple[Residents, frozenset[TagRef]]], asleep: list[set[TagRef]], planned: Collection[Role]
) -> None:
    """Fill each run of turns (cyclically) in which a planned role's tag is awake between two in which it
    sleeps, where no turn of the run touches it. It only adds sleepers, so every turn still fits, and no turn
    sleeps what it needs."""
    count = len(walk)
    for ref in {r for r in set().union(*asleep) if r[0] in planned}:
        sleeping = [ref in a for a in asleep]
        for start in range(count):
            if not sleeping[start] or sleeping[(start + 1) % count]:
                continue
            run, at = [], (start + 1) % count
            while not sleeping[at]:
                run.append(at)
                at = (at + 1) % count
            if not any(ref in walk[k][1] for k in run):
                for k in run:
                    asleep[k].add(ref)
