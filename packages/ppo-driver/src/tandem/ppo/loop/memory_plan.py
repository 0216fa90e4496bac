"""The step's memory plan: which memory tags sleep at each turn of the schedule, and the check that it fits.

Today's shared mode puts whole roles to sleep at each turn (`schedule.Turn`'s wake and
sleep); resident mode moves nothing. The plan sits between them: from a `MemoryModel`
(per role and memory tag, the bytes it holds on one GPU; per phase, its transient peak
above them) and a `GpuBudget` (the GPU's capacity less a stated margin), `plan_memory`
chooses at each turn the tags to have asleep:

- never a tag the turn itself touches (`turn_needs`: a train touches its model's every
  tag, the actor's log-probs its weights alone, the engines their weights and KV cache,
  a weight sync the engines' memory and the actor's weights);
- the fewest, in a fixed order (`eviction_key`): first what the next turn does not touch,
  then by kind (`EVICTION_ORDER`: what costs nothing to drop, then optimizer moments
  before fp32 main parameters before weights), then what is used furthest ahead, the
  larger first: the shortest prefix of that order that lets the turn's peak fit;
- the rest stays resident, but for a tag asleep on both sides of turns that do not touch it,
  which stays asleep through them (waking it there would move it twice for nothing). With room for everything the plan moves nothing (resident
  mode); with room for each turn's own tags alone it sleeps everything else (shared
  mode, by tag).

`check_plan` replays a plan (a computed one, or today's from the schedule's wakes and
sleeps, `schedule_plan`) and refuses one whose peak at some turn passes the budget, or
that sleeps what a turn touches, with the numbers, before the step runs. Pure: no Ray,
no torch. It lives beside the schedule, not in tandem.lifecycle: which tags a turn touches
is the PPO step's knowledge, and when to sleep is the driver's plan, not the lifecycle's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from tandem.ppo.loop.schedule import Residents, Role, StepSchedule, Turn, Work, residents_at_each_turn

__all__ = [
    "EVICTION_ORDER",
    "GpuBudget",
    "MemoryModel",
    "MemoryPlan",
    "PlanError",
    "PlannedTurn",
    "RoleMemory",
    "TagRef",
    "check_plan",
    "eviction_key",
    "plan_memory",
    "resident_plan",
    "schedule_plan",
    "shared_plan",
    "turn_needs",
]

TagRef = tuple[Role, str]
"""One memory tag of one role: ("actor", "optimizer")."""

EVICTION_ORDER: tuple[str, ...] = (
    "grads",
    "kv_cache",
    "optimizer_moments",
    "main_params",
    "optimizer",
    "base",
    "weights",
)
"""The memory tags a role may have, in the order the plan puts them to sleep among tags that are equally far
from their next use. Gradients (zeroed before every minibatch) and the engines' KV cache (empty between
rollouts) are dropped, not copied; then the optimizer's moments, its fp32 main parameters, the two together
(`optimizer`, one tag today), a LoRA model's frozen base (copied to the host once, so it only comes back), and
the weights last (issue 43's order)."""

WEIGHT_TAGS: frozenset[str] = frozenset({"base", "weights"})
"""The tags a forward pass reads (the actor's log-probs, a weight export)."""


class PlanError(ValueError):
    """A memory plan that does not fit the GPU at some turn, or sleeps what a turn touches."""


@dataclass(frozen=True)
class RoleMemory:
    """What one role holds on one GPU, in bytes (each figure the largest over the role's ranks).

    Attributes:
        tags: bytes per memory tag (`EVICTION_ORDER`'s names), the part a sleep can hand back: a train
            worker's `state_nbytes()`, an engine's weights and `kv_cache`.
        fixed: bytes that stay while the role sleeps (CUDA context, communicators, the allocator's cache).
    """

    tags: Mapping[str, int]
    fixed: int = 0

    def __post_init__(self) -> None:
        for tag, nbytes in self.tags.items():
            if tag not in EVICTION_ORDER:
                raise ValueError(f"memory tag {tag!r}: choose among {list(EVICTION_ORDER)}")
            if nbytes < 0:
                raise ValueError(f"memory tag {tag!r}: {nbytes} bytes; give a count of bytes >= 0")
        if self.fixed < 0:
            raise ValueError(f"fixed={self.fixed}: give a count of bytes >= 0")

    @classmethod
    def from_ranks(cls, per_rank: Iterable[Mapping[str, int]], fixed: int = 0) -> RoleMemory:
        """A role's figures from each rank's report (a train worker's `state_nbytes()`), the largest of each tag."""
        tags: dict[str, int] = {}
        for report in per_rank:
            for tag, nbytes in report.items():
                tags[tag] = max(tags.get(tag, 0), int(nbytes))
        return cls(tags, fixed)


@dataclass(frozen=True)
class MemoryModel:
    """The memory of one step on one GPU: each role's tags, and each phase's transient peak.

    Attributes:
        roles: each role's `RoleMemory`.
        phases: bytes a phase allocates above the resident tags while it runs (activations, logits, a
            weight sync's buckets), by (role, work): the allocator's peak in the phase less what was
            allocated when it began. The async loop's background generation holds its `start_next`
            figure until `await_next`.
    """

    roles: Mapping[Role, RoleMemory]
    phases: Mapping[tuple[Role, Work], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for (role, work), nbytes in self.phases.items():
            if nbytes < 0:
                raise ValueError(f"phases[{role}/{work}]: {nbytes} bytes; give a count of bytes >= 0")

    def nbytes(self, ref: TagRef) -> int:
        """Bytes of one tag."""
        return self.roles[ref[0]].tags[ref[1]]

    def tags(self) -> list[TagRef]:
        """Every (role, tag) of the model."""
        return [(role, tag) for role, memory in self.roles.items() for tag in memory.tags]

    def transient(self, role: Role, work: Work | None) -> int:
        """The phase's transient bytes; ValueError naming the phase when the model lacks its figure."""
        if work is None:
            return 0
        key: tuple[Role, Work] = (role, "start_next" if work == "await_next" else work)
        if key not in self.phases:
            raise ValueError(f"phases: no figure for {key[0]}/{key[1]}; measure its peak in the first step")
        return self.phases[key]

    def to_dict(self) -> dict[str, Any]:
        """The model as JSON-ready data (`from_dict` reads it back)."""
        return {
            "roles": {role: {"tags": dict(m.tags), "fixed": m.fixed} for role, m in self.roles.items()},
            "phases": {f"{role}/{work}": nbytes for (role, work), nbytes in self.phases.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryModel:
        """The model from `to_dict`'s data: {"roles": {role: {"tags": {...}, "fixed": n}}, "phases": {"role/work": n}}."""
        roles: dict[Role, RoleMemory] = {}
        for role, entry in data.get("roles", {}).items():
            roles[_role(role)] = RoleMemory(dict(entry.get("tags", {})), int(entry.get("fixed", 0)))
        phases: dict[tuple[Role, Work], int] = {}
        for key, nbytes in data.get("phases", {}).items():
            role, _, work = key.partition("/")
            if work not in get_args(Work):
                raise ValueError(
                    f"phases[{key!r}]: name a phase as role/work, the work one of {get_args(Work)}"
                )
            phases[(_role(role), work)] = int(nbytes)
        return cls(roles, phases)


def _role(name: str) -> Role:
    if name not in get_args(Role):
        raise ValueError(f"role {name!r}: choose among {get_args(Role)}")
    return name  # type: ignore[return-value]


@dataclass(frozen=True)
class GpuBudget:
    """What a turn may use on one GPU: `capacity` bytes less a `margin` kept free (fragmentation, the
    allocator's rounding, what the figures missed)."""

    capacity: int
    margin: int = 0

    def __post_init__(self) -> None:
        if self.capacity <= 0 or self.margin < 0 or self.margin >= self.capacity:
            raise ValueError(
                f"capacity={self.capacity}, margin={self.margin}: give a capacity > 0 and 0 <= margin < capacity"
            )

    @property
    def available(self) -> int:
        """Bytes a turn's peak may reach."""
        return self.capacity - self.margin


@dataclass(frozen=True)
class PlannedTurn:
    """One turn of the plan: the tags it touches (`needs`), those asleep while it works, and its peak on
    each set of GPUs (`StepSchedule.gpus`)."""

    turn: Turn
    needs: frozenset[TagRef]
    asleep: frozenset[TagRef]
    peaks: Mapping[str, int]


@dataclass(frozen=True)
class MemoryPlan:
    """The tags asleep at each turn of one step. The step repeats, so the state before the first turn is
    the one after the last (`moves(0)` goes from the last turn's state)."""

    schedule: StepSchedule
    turns: tuple[PlannedTurn, ...]

    def moves(self, index: int) -> tuple[frozenset[TagRef], frozenset[TagRef]]:
        """What goes to sleep and what wakes before turn `index` (sleeps first, so the peak never passes
        the turn's own)."""
        before = self.turns[index - 1].asleep
        now = self.turns[index].asleep
        return now - before, before - now

    def moved(self) -> frozenset[TagRef]:
        """The tags asleep at some turn; the rest stay resident for the whole step."""
        return frozenset().union(*(t.asleep for t in self.turns))

    def describe(self) -> str:
        """One line a turn: "critic: wake, train, sleep | asleep actor/optimizer, engine/kv_cache | peak 10.0 GiB"."""
        lines = []
        for t in self.turns:
            asleep = ", ".join(f"{r}/{g}" for r, g in sorted(t.asleep)) or "nothing"
            peak = max(t.peaks.values(), default=0) / 2**30
            lines.append(f"{t.turn.describe()} | asleep {asleep} | peak {peak:.1f} GiB")
        return "\n".join(lines)


def turn_needs(residents: Residents, memory: MemoryModel) -> frozenset[TagRef]:
    """The tags a turn touches: those of every role computing in it (the async loop's background generation
    included), the actor's weights alone for its log-probs, and the actor's weights for a weight sync."""
    turn = residents.turn
    roles = set(residents.computing)
    if turn.wake_before and turn.work is None:
        roles.add(turn.role)  # a lifecycle-only wake (a warm-up's engines): the role comes back whole
    needs = {(r, tag) for r in roles if r in memory.roles for tag in memory.roles[r].tags}
    if turn.role == "actor" and turn.work == "log_probs":
        needs = {(r, tag) for r, tag in needs if r != "actor" or tag in WEIGHT_TAGS}
    if turn.work == "weights" and "actor" in memory.roles:
        needs |= {("actor", tag) for tag in memory.roles["actor"].tags if tag in WEIGHT_TAGS}
    return frozenset(needs)


def _peaks(
    schedule: StepSchedule, residents: Residents, asleep: frozenset[TagRef], memory: MemoryModel
) -> dict[str, int]:
    peaks: dict[str, int] = {}
    for role, held in memory.roles.items():
        resident = held.fixed + sum(n for tag, n in held.tags.items() if (role, tag) not in asleep)
        if role in residents.computing:
            work = residents.turn.work if role == residents.turn.role else "start_next"
            resident += memory.transient(role, work)
        gpus = schedule.gpus(role)
        peaks[gpus] = peaks.get(gpus, 0) + resident
    return peaks


def _walk(schedule: StepSchedule, memory: MemoryModel) -> list[tuple[Residents, frozenset[TagRef]]]:
    missing = sorted({t.role for t in schedule.turns} - set(memory.roles))
    if missing:
        raise ValueError(f"memory model: no figures for {missing}, which the schedule's turns use")
    steps = residents_at_each_turn(schedule)
    return [(r, turn_needs(r, memory)) for r in steps]


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
    """Where `ref` stands in turn `index`'s order of tags to sleep (smallest first): untouched by the next
    turn first, then by kind (`EVICTION_ORDER`), then the furthest next use, then the larger, then by name."""
    ahead = _next_use(walk, index, ref)
    return (ahead == 1, EVICTION_ORDER.index(ref[1]), -ahead, -memory.nbytes(ref), ref)


def _refusal(
    schedule: StepSchedule, index: int, peaks: Mapping[str, int], asleep: frozenset[TagRef], budget: GpuBudget
) -> str | None:
    turn = schedule.turns[index]
    for gpus, peak in sorted(peaks.items()):
        if peak > budget.available:
            names = ", ".join(f"{r}/{g}" for r, g in sorted(asleep)) or "nothing"
            return (
                f"turn {index} ({turn.describe()!r}, phase {turn.role}/{turn.work}) on the {gpus} GPUs needs "
                f"{peak} bytes ({peak / 2**30:.2f} GiB) with {names} asleep; {budget.available} bytes "
                f"({budget.available / 2**30:.2f} GiB) available: capacity {budget.capacity} less margin "
                f"{budget.margin}. Give the GPU more room (a larger capacity, a smaller margin) or the turn less "
                "to hold (smaller micro-batches, a shorter KV cache)"
            )
    return None


def plan_memory(schedule: StepSchedule, memory: MemoryModel, budget: GpuBudget) -> MemoryPlan:
    """The plan that sleeps, at each turn, the shortest prefix of `eviction_key`'s order that lets the turn fit,
    and keeps a tag asleep through turns that do not touch it between two turns that sleep it (waking it there
    would move it twice for nothing).

    PlanError, naming the turn and its numbers, when a turn does not fit even with every tag it does not
    touch asleep (before the step: nothing has moved).
    """
    walk = _walk(schedule, memory)
    asleep: list[set[TagRef]] = []
    for index, (residents, needs) in enumerate(walk):
        candidates = sorted(
            (ref for ref in memory.tags() if ref not in needs),
            key=lambda ref: eviction_key(walk, index, ref, memory),
        )
        chosen: set[TagRef] = set()
        peaks = _peaks(schedule, residents, frozenset(), memory)
        for ref in candidates:
            gpus = schedule.gpus(ref[0])
            if peaks[gpus] <= budget.available:
                continue  # this tag's GPUs fit already: sleeping it frees nothing the turn lacks
            chosen.add(ref)
            peaks[gpus] -= memory.nbytes(ref)
        why = _refusal(schedule, index, peaks, frozenset(chosen), budget)
        if why is not None:
            raise PlanError(f"{why}. Schedule: {schedule.describe()!r}")
        asleep.append(chosen)
    _stay_asleep(walk, asleep)
    turns = tuple(
        PlannedTurn(residents.turn, needs, frozenset(a), _peaks(schedule, residents, frozenset(a), memory))
        for (residents, needs), a in zip(walk, asleep, strict=True)
    )
    return MemoryPlan(schedule, turns)


def _stay_asleep(walk: list[tuple[Residents, frozenset[TagRef]]], asleep: list[set[TagRef]]) -> None:
    """Fill each run of turns (cyclically) in which a tag is awake between two in which it sleeps, where no
    turn of the run touches it. It only adds sleepers, so every turn still fits, and no turn sleeps what it needs."""
    count = len(walk)
    for ref in set().union(*asleep):
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


def check_plan(plan: MemoryPlan, memory: MemoryModel, budget: GpuBudget) -> MemoryPlan:
    """`plan` once every turn's peak fits `budget` and no turn sleeps a tag it touches; PlanError with the
    numbers (which turn, which phase, bytes needed and available, what is asleep) otherwise."""
    walk = _walk(plan.schedule, memory)
    if len(walk) != len(plan.turns):
        raise PlanError(f"the plan has {len(plan.turns)} turns, its schedule {len(walk)}")
    for index, ((residents, needs), planned) in enumerate(zip(walk, plan.turns, strict=True)):
        unknown = sorted(planned.asleep - set(memory.tags()))
        if unknown:
            raise PlanError(
                f"turn {index} ({residents.turn.describe()!r}) sleeps {unknown}, which the model lacks"
            )
        clash = sorted(planned.asleep & needs)
        if clash:
            raise PlanError(f"turn {index} ({residents.turn.describe()!r}) sleeps {clash}, which it touches")
        why = _refusal(
            plan.schedule,
            index,
            _peaks(plan.schedule, residents, planned.asleep, memory),
            planned.asleep,
            budget,
        )
        if why is not None:
            raise PlanError(why)
    return plan


def resident_plan(schedule: StepSchedule, memory: MemoryModel) -> MemoryPlan:
    """The plan that moves nothing (resident mode)."""
    return _fixed_plan(schedule, memory, lambda residents, needs: frozenset())


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


def _fixed_plan(
    schedule: StepSchedule,
    memory: MemoryModel,
    asleep_at: Callable[[Residents, frozenset[TagRef]], frozenset[TagRef]],
) -> MemoryPlan:
    turns = []
    for residents, needs in _walk(schedule, memory):
        asleep = asleep_at(residents, needs)
        turns.append(PlannedTurn(residents.turn, needs, asleep, _peaks(schedule, residents, asleep, memory)))
    return MemoryPlan(schedule, tuple(turns))
