"""The step's memory plan: it fits where its check says so, replayed against a fake allocator, and sleeps the least.

A plan is replayed turn by turn against `FakeAllocator`, which tracks allocated bytes and
raises `OutOfMemory` past its capacity (the budget's available bytes: the margin stays
free). Hypothesis draws the schedules the facts build (and the saves'), memory models and
capacities: a plan that passes its check replays without running out, never sleeps what a
turn touches, and more capacity never sleeps more. Hand-made cases show resident mode
(nothing moves) and today's shared mode (every untouched tag moves) as the plan's two ends,
the order in which tags go to sleep, and the near-full case: a capacity just above the
plan's worst turn passes, one byte below is refused by the check before any replay.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Collection
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.megatron.choices import memory_tag_pieces
from tandem.ppo.loop.memory_model import (
    EVICTION_ORDER,
    GpuBudget,
    MemoryModel,
    RoleMemory,
    TagRef,
    TrainSplit,
    fixed_from_gpu_memory,
)
from tandem.ppo.loop.memory_plan import (
    MemoryPlan,
    PlanError,
    capacity_range,
    check_plan,
    resident_plan,
    schedule_plan,
    shared_plan,
)
from tandem.ppo.loop.memory_planner import plan_memory
from tandem.ppo.loop.schedule import (
    TRAIN_ROLES,
    Role,
    ScheduleError,
    StepFacts,
    StepSchedule,
    residents_at_each_turn,
    save_schedule,
    step_schedule,
)
from tandem.ppo.loop.turn_memory import turn_peaks

GIB = 2**30


class OutOfMemory(RuntimeError):
    """What the fake allocator raises past its capacity, as CUDA's does."""


@dataclass
class FakeAllocator:
    """One GPU's allocator: named blocks of bytes, an out-of-memory error past `capacity`."""

    capacity: int
    blocks: dict[object, int] = field(default_factory=dict)
    calls: int = 0
    peak: int = 0

    @property
    def allocated(self) -> int:
        return sum(self.blocks.values())

    def malloc(self, key: object, nbytes: int) -> None:
        self.calls += 1
        assert key not in self.blocks, f"{key} allocated twice"
        if self.allocated + nbytes > self.capacity:
            raise OutOfMemory(f"{key}: {nbytes} bytes with {self.allocated} of {self.capacity} allocated")
        self.blocks[key] = nbytes
        self.peak = max(self.peak, self.allocated)

    def free(self, key: object) -> None:
        self.calls += 1
        del self.blocks[key]


def replay(
    plan: MemoryPlan, memory: MemoryModel, allocators: dict[str, FakeAllocator], steps: int = 2
) -> None:
    """Carry `plan` out for `steps` steps: before each turn its sleeps (freed) then its wakes (allocated), or
    where the plan moves them at once (`at_once`) a train role's cached transient handed back, then its
    wakes first, then the wakes the plan makes in the turn's background (`prefetch`); each phase's
    transient allocated, and held (cached by its process) until the next
    turn's moves hand it back (the async loop's background
    generation from `start_next` to `await_next`), but by a role that keeps its cache (`keeps_cache`),
    which holds it from the start and never hands it back: its transients must fit in it; every tag the
    turn touches must be allocated while it works."""
    schedule = plan.schedule

    def gpu(role: Role) -> FakeAllocator:
        return allocators[schedule.gpus(role)]

    for role, held in memory.roles.items():
        gpu(role).malloc(("fixed", role), held.fixed)
        for tag, nbytes in held.tags.items():
            if (role, tag) not in plan.turns[-1].asleep:
                gpu(role).malloc((role, tag), nbytes)
    for role in sorted(plan.keeps_cache):  # its cache as the step before left it
        gpu(role).malloc(("cache", role), memory.kept_cache(role))
    residents = residents_at_each_turn(schedule)
    cached: list[Role] = []  # the role whose transient its process holds until the next turn's moves

    def hand_back(roles: Collection[Role] | None = None) -> None:
        for role in [r for r in cached if roles is None or r in roles]:
            gpu(role).free(("transient", role))
            cached.remove(role)

    for _ in range(steps):
        for index, planned in enumerate(plan.turns):
            sleeps, wakes = plan.moves(index)
            if planned.at_once:
                # The other roles' sleeps (the turn before's), a train role's cache back, the planned roles'
                # wakes beside their sleeps, then the other roles' wakes (this turn's own).
                chosen = plan.planned_roles or set(memory.roles)
                for role, tag in sorted(ref for ref in sleeps if ref[0] not in chosen):
                    gpu(role).free((role, tag))
                hand_back(TRAIN_ROLES)
                for role, tag in sorted(ref for ref in wakes - planned.prefetch if ref[0] in chosen):
                    gpu(role).malloc((role, tag), memory.nbytes((role, tag)))
                for role, tag in sorted(ref for ref in sleeps if ref[0] in chosen):
                    gpu(role).free((role, tag))
                hand_back()
                for role, tag in sorted(ref for ref in wakes if ref[0] not in chosen):
                    gpu(role).malloc((role, tag), memory.nbytes((role, tag)))
            else:
                hand_back()
                for role, tag in sorted(sleeps):
                    gpu(role).free((role, tag))
                for role, tag in sorted(wakes - planned.prefetch):
                    gpu(role).malloc((role, tag), memory.nbytes((role, tag)))
            # The background wakes (`prefetch`) last: they run while the turn works.
            for role, tag in sorted(planned.prefetch):
                if (role, tag) not in gpu(role).blocks:
                    gpu(role).malloc((role, tag), memory.nbytes((role, tag)))
            turn = planned.turn
            for role, tag in planned.needs - planned.at_step:
                assert (role, tag) in gpu(role).blocks, f"{turn.describe()} works without {role}/{tag}"
            if planned.at_step:
                # The passes' activations come and go; then the state asleep through them wakes for the
                # step, beside its temporaries, in the blocks the passes left cached, and sleeps again: the
                # process holds the larger of the two until the next turn's moves hand it back.
                role = turn.role
                assert {r for r, _ in planned.at_step} == {role} and turn.work == "train"
                assert not any(ref in gpu(role).blocks for ref in planned.at_step), (
                    "asleep through the passes"
                )
                woken = sum(memory.nbytes(ref) for ref in planned.at_step)
                split = memory.train_splits[role]
                gpu(role).malloc(("transient", role), max(split.passes, woken + split.step))
                cached.append(role)
            elif turn.work == "start_next":
                gpu(turn.role).malloc(("background", turn.role), memory.transient(turn.role, turn.work))
            elif turn.work == "await_next":
                gpu(turn.role).free(("background", turn.role))
            elif turn.work is not None and turn.role in plan.keeps_cache:
                transient = memory.transient(turn.role, turn.work)
                assert transient <= gpu(turn.role).blocks[("cache", turn.role)], "a kept cache holds its work"
            elif turn.work is not None and turn.role in residents[index].computing:
                gpu(turn.role).malloc(("transient", turn.role), memory.transient(turn.role, turn.work))
                cached.append(turn.role)


def run_step(plan: MemoryPlan, memory: MemoryModel, budget: GpuBudget) -> dict[str, FakeAllocator]:
    """What the driver is to do: check the plan, then carry it out (here against fake allocators)."""
    allocators = {gpus: FakeAllocator(budget.available) for gpus in ("shared", "train", "rollout")}
    check_plan(plan, memory, budget)
    replay(plan, memory, allocators)
    return allocators


# --- strategies -----------------------------------------------------------------------------------------
FACTS = tuple(f.name for f in dataclasses.fields(StepFacts))
TRAIN_TAGS = tuple(t for t in EVICTION_ORDER if t != "kv_cache")


def _schedules() -> list[StepSchedule]:
    out = []
    for values in itertools.product([False, True], repeat=len(FACTS)):
        facts = StepFacts(**dict(zip(FACTS, values, strict=True)))
        for build in (step_schedule, save_schedule):
            schedule = build(facts)
            try:
                residents_at_each_turn(schedule)
            except ScheduleError:
                continue
            out.append(schedule)
    return out


SCHEDULES = _schedules()


@st.composite
def models(draw: st.DrawFn, schedule: StepSchedule) -> MemoryModel:
    roles = {t.role for t in schedule.turns} | {
        "actor"
    }  # a warm-up has no actor turn, yet the actor is there
    figures = st.integers(0, 100)
    memory = {}
    for role in sorted(roles):
        if role in ("actor", "critic"):
            kinds = ["weights", *draw(st.sets(st.sampled_from([t for t in TRAIN_TAGS if t != "weights"])))]
            # The optimizer's tags whole or in pieces (a worker's `optimizer_pieces`).
            names = [
                n
                for kind in kinds
                for n in memory_tag_pieces(
                    kind, draw(st.integers(1, 3)) if kind in ("optimizer_moments", "main_params") else 1
                )
            ]
        else:
            names = ["weights", "kv_cache"] if role == "engine" else ["weights"]
        fixed = draw(st.integers(2, 20))  # a CUDA context at least
        cache = draw(st.integers(0, 60)) if role in TRAIN_ROLES else 0  # the allocator's, after its work
        memory[role] = RoleMemory({n: draw(figures) for n in names}, fixed=fixed, cache=cache)
    phases = {
        (t.role, t.work): draw(st.integers(0, 60))
        for t in schedule.turns
        if t.work not in (None, "await_next")
    }
    # Some train roles' trains measured in their two parts (the train's figure is the larger).
    splits = {}
    for role in sorted(r for r in TRAIN_ROLES if (r, "train") in phases):
        if draw(st.booleans()):
            splits[role] = TrainSplit(draw(st.integers(0, 60)), draw(st.integers(0, 30)))
            phases[(role, "train")] = max(splits[role].passes, splits[role].step)
    return MemoryModel(memory, phases, splits)  # type: ignore[arg-type]


@st.composite
def cases(draw: st.DrawFn) -> tuple[StepSchedule, MemoryModel]:
    schedule = draw(st.sampled_from(SCHEDULES))
    return schedule, draw(models(schedule))


def _worst(plan: MemoryPlan) -> int:
    """The plan's most: its worst turn, or a turn entered with its moves at once (its `handover`)."""
    return max(max([*t.peaks.values(), *(t.handover.values() if t.at_once else ())]) for t in plan.turns)


def _least(schedule: StepSchedule, memory: MemoryModel) -> int:
    """The least room a plan can do with: the worst turn with every tag it does not touch asleep, and a train's
    optimizer state woken for its steps alone where that lowers it (`capacity_range`); without
    `train_splits`, the shared plan's worst turn."""
    least = capacity_range(schedule, memory)[0]
    if not memory.train_splits:
        assert least == _worst(shared_plan(schedule, memory))
    return least


def _used_before_it_sleeps(plan: MemoryPlan, index: int, ref: TagRef) -> bool:
    """Whether a turn from `index` on touches `ref` before a turn sleeps it again (cyclically)."""
    for k in range(len(plan.turns)):
        turn = plan.turns[(index + k) % len(plan.turns)]
        if ref in turn.asleep:
            return False
        if ref in turn.needs:
            return True
    return False


# --- properties -----------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 400), st.integers(0, 10), st.booleans())
def test_a_plan_that_passes_its_check_replays_within_the_capacity(
    case: tuple[StepSchedule, MemoryModel], room: int, margin: int, prefetch: bool
) -> None:
    schedule, memory = case
    budget = GpuBudget(room + margin + 1, margin)
    least = _least(schedule, memory)
    if least > budget.available:
        with pytest.raises(PlanError, match=r"turn \d+ .* needs \d+ bytes"):
            plan_memory(schedule, memory, budget, prefetch=prefetch)
        return
    plan = plan_memory(schedule, memory, budget, prefetch=prefetch)
    residents = residents_at_each_turn(schedule)
    for index, planned in enumerate(plan.turns):  # a background wake is a train role's, for a later turn
        for role, tag in planned.prefetch:
            assert prefetch and (role, tag) in plan.moves(index)[1] and role in TRAIN_ROLES
            assert role not in residents[index].computing and all(r != role for r, _ in planned.needs)
    for planned in plan.turns:
        assert not (planned.asleep - planned.at_step) & planned.needs, (
            f"{planned.turn.describe()} sleeps what it touches"
        )
        if planned.at_step:  # only where the turn fits no other way
            others = planned.asleep - planned.at_step
            index = plan.turns.index(planned)
            assert max(turn_peaks(schedule, residents[index], others, memory).values()) > budget.available
    for index in range(len(plan.turns)):
        for ref in plan.moves(index)[1]:  # woken before this turn: some turn uses it before it sleeps again
            assert _used_before_it_sleeps(plan, index, ref), f"{ref} woken before turn {index} for nothing"
    allocators = run_step(plan, memory, budget)
    assert all(a.peak <= budget.available for a in allocators.values())
    assert max(a.peak for a in allocators.values()) == _worst(plan), (
        "the replay's peak is the plan's worst turn"
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 400))
def test_a_role_keeps_its_cache_exactly_where_the_plan_has_room_for_it(
    case: tuple[StepSchedule, MemoryModel], room: int
) -> None:
    schedule, memory = case
    budget = GpuBudget(capacity_range(schedule, memory, planned_roles=TRAIN_ROLES)[0] + room + 1)
    plan = plan_memory(schedule, memory, budget, planned_roles=TRAIN_ROLES)
    run_step(plan, memory, budget)  # the kept caches counted at every turn: still within the budget
    for role in sorted(set(TRAIN_ROLES) - plan.keeps_cache):
        if role not in memory.roles:
            continue
        greedy = dataclasses.replace(plan, keeps_cache=plan.keeps_cache | {role})
        # One more kept cache would not fit, or its role's state wakes for its steps alone.
        with pytest.raises(PlanError, match=r"needs \d+ bytes|\(keeps_cache\)"):
            check_plan(greedy, memory, budget)
    everything = sum(m.fixed + sum(m.tags.values()) + memory.kept_cache(r) for r, m in memory.roles.items())
    roomy = plan_memory(
        schedule,
        memory,
        GpuBudget(everything + max(memory.phases.values(), default=0) + 1),
        planned_roles=TRAIN_ROLES,
    )
    assert roomy.keeps_cache == {r for r in TRAIN_ROLES if r in memory.roles}, (
        "with room for all, all keep theirs"
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 300), st.integers(0, 300))
def test_more_capacity_never_sleeps_more(
    case: tuple[StepSchedule, MemoryModel], extra: int, more: int
) -> None:
    schedule, memory = case
    low = GpuBudget(_least(schedule, memory) + extra + 1)
    high = GpuBudget(low.capacity + more)
    tight, roomy = plan_memory(schedule, memory, low), plan_memory(schedule, memory, high)
    for a, b in zip(tight.turns, roomy.turns, strict=True):
        assert b.asleep <= a.asleep, (
            f"{a.turn.describe()}: {sorted(b.asleep - a.asleep)} sleep only with more room"
        )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 300), st.integers(0, 8))
def test_the_near_full_case_passes_just_above_and_is_refused_before_the_step_just_below(
    case: tuple[StepSchedule, MemoryModel], extra: int, margin: int
) -> None:
    schedule, memory = case
    plan = plan_memory(schedule, memory, GpuBudget(_least(schedule, memory) + extra + margin + 1, margin))
    worst = _worst(plan)
    run_step(plan, memory, GpuBudget(worst + margin, margin))  # just fits: the worst turn reaches the budget
    below = GpuBudget(worst + margin - 1, margin)  # worst >= 2: every role holds a context
    untouched = {gpus: FakeAllocator(below.available) for gpus in ("shared", "train", "rollout")}
    with pytest.raises(PlanError, match=rf"needs {worst} bytes .* {worst - 1} bytes .* available"):
        check_plan(plan, memory, below)
        replay(plan, memory, untouched)
    assert all(a.calls == 0 for a in untouched.values()), "refused before anything was allocated"
    with pytest.raises(OutOfMemory):  # what the check spares the step: the same plan runs out mid-way
        replay(plan, memory, untouched)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_resident_and_shared_are_the_plans_two_ends(case: tuple[StepSchedule, MemoryModel]) -> None:
    schedule, memory = case
    caches = sum(memory.kept_cache(r) for r in TRAIN_ROLES if r in memory.roles)
    everything = sum(m.fixed + sum(m.tags.values()) for m in memory.roles.values()) + caches
    roomy = plan_memory(schedule, memory, GpuBudget(everything + max(memory.phases.values(), default=0) + 1))
    assert roomy == resident_plan(schedule, memory), "with room for everything nothing moves"
    assert [t.peaks for t in roomy.turns] == [t.peaks for t in resident_plan(schedule, memory).turns], (
        "and every train role keeps its cache, as in resident mode"
    )
    assert roomy.moved() == frozenset()
    least = _least(schedule, memory)
    tight = plan_memory(schedule, memory, GpuBudget(least))
    shared = shared_plan(schedule, memory)
    for a, b in zip(tight.turns, shared.turns, strict=True):
        assert a.asleep - a.at_step <= b.asleep, "no plan sleeps more than the shared one (but for its steps)"
    today = schedule_plan(schedule, memory)
    for a, b in zip(today.turns, shared.turns, strict=True):
        assert a.asleep <= b.asleep, "today's whole-role sleeps are a part of the shared plan's"


# --- hand-made cases ------------------------------------------------------------------------------------
SHARED = step_schedule(StepFacts(colocate=True, offload_train=True, critic=True, kl_first=True))
"""engine: generate, release → actor: wake, log_probs, sleep → critic: wake, train, sleep → actor: wake, train,
sleep → engine: resume, weights"""


def _model(**phases: int) -> MemoryModel:
    train = {"optimizer_moments": 20, "main_params": 10, "weights": 5, "grads": 5}
    return MemoryModel(
        {
            "engine": RoleMemory({"weights": 5, "kv_cache": 30}, fixed=1),
            "actor": RoleMemory(train, fixed=1),
            "critic": RoleMemory(train, fixed=1),
        },
        {
            ("engine", "generate"): phases.get("generate", 4),
            ("actor", "log_probs"): phases.get("log_probs", 6),
            ("critic", "train"): phases.get("critic_train", 8),
            ("actor", "train"): phases.get("actor_train", 8),
            ("engine", "weights"): phases.get("weights", 2),
        },
    )


def test_the_turns_of_a_shared_step_and_what_each_touches() -> None:
    plan = shared_plan(SHARED, _model())
    assert [t.turn.describe() for t in plan.turns] == [
        "engine: generate, release",
        "actor: wake, log_probs, sleep",
        "critic: wake, train, sleep",
        "actor: wake, train, sleep",
        "engine: resume, weights",
    ]
    needs = [sorted(t.needs) for t in plan.turns]
    assert needs[0] == [("engine", "kv_cache"), ("engine", "weights")]
    assert needs[1] == [("actor", "weights")], "the actor's log-probs read its weights alone"
    assert {tag for _, tag in needs[2]} == {"optimizer_moments", "main_params", "weights", "grads"}
    assert needs[4] == [("actor", "weights"), ("engine", "kv_cache"), ("engine", "weights")]
    # Resident: 3 fixed + 35 engine + 40 a model = 118, and each model's allocator keeps its largest phase's 8
    # cached = 134 at every turn, plus the engines' generate's 4 = 138 at its worst turn.
    resident = resident_plan(SHARED, _model())
    assert resident.keeps_cache == {"actor", "critic"}
    assert [max(t.peaks.values()) for t in resident.turns] == [138, 134, 134, 134, 136]
    # The shared plan's critic train: the critic's 40 + 8 of activations + the three fixed 3 = 51.
    assert plan.turns[2].peaks == {"shared": 51}
    assert plan.describe().splitlines()[1] == (
        "actor: wake, log_probs, sleep | asleep actor/grads, actor/main_params, actor/optimizer_moments, "
        "critic/grads, critic/main_params, critic/optimizer_moments, critic/weights, engine/kv_cache, "
        "engine/weights | peak 0.0 MiB"
    )


def test_sleeps_the_next_turns_untouched_tags_first_then_moments_before_main_parameters_before_weights() -> (
    None
):
    memory = _model()
    # The critic's train needs 40 + 8 + 3 = 51; resident, the turn holds 126; 100 available: free 26.
    plan = plan_memory(SHARED, memory, GpuBudget(100))
    critic_train = plan.turns[2]
    # The next turn (the actor's train) touches every actor tag, not the engines': the KV cache (30, dropped
    # for free) goes first and is enough.
    assert critic_train.asleep == {("engine", "kv_cache")}
    # With 70 available (free 56): the KV cache (30) is not enough; the engine's weights (5, untouched next)
    # follow, then the actor's tags by kind: grads (5), its moments (20). 30 + 5 + 5 + 20 = 60 >= 56.
    plan = plan_memory(SHARED, memory, GpuBudget(70))
    assert plan.turns[2].asleep == {
        ("engine", "kv_cache"),
        ("engine", "weights"),
        ("actor", "grads"),
        ("actor", "optimizer_moments"),
    }
    # 60 available (free 66): the main parameters (10) too, never the weights: 70 >= 66.
    plan = plan_memory(SHARED, memory, GpuBudget(60))
    assert ("actor", "main_params") in plan.turns[2].asleep
    assert ("actor", "weights") not in plan.turns[2].asleep
    # The actor's log-probs (60 available, 124 resident: free 64) keep the actor's weights. What a sleep drops
    # goes first: the KV cache (30) and the actor's grads (5), untouched by the next turn, then the critic's
    # grads (5), which the next turn trains with but cost no copy; then the actor's moments (20) and main
    # parameters (10): 70 >= 64; the engine's weights and the critic's copied tags stay.
    assert plan.turns[1].asleep == {
        ("actor", "grads"),
        ("engine", "kv_cache"),
        ("critic", "grads"),
        ("actor", "optimizer_moments"),
        ("actor", "main_params"),
    }


def _moved_bytes(plan: MemoryPlan, memory: MemoryModel) -> int:
    """Bytes a steady step of `plan` moves: every tag that sleeps or wakes before each turn."""
    return sum(memory.nbytes(ref) for i in range(len(plan.turns)) for ref in set().union(*plan.moves(i)))


def test_pieces_of_a_tag_let_a_turn_sleep_only_the_part_it_needs_room_for() -> None:
    whole = _model()
    quarters = {f"optimizer_moments.{i}": 5 for i in range(4)}  # a worker's `optimizer_pieces` 4
    train = {**{t: n for t, n in whole.roles["actor"].tags.items() if t != "optimizer_moments"}, **quarters}
    pieces = MemoryModel(
        {**whole.roles, "actor": RoleMemory(train, fixed=1), "critic": RoleMemory(dict(train), fixed=1)},
        whole.phases,
    )
    # 107 available: the engines' generate sleeps both models' grads, then the actor's moments: the whole tag,
    # or one quarter; the actor's train drops the critic's grads and the engines' KV cache (nothing to copy).
    budget = GpuBudget(107)
    by_tag, by_piece = plan_memory(SHARED, whole, budget), plan_memory(SHARED, pieces, budget)
    assert {t for r, t in by_tag.turns[0].asleep if r == "actor"} == {"grads", "optimizer_moments"}
    assert {t for r, t in by_piece.turns[0].asleep if r == "actor"} == {"grads", "optimizer_moments.0"}
    assert by_piece.turns[3].asleep == {("critic", "grads"), ("engine", "kv_cache")}
    # What a step moves (each tag to sleep and back, the engines' as well): the moments' 15 less each way.
    assert (_moved_bytes(by_tag, whole), _moved_bytes(by_piece, pieces)) == (120, 90)
    run_step(by_piece, pieces, budget)  # and it fits, replayed


def test_a_tag_asleep_on_both_sides_of_turns_that_do_not_touch_it_stays_asleep() -> None:
    schedule = step_schedule(
        StepFacts(colocate=True, offload_train=True, critic=False, reward_model=True, teacher=True)
    )
    assert schedule.describe().startswith(
        "engine: generate, release → reward_model: wake, score, sleep → teacher"
    )
    one = {"engine": 1, "reward_model": 1, "teacher": 1, "actor": 1}  # fixed: 4 in all
    memory = MemoryModel(
        {
            "engine": RoleMemory({"weights": 5, "kv_cache": 30}, one["engine"]),
            "reward_model": RoleMemory({"weights": 10}, one["reward_model"]),
            "teacher": RoleMemory({"weights": 10}, one["teacher"]),
            "actor": RoleMemory({"weights": 5, "optimizer": 20}, one["actor"]),
        },
        {
            ("engine", "generate"): 1,
            ("reward_model", "score"): 1,
            ("teacher", "log_probs"): 50,
            ("actor", "train"): 20,
            ("engine", "weights"): 50,
        },
    )
    plan = plan_memory(schedule, memory, GpuBudget(100))
    rm = ("reward_model", "weights")
    # 84 resident. The teacher's turn (134) frees 40: the KV cache (30), then the reward model's weights (10,
    # next used furthest ahead). The actor's train (104) frees 4: the KV cache (30, dropped, not copied),
    # which stays asleep. The weight sync (134, touching the engines' memory and the actor's weights) frees
    # 40: the actor's optimizer (20, untouched by the next turn), the teacher's weights, the reward model's.
    assert [rm in t.asleep for t in plan.turns] == [False, False, True, True, True]
    # The actor's train would fit with the reward model awake: it stays asleep there, between two sleeps,
    # rather than coming back for a turn that does not use it.
    assert plan.turns[3].asleep == {("engine", "kv_cache"), rm}
    # The next step's generate (85) fits everything: what the sync put away comes back before it.
    assert plan.moves(0) == (frozenset(), {rm, ("teacher", "weights"), ("actor", "optimizer")})
    run_step(plan, memory, GpuBudget(100))


def test_a_plan_that_cannot_fit_is_refused_with_the_numbers() -> None:
    memory = _model()
    # The critic's train alone needs 51 with everything else asleep.
    with pytest.raises(PlanError) as refused:
        plan_memory(SHARED, memory, GpuBudget(55, margin=5))
    message = str(refused.value)
    assert (
        "turn 2 ('critic: wake, train, sleep', phase critic/train) on the shared GPUs needs 51 bytes"
        in message
    )
    assert "50 bytes" in message and "capacity 55 less margin 5" in message
    assert "actor/weights" in message and "engine/kv_cache" in message, "it says what is asleep already"
    plan_memory(SHARED, memory, GpuBudget(56, margin=5))  # one byte more fits


def test_a_refusal_names_what_each_role_holds_and_the_parts_add_up() -> None:
    """The 3B run's refusal named a total alone; which figure was too large then took another GPU call."""
    gib = 2**30
    memory = MemoryModel(
        {
            role: dataclasses.replace(m, tags={t: n * gib for t, n in m.tags.items()}, fixed=m.fixed * gib)
            for role, m in _model().roles.items()
        },
        {key: n * gib for key, n in _model().phases.items()},
    )
    with pytest.raises(PlanError) as refused:
        plan_memory(SHARED, memory, GpuBudget(55 * gib, margin=5 * gib))
    message = str(refused.value)
    held = re.search(r"needs (\d+) bytes \(51.00 GiB\) \((.*), GiB\) with", message)
    assert held is not None, message
    figures = [float(x) for x in re.findall(r"\d+\.\d\d", held.group(2))]
    assert sum(figures) * gib == int(held.group(1)) == 51 * gib
    assert "critic: fixed 1.00 + tags awake 40.00 + its train transient 8.00" in held.group(2)
    assert "actor: fixed 1.00 + tags awake 0.00" in held.group(2)
    assert "engine: fixed 1.00 + tags awake 0.00" in held.group(2)


def test_the_check_refuses_a_plan_that_sleeps_what_its_turn_touches() -> None:
    memory = _model()
    plan = shared_plan(SHARED, memory)
    bad = list(plan.turns)
    bad[3] = bad[3].__class__(bad[3].turn, bad[3].needs, bad[3].asleep | {("actor", "weights")}, bad[3].peaks)
    with pytest.raises(
        PlanError, match=r"turn 3 \('actor: wake, train, sleep'\) sleeps \[\('actor', 'weights'\)\]"
    ):
        check_plan(MemoryPlan(SHARED, tuple(bad)), memory, GpuBudget(1000))


def test_todays_shared_step_moves_whole_roles_and_the_plan_less() -> None:
    memory = _model()
    today = schedule_plan(SHARED, memory)
    # Today the actor's log-probs wake the whole actor (44 resident + 6 + fixed 3 = 53 at that turn)...
    assert today.turns[1].peaks == {"shared": 3 + 40 + 6}
    # ...where the shared plan brings back its weights alone.
    assert shared_plan(SHARED, memory).turns[1].peaks == {"shared": 3 + 5 + 6}
    run_step(today, memory, GpuBudget(_worst(today)))


def test_the_memory_model_from_the_workers_reports_and_as_data() -> None:
    actor = RoleMemory.from_ranks(
        [{"weights": 10, "grads": 4, "optimizer": 30}, {"weights": 12, "grads": 4, "optimizer": 28}], fixed=3
    )
    assert actor == RoleMemory({"weights": 12, "grads": 4, "optimizer": 30}, fixed=3), (
        "the largest rank's figures"
    )
    memory = MemoryModel({"actor": dataclasses.replace(actor, cache=9)}, {("actor", "train"): 7})
    assert MemoryModel.from_dict(memory.to_dict()) == memory
    assert memory.to_dict()["phases"] == {"actor/train": 7}
    assert memory.kept_cache("actor") == 9, "its cache figure, above its largest phase's 7"
    assert MemoryModel({"actor": actor}, {("actor", "train"): 7}).kept_cache("actor") == 7, (
        "a process keeps at least what its largest phase allocated"
    )
    assert MemoryModel.from_dict({"roles": {"actor": {"tags": {}}}}).roles["actor"].cache == 0, (
        "a file written before the cache figure reads as none"
    )
    engines = RoleMemory.from_engine_stats(
        [
            {"allocated_gib": 3.0, "kv_cache_gib": 2.0, "sessions_gib": 0.25, "reserved_gib": 3.5},
            {"allocated_gib": 2.5, "kv_cache_gib": 2.0, "sessions_gib": 0.0},
        ]
    )
    # kv_cache: the largest cache with its sessions (2.25 GiB); weights: the largest rest (0.75 GiB, then 0.5);
    # fixed: what the first engine's allocator keeps cached beside them (0.5 GiB reserved, not allocated).
    assert engines == RoleMemory({"weights": 3 * 2**28, "kv_cache": 9 * 2**28}, fixed=2**29)
    # What the engine's process holds outside its allocator (its CUDA context, libraries' buffers: the
    # driver's figure less the allocator's reserved) stays whatever the engine releases: it adds to `fixed`.
    with_context = RoleMemory.from_engine_stats(
        [{"allocated_gib": 3.0, "kv_cache_gib": 2.0, "reserved_gib": 3.5, "process_gib": 4.25}]
    )
    assert with_context == RoleMemory({"weights": 2**30, "kv_cache": 2**31}, fixed=2**29 + 3 * 2**28)
    with pytest.raises(ValueError, match="no allocated_gib; measure the engines on a GPU"):
        RoleMemory.from_engine_stats([{"kv_cache_gib": 1.0}])
    assert fixed_from_gpu_memory([{"context": 500, "process": 9}, {"context": None}, {"context": 600}]) == 600
    with pytest.raises(ValueError, match="memory tag 'adam'"):
        RoleMemory({"adam": 1})
    with pytest.raises(ValueError, match=r"phases\['actor/fit'\]"):
        MemoryModel.from_dict({"phases": {"actor/fit": 1}})
    with pytest.raises(ValueError, match="role 'policy'"):
        MemoryModel.from_dict({"roles": {"policy": {"tags": {}}}})
    with pytest.raises(ValueError, match="no figure for engine/generate"):
        plan_memory(SHARED, MemoryModel(_model().roles, {}), GpuBudget(10**6))
    with pytest.raises(ValueError, match=r"no figures for \['critic', 'engine'\]"):
        plan_memory(SHARED, memory, GpuBudget(10**6))
    with pytest.raises(ValueError, match="margin < capacity"):
        GpuBudget(10, margin=10)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 400), st.integers(0, 10))
def test_a_plan_of_the_train_roles_alone_leaves_the_others_as_the_schedule_has_them(
    case: tuple[StepSchedule, MemoryModel], room: int, margin: int
) -> None:
    """`--memory-plan fit` plans the actor's and the critic's tags; the engines (and a reward model, a teacher)
    keep the schedule's whole-role wakes and sleeps, and the plan fits around them, within `capacity_range`."""
    schedule, memory = case
    budget = GpuBudget(room + margin + 1, margin)
    planned = ("actor", "critic")
    whole = schedule_plan(schedule, memory)
    least, most = capacity_range(schedule, memory, planned_roles=planned)
    assert least <= most
    if least > budget.available:
        with pytest.raises(PlanError, match=r"turn \d+ .* needs \d+ bytes"):
            plan_memory(schedule, memory, budget, planned_roles=planned)
        return
    plan = plan_memory(schedule, memory, budget, planned_roles=planned)
    for mine, theirs in zip(plan.turns, whole.turns, strict=True):
        others = {ref for ref in theirs.asleep if ref[0] not in planned}
        assert {ref for ref in mine.asleep if ref[0] not in planned} == others, mine.turn.describe()
    allocators = run_step(plan, memory, budget)
    assert all(a.peak <= budget.available for a in allocators.values())
    if budget.available >= most:
        assert not any(ref[0] in planned for ref in plan.moved()), (
            "room for all: the train roles stay resident"
        )
    if least >= 1:  # the least fits exactly; a byte less does not
        plan_memory(schedule, memory, GpuBudget(least), planned_roles=planned)
        with pytest.raises(PlanError):  # a margin of one byte: `least - 1` available
            plan_memory(schedule, memory, GpuBudget(least, 1), planned_roles=planned)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.floats(0, 1), st.integers(0, 8), st.booleans())
def test_below_the_shared_plans_least_a_train_wakes_its_state_for_the_step_alone_and_still_fits(
    case: tuple[StepSchedule, MemoryModel], where: float, margin: int, prefetch: bool
) -> None:
    """Between the least a plan needs with the optimizer's state woken for the steps alone and the least it
    needs without (the shared plan's worst turn), the plan fits only with such turns: it has them, they
    replay within the budget, and a byte below that least is refused before the step."""
    schedule, memory = case
    least, without = capacity_range(schedule, memory)[0], _worst(shared_plan(schedule, memory))
    if least >= without:
        assert least == without, "waking the state for the steps alone never needs more room"
        return
    room = least + round(where * (without - 1 - least))
    budget = GpuBudget(room + margin, margin)
    plan = plan_memory(schedule, memory, budget, prefetch=prefetch)
    assert any(t.at_step for t in plan.turns), "below the shared plan's least only a step wake fits"
    for planned in plan.turns:
        for role, tag in planned.at_step:
            assert planned.turn.work == "train" and role == planned.turn.role and role in memory.train_splits
            assert tag.split(".")[0] in ("optimizer_moments", "main_params", "optimizer")
            assert role not in plan.keeps_cache
    allocators = run_step(plan, memory, budget)
    assert max(a.peak for a in allocators.values()) <= budget.available
    if least >= 1:
        with pytest.raises(PlanError, match=r"turn \d+ .* needs \d+ bytes"):
            plan_memory(schedule, memory, GpuBudget(least, 1))


def _split_model(passes: int, step: int, pieces: int = 1) -> MemoryModel:
    """`_model` with the critic's and the actor's trains measured in two parts, their moments in `pieces`."""
    base = _model(critic_train=max(passes, step), actor_train=max(passes, step))
    moments = {f"optimizer_moments.{i}": 20 // pieces for i in range(pieces)} if pieces > 1 else {}
    roles = dict(base.roles)
    if moments:
        train = {
            **{t: n for t, n in base.roles["critic"].tags.items() if t != "optimizer_moments"},
            **moments,
        }
        roles = {**roles, "actor": RoleMemory(train, fixed=1), "critic": RoleMemory(dict(train), fixed=1)}
    split = TrainSplit(passes, step)
    return MemoryModel(roles, base.phases, {"actor": split, "critic": split})


def test_a_train_that_fits_no_other_way_keeps_its_moments_then_its_main_parameters_asleep_through_the_passes() -> (
    None
):
    # The critic's train, shared: 3 fixed + its 40 of tags + 30 of activations = 73. Its step's temporaries
    # are 6, and only the step reads the moments (20) and the main parameters (10).
    memory = _split_model(passes=30, step=6)
    assert max(shared_plan(SHARED, memory).turns[2].peaks.values()) == 73
    # 60 available: the moments asleep through the passes (3 + 20 + max(30, 20 + 6) = 53).
    plan = plan_memory(SHARED, memory, GpuBudget(60))
    assert plan.turns[2].at_step == {("critic", "optimizer_moments")}
    assert plan.turns[3].at_step == {("actor", "optimizer_moments")}
    assert plan.turns[2].peaks == {"shared": 53}
    assert ("critic", "optimizer_moments") in plan.turns[2].asleep
    assert "wakes for the optimizer step critic/optimizer_moments" in plan.describe().splitlines()[2]
    run_step(plan, memory, GpuBudget(60))
    # 50: the main parameters too (3 + 10 + max(30, 30 + 6) = 49), the floor of a train: every tag and the
    # step's 6 (the engines' generate needs 47).
    plan = plan_memory(SHARED, memory, GpuBudget(50))
    assert plan.turns[2].at_step == {("critic", "optimizer_moments"), ("critic", "main_params")}
    assert plan.turns[2].peaks == {"shared": 49}
    assert capacity_range(SHARED, memory)[0] == 49
    run_step(plan, memory, GpuBudget(49))
    with pytest.raises(
        PlanError, match=r"needs 49 bytes .*its train \(passes, or step with its state woken\) 0\.00"
    ):
        plan_memory(SHARED, memory, GpuBudget(48))
    # In quarters, one quarter of the moments is enough at 70: 43 - 5 + max(30, 5 + 6) = 68.
    plan = plan_memory(SHARED, _split_model(passes=30, step=6, pieces=4), GpuBudget(70))
    assert plan.turns[2].at_step == {("critic", "optimizer_moments.0")}
    # With room for the passes beside the whole state, no turn wakes anything for its step alone.
    assert not any(t.at_step for t in plan_memory(SHARED, memory, GpuBudget(73)).turns)
    # Without the split, the plan cannot do it: 60 is refused.
    with pytest.raises(PlanError, match="needs 73 bytes"):
        plan_memory(SHARED, _model(critic_train=30, actor_train=30), GpuBudget(60))


def test_the_check_refuses_step_wakes_it_cannot_carry_out() -> None:
    memory = _split_model(passes=30, step=6)
    plan = plan_memory(SHARED, memory, GpuBudget(60))
    turns = list(plan.turns)

    def with_turn(index: int, **changes: object) -> MemoryPlan:
        fixed = list(turns)
        fixed[index] = dataclasses.replace(fixed[index], **changes)  # type: ignore[arg-type]
        return dataclasses.replace(plan, turns=tuple(fixed))

    awake = turns[2].asleep - {("critic", "optimizer_moments")}
    with pytest.raises(PlanError, match=r"turn 2 .* for its optimizer steps alone"):
        check_plan(with_turn(2, asleep=awake), memory, GpuBudget(60))  # not asleep in its turn
    with pytest.raises(PlanError, match=r"turn 1 .* for its optimizer steps alone"):  # not a train
        check_plan(with_turn(1, at_step=frozenset({("actor", "optimizer_moments")})), memory, GpuBudget(60))
    with pytest.raises(PlanError, match=r"turn 2 .* for its optimizer steps alone"):  # a weight tag
        check_plan(
            with_turn(
                2,
                at_step=frozenset({("critic", "weights")}),
                asleep=turns[2].asleep | {("critic", "weights")},
            ),
            memory,
            GpuBudget(60),
        )
    unmeasured = MemoryModel(memory.roles, memory.phases, {"actor": memory.train_splits["actor"]})
    with pytest.raises(PlanError, match=r"turn 2 .* \(train_splits\)"):
        check_plan(plan, unmeasured, GpuBudget(60))
    with pytest.raises(PlanError, match=r"turn 2 .* \(keeps_cache\)"):
        check_plan(dataclasses.replace(plan, keeps_cache=frozenset({"critic"})), memory, GpuBudget(10**6))
    assert MemoryModel.from_dict(memory.to_dict()) == memory


def test_a_models_wake_for_its_train_runs_in_the_background_of_the_turn_before() -> None:
    train = {"weights": 5, "grads": 5, "main_params": 10, "optimizer_moments": 30}
    memory = MemoryModel(
        {
            "engine": RoleMemory({"weights": 5, "kv_cache": 40}, fixed=1),
            "actor": RoleMemory(train, fixed=1),
            "critic": RoleMemory(dict(train), fixed=1),
        },
        {
            ("engine", "generate"): 4,
            ("actor", "log_probs"): 2,
            ("critic", "train"): 8,
            ("actor", "train"): 8,
            ("engine", "weights"): 2,
        },
    )
    budget = GpuBudget(100)
    plain, ahead = plan_memory(SHARED, memory, budget), plan_memory(SHARED, memory, budget, prefetch=True)
    # The engines' generate has no room for the models' moments (98 of 100 with both asleep); the actor's
    # log-probs, the KV cache dropped, has room for the critic's (84 with them), which it does not touch:
    # they wake entering it, in its background, ready for the critic's train after it.
    assert [t.prefetch for t in ahead.turns] == [
        set(),
        {("critic", "optimizer_moments")},
        set(),
        set(),
        set(),
    ]
    assert [t.asleep for t in ahead.turns] == [t.asleep for t in plain.turns], "the same tags, moved sooner"
    assert ahead.describe().splitlines()[1].endswith("wakes in the background critic/optimizer_moments")
    run_step(ahead, memory, budget)
    # A plan that claims a background wake for what its turn touches is refused before the step.
    turns = list(ahead.turns)
    turns[2] = dataclasses.replace(turns[2], prefetch=frozenset({("critic", "optimizer_moments")}))
    with pytest.raises(PlanError, match=r"turn 2 .* in the background"):
        check_plan(dataclasses.replace(ahead, turns=tuple(turns)), memory, budget)
