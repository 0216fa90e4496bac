"""`SharedGpus` carries a memory plan out (`--memory-plan fit`): before each turn the actor's and the critic's
tags asleep are the plan's, what a turn touches is awake, a save wakes what its role has asleep and puts it
back, where the plan has room for it the two roles' moves run at once, and without a plan every wake and
sleep is the schedule's whole-role one.

The train groups and the engines are fakes that keep each role's tags asleep; no Ray, no torch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.megatron.runtime.gpu_memory import CACHED
from tandem.ppo.loop.memory_figures import (
    MemoryFigures,
    engine_memory,
    planned_roles,
    planner,
    replan_if_grown,
    write_plans,
)
from tandem.ppo.loop.memory_model import GpuBudget, MemoryModel, RoleMemory, TrainSplit
from tandem.ppo.loop.memory_plan import MemoryPlan, PlanError, check_plan
from tandem.ppo.loop.memory_planner import plan_memory
from tandem.ppo.loop.schedule import (
    StepFacts,
    StepSchedule,
    asleep_between_steps,
    save_schedule,
    step_schedule,
)
from tandem.ppo.loop.shared_gpus import SharedGpus
from tandem.ppo.loop.step_plans import auto_plans, begin_step
from tandem.ppo.run.log import PhaseClock

TAGS = ["weights", "grads", "main_params", "optimizer_moments"]


class Meeting:
    """Armed for a turn, the first move of each role waits there until the other role's has begun: moves made
    one after the other never meet, and the wait breaks (`threading.BrokenBarrierError`) after 20 s."""

    def __init__(self) -> None:
        self.barrier: threading.Barrier | None = None
        self.waited: set[str] = set()
        self.met = 0
        """Turns whose two roles' moves met."""

    def arm(self, armed: bool) -> None:
        self.barrier, self.waited = (threading.Barrier(2, timeout=20) if armed else None), set()

    def wait(self, role: str) -> None:
        if self.barrier is None or role in self.waited:
            return
        self.waited.add(role)
        if self.barrier.wait() == 0:
            self.met += 1


class FakeGroup:
    """A train group whose workers keep which tags are asleep and refuse work without the tags it needs."""

    def __init__(self, role: str, meeting: Meeting | None = None) -> None:
        self.role = role
        self.meeting = meeting
        self.asleep: set[str] = set()
        self.calls: list[tuple[str, list[str] | None]] = []
        self.peaks: dict[str, int] = {}
        """What `phase_peaks` answers: each work's allocator peak so far."""
        self.fail: str | None = None
        """A method that raises, once."""
        self.at_step: list[str] = []
        """The tags its trains keep asleep through the passes (`keep_asleep_for_passes`)."""

    def run(self, method: str, *args: Any) -> list[Any]:
        if method == "phase_peaks":
            return [dict(self.peaks)]
        tags = list(args[0]) if args and args[0] is not None else None
        if self.meeting is not None and method in ("sleep", "wake_up"):
            self.meeting.wait(self.role)
        if method == self.fail:
            self.fail = None
            raise RuntimeError(f"{self.role}: {method} failed")
        self.calls.append((method, tags))
        if method == "keep_asleep_for_passes":
            self.at_step = list(tags or [])
        elif method == "sleep":
            assert tags is None or not (set(tags) & self.asleep), f"{self.role}: {tags} sleep twice"
            self.asleep |= set(TAGS if tags is None else tags)
        elif method == "wake_up":
            assert tags is None or set(tags) <= self.asleep, f"{self.role}: {tags} woken while awake"
            self.asleep -= set(TAGS if tags is None else tags)
        return [{"total": 0.0}]

    def sleep(self) -> list[dict[str, float]]:
        return self.run("sleep")  # type: ignore[no-any-return]

    def wake_up(self) -> list[dict[str, float]]:
        return self.run("wake_up")  # type: ignore[no-any-return]


class FakeEngines:
    """The engines' memory tags released, and each release and resume asked for."""

    on_restart: Any = None

    def __init__(self) -> None:
        self.released_tags: set[str] = set()
        self.calls: list[tuple[str, list[str]]] = []

    @property
    def released(self) -> bool:
        return bool(self.released_tags)

    def release_memory(self, tags: Any = ("weights", "kv_cache")) -> None:
        self.calls.append(("release_memory", list(tags)))
        self.released_tags |= set(tags)

    def resume_memory(self, tags: Any = ("weights", "kv_cache")) -> None:
        self.calls.append(("resume_memory", list(tags)))
        self.released_tags -= set(tags)

    def all(self, method: str) -> list[dict[str, float]]:
        return [{"kv_cache_gib": 1.0, "sessions_gib": 0.0}]


class Events:
    def __init__(self) -> None:
        self.recorded: list[tuple[str, dict[str, Any]]] = []

    def record(self, event: str, **fields: Any) -> None:
        self.recorded.append((event, fields))


FACTS = StepFacts(colocate=True, offload_train=True, critic=True, kl_first=True)
MB = 2**20


def _gpus(
    meeting: Meeting | None = None, group: type[FakeGroup] = FakeGroup
) -> tuple[SharedGpus, FakeGroup, FakeGroup, Events]:
    actor, critic, events = group("actor", meeting), group("critic", meeting), Events()
    gpus = SharedGpus(
        engines=FakeEngines(),  # type: ignore[arg-type]
        actor=actor,  # type: ignore[arg-type]
        critic=critic,  # type: ignore[arg-type]
        events=events,  # type: ignore[arg-type]
        clock=PhaseClock(track_gpu_memory=False),
    )
    return gpus, actor, critic, events


def _model() -> MemoryModel:
    train = {"weights": 10 * MB, "grads": 10 * MB, "main_params": 20 * MB, "optimizer_moments": 40 * MB}
    return MemoryModel(
        {
            "engine": RoleMemory({"weights": 10 * MB, "kv_cache": 30 * MB}, fixed=MB),
            "actor": RoleMemory(train, fixed=MB),
            "critic": RoleMemory(dict(train), fixed=MB),
        },
        {
            ("actor", "train"): 20 * MB,
            ("actor", "log_probs"): 8 * MB,
            ("critic", "train"): 20 * MB,
            ("engine", "generate"): 5 * MB,
            ("engine", "weights"): 2 * MB,
        },
    )


def _take(
    gpus: SharedGpus,
    schedule: StepSchedule,
    groups: dict[str, FakeGroup],
    plan: MemoryPlan | None,
    before_enter: Callable[[int], None] | None = None,
    *,
    begun: bool = False,
) -> None:
    """One step's turns as `PPODriver.step` takes them: `enter`, the turn's wake, its work, its sleep
    (`begun`: the step has begun already, its plan taken)."""
    if not begun:
        gpus.begin_step(schedule)
    for index, turn in enumerate(schedule.turns):
        if before_enter is not None:
            before_enter(index)
        gpus.enter(index)
        gpus.before(turn)
        if plan is not None:
            planned = plan.turns[index]
            for role, group in groups.items():
                assert group.asleep == {t for r, t in planned.asleep if r == role}, (
                    f"turn {index} {turn.describe()}: {role} has {sorted(group.asleep)} asleep"
                )
            for role, tag in planned.needs - planned.at_step:
                if role in groups:
                    assert tag not in groups[role].asleep, f"{turn.describe()} works without {role}/{tag}"
            for role, tag in planned.at_step:  # asleep through the passes, woken by the train for its steps
                assert groups[role].at_step == [tag for t in TAGS for r, tag in planned.at_step if tag == t]
        elif turn.role in groups and turn.work is not None:
            assert not groups[turn.role].asleep, f"{turn.describe()} works asleep"
        gpus.after(turn)


@pytest.mark.parametrize("room_mb", [120, 170, 400])
def test_each_turn_has_the_plans_tags_asleep_and_a_save_wakes_and_restores(room_mb: int) -> None:
    schedule = step_schedule(FACTS)
    memory, budget = _model(), GpuBudget(room_mb * MB + 4 * MB, 4 * MB)
    plan = plan_memory(schedule, memory, budget, planned_roles=("actor", "critic"))
    gpus, actor, critic, events = _gpus()
    groups = {"actor": actor, "critic": critic}
    gpus.start_asleep(schedule)  # the first step's whole-role state: both models asleep
    assert actor.asleep == critic.asleep == set(TAGS)
    _take(gpus, schedule, groups, None)  # the first step runs whole
    gpus.use_plans(
        lambda s: plan, {"actor": TAGS, "critic": TAGS}, {r: memory.nbytes(r) for r in memory.tags()}
    )
    for _ in range(2):  # the first planned step starts from the whole-role state, the second from its own
        _take(gpus, schedule, groups, plan)
    steady = sum(
        memory.nbytes(ref)
        for index in range(len(plan.turns))
        for ref in set().union(*plan.moves(index))
        if ref[0] in groups
    )
    assert gpus.moved_bytes == steady, "a step moves what the plan's moves say, no more"
    if room_mb == 400:
        assert steady == 0, "with room for everything nothing moves (resident)"
    else:
        assert steady > 0
    # A save between two steps: its role whole on the GPU, then as the plan left it.
    before = {r: set(g.asleep) for r, g in groups.items()}
    for turn in save_schedule(FACTS).turns:
        gpus.before(turn)
        if turn.work == "save":
            assert not groups[turn.role].asleep, f"{turn.role} saves with tags asleep"
        gpus.after(turn)
    assert {r: g.asleep for r, g in groups.items()} == before
    assert any(e == "sleep" and "tags" in f for e, f in events.recorded) or steady == 0


def test_the_plan_sleeps_moments_before_main_parameters_before_weights_when_tight() -> None:
    schedule = step_schedule(FACTS)
    memory = _model()
    roomy = plan_memory(schedule, memory, GpuBudget(170 * MB), planned_roles=("actor", "critic"))
    critic_train = next(t for t in roomy.turns if t.turn.role == "critic" and t.turn.work == "train")
    asleep = {tag for role, tag in critic_train.asleep if role == "actor"}
    assert "optimizer_moments" in asleep and "weights" not in asleep, sorted(asleep)


def test_without_a_plan_every_wake_and_sleep_is_the_whole_roles() -> None:
    schedule = step_schedule(FACTS)
    gpus, actor, critic, _ = _gpus()
    gpus.start_asleep(schedule)
    _take(gpus, schedule, {"actor": actor, "critic": critic}, None)
    assert all(tags is None for method, tags in actor.calls + critic.calls), "whole-role calls only"
    assert gpus.moved_bytes == 0


def test_a_planner_refuses_a_schedule_that_cannot_fit_before_the_step_moves_anything(tmp_path: Path) -> None:
    memory = _model()
    figures = MemoryFigures(memory, GpuBudget(60 * MB), {"actor": TAGS, "critic": TAGS})
    made: dict[str, MemoryPlan] = {}
    gpus, actor, critic, _ = _gpus()
    gpus.start_asleep(step_schedule(FACTS))
    calls_before = len(actor.calls) + len(critic.calls)
    gpus.use_plans(
        planner(figures, lambda s, p: made.update({s.describe(): p})), figures.tags, figures.tag_bytes()
    )
    with pytest.raises(PlanError, match=r"needs \d+ bytes .* available"):
        gpus.begin_step(step_schedule(FACTS))
    assert len(actor.calls) + len(critic.calls) == calls_before, "refused before any tag moved"
    roomy = MemoryFigures(memory, GpuBudget(400 * MB), figures.tags)
    plan_of = planner(roomy, lambda s, p: made.update({s.describe(): p}))
    assert plan_of(step_schedule(FACTS)) is plan_of(step_schedule(FACTS)), "each schedule planned once"
    write_plans(tmp_path / "memory_plan.json", roomy, made)
    data = (tmp_path / "memory_plan.json").read_text()
    assert '"capacity": 419430400' in data and "critic: wake, train, sleep" in data


def test_the_engines_figures_on_a_cpu_are_their_kv_cache_alone() -> None:
    assert engine_memory([{"kv_cache_gib": 1.0, "sessions_gib": 0.5}]).tags == {"kv_cache": 3 * 2**29}
    gpu = engine_memory([{"kv_cache_gib": 1.0, "sessions_gib": 0.0, "allocated_gib": 3.0}])
    assert gpu.tags == {"weights": 2 * 2**30, "kv_cache": 2**30}


class FakeForward:
    """A reward model or a teacher: whole-role wake and sleep."""

    def __init__(self) -> None:
        self.awake = True

    def wake(self) -> list[dict[str, float]]:
        self.awake = True
        return []

    def sleep(self) -> list[dict[str, float]]:
        self.awake = False
        return []

    def shutdown(self) -> None:
        pass


def test_a_reward_models_and_a_teachers_turns_inside_the_draw_find_the_plans_tags() -> None:
    """The draw takes the score and teacher turns inside the generate turn (and a second round of sampling
    resumes the engines after the score): each finds the train roles' tags as the plan has them for it."""
    facts = StepFacts(colocate=True, offload_train=True, critic=True, reward_model=True, teacher=True)
    schedule = step_schedule(facts)
    base = _model()
    memory = MemoryModel(
        {
            **base.roles,
            "reward_model": RoleMemory({"weights": 60 * MB}),
            "teacher": RoleMemory({"weights": 50 * MB}),
        },
        {**base.phases, ("reward_model", "score"): 4 * MB, ("teacher", "log_probs"): 4 * MB},
    )
    plan = plan_memory(schedule, memory, GpuBudget(200 * MB), planned_roles=("actor", "critic"))
    index = {t.turn.work if t.turn.role == "engine" else t.turn.role: i for i, t in enumerate(plan.turns)}
    trains = ("actor", "critic")
    at_score, at_generate = (
        {ref for ref in plan.turns[index[k]].asleep if ref[0] in trains} for k in ("reward_model", "generate")
    )
    assert at_score != at_generate, "the case must move tags between the generate and the score turns"
    gpus, actor, critic, _ = _gpus()
    groups = {"actor": actor, "critic": critic}
    gpus.add_reward_model(FakeForward())  # type: ignore[arg-type]
    gpus.add_teacher(FakeForward())  # type: ignore[arg-type]
    gpus.start_asleep(schedule)
    gpus.use_plans(
        lambda s: plan, {"actor": TAGS, "critic": TAGS}, {r: memory.nbytes(r) for r in memory.tags()}
    )

    def train_tags_are(i: int) -> None:
        for role, group in groups.items():
            assert group.asleep == {t for r, t in plan.turns[i].asleep if r == role}, (
                plan.turns[i].turn,
                role,
            )

    generate, score, teach = (plan.turns[index[k]].turn for k in ("generate", "reward_model", "teacher"))
    for _ in range(2):
        gpus.begin_step(schedule)
        gpus.enter(0)
        for _round in range(2):  # dynamic sampling: two rounds of generate + score
            gpus.ready("engine")
            train_tags_are(index["generate"])
            gpus.after(generate)
            with gpus.turn(score):
                train_tags_are(index["reward_model"])
        with gpus.turn(teach):
            train_tags_are(index["teacher"])
        gpus.after(generate)
        for i, turn in enumerate(schedule.turns[1:], start=1):
            gpus.enter(i)
            train_tags_are(i)
            if turn.role in groups:
                gpus.before(turn)
                gpus.after(turn)
            elif turn.work == "weights":
                gpus.wake("engine")


def test_a_phase_whose_peak_grew_is_planned_again_from_the_new_figure(tmp_path: Path) -> None:
    """A longer rollout's train needs more than the first step's: the next step's plan counts it."""
    schedule = step_schedule(FACTS)
    memory = _model()
    figures = MemoryFigures(memory, GpuBudget(200 * MB), {"actor": TAGS, "critic": TAGS})
    gpus, actor, _critic, _ = _gpus()
    gpus.start_asleep(schedule)
    made: dict[str, MemoryPlan] = {}
    gpus.use_plans(
        planner(figures, lambda s, p: made.update({"first": p})), figures.tags, figures.tag_bytes()
    )
    gpus.begin_step(schedule)
    before = gpus.plan
    assert before is not None
    _take(gpus, schedule, {"actor": actor, "critic": _critic}, before, begun=True)
    left = {r: set(g.asleep) for r, g in (("actor", actor), ("critic", _critic))}
    assert any(left.values()), "the step ends with some tags asleep"
    actor.peaks = {"train": 20 * MB}  # as measured: nothing grew
    assert replan_if_grown(gpus, figures, tmp_path) is figures
    actor.peaks = {"train": 60 * MB, "log_probs": 1 * MB}  # the actor's train grew; its log-probs did not
    grown = replan_if_grown(gpus, figures, tmp_path)
    assert grown.model.phases[("actor", "train")] == 60 * MB
    assert grown.model.phases[("actor", "log_probs")] == 8 * MB, "a figure never shrinks"
    gpus.begin_step(schedule)
    after = gpus.plan
    assert after is not None and after is not before
    # Planned again between two planned steps: the tags the last step left asleep are known as asleep, and
    # the next step moves from them (the fakes refuse a tag put to sleep twice or woken while awake).
    assert {r: gpus._asleep_tags[r] for r in left} == left
    _take(gpus, schedule, {"actor": actor, "critic": _critic}, after, begun=True)
    actor_train = next(
        i for i, t in enumerate(after.turns) if t.turn.role == "actor" and t.turn.work == "train"
    )
    assert after.turns[actor_train].asleep > before.turns[actor_train].asleep, "more room made for the train"
    check_plan(after, grown.model, grown.budget)
    with pytest.raises(PlanError, match="actor/train"):  # the first plan would run out with the new figure
        check_plan(before, grown.model, grown.budget)
    assert "actor: wake, train, sleep" in (tmp_path / "memory_plan.json").read_text()
    # The allocator kept more cached than any phase's peak (fragmentation): counted as the actor's cache.
    actor.peaks = {"train": 60 * MB, CACHED: 70 * MB}
    cached = replan_if_grown(gpus, grown, tmp_path)
    assert cached.model.roles["actor"].cache == 70 * MB and cached.model.kept_cache("actor") == 70 * MB
    assert cached.model.phases == grown.model.phases, "the cache figure is no phase's"
    assert replan_if_grown(gpus, cached, tmp_path) is cached, "nothing grew since"


class MeasuredGroup(FakeGroup):
    """A train group that also answers what `measure_memory` asks: its tags, their bytes, its CUDA context."""

    def run(self, method: str, *args: Any) -> list[Any]:
        train = {"weights": 10 * MB, "grads": 10 * MB, "main_params": 20 * MB, "optimizer_moments": 40 * MB}
        answers: dict[str, Any] = {
            "memory_tags": TAGS,
            "state_nbytes": train,
            "gpu_memory": {"context": MB, "pid": None},
        }
        return [answers[method]] if method in answers else super().run(method, *args)


@pytest.mark.parametrize(
    ("total_mb", "gpu_memory_gib", "planned"),
    [
        (400, None, True),  # the engines report the GPU's memory, and the plan has room: it plans
        (None, None, False),  # no GPU memory to plan in (a CPU engine, SGLang servers): whole roles
        (None, 400 / 1024, True),  # ... unless it is given
        (100, None, False),  # the plan is refused (the margin does not fit beside the turns): whole roles
    ],
)
def test_auto_plans_where_the_run_can_and_else_keeps_whole_roles_and_says_why(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    total_mb: int | None,
    gpu_memory_gib: float | None,
    planned: bool,
) -> None:
    """`--memory-plan auto` after the first step: the plan where the figures can be had and the next step's
    schedule fits, the next step's tags then moved by it; else no plan, the reason logged and returned,
    and the next step the schedule's whole-role wakes and sleeps."""
    schedule = step_schedule(FACTS)
    gpus, actor, critic, _ = _gpus(group=MeasuredGroup)
    gpus.start_asleep(schedule)
    actor.peaks = critic.peaks = {"train": 20 * MB, "log_probs": 8 * MB}
    stats: dict[str, float] = {"kv_cache_gib": 30 / 1024, "sessions_gib": 0.0, "allocated_gib": 40 / 1024}
    gpus.engine_stats = [stats if total_mb is None else {**stats, "total_gib": total_mb / 1024}]
    config = SimpleNamespace(gpu_memory_gib=gpu_memory_gib, memory_margin_gib=4 / 1024, prefetch_wakes=True)
    with caplog.at_level(logging.INFO, logger="tandem"):
        figures, why = auto_plans(gpus, config, tmp_path, schedule)
    said = [r.getMessage() for r in caplog.records if "--memory-plan auto" in r.getMessage()]
    assert len(said) == 1, said
    if planned:
        assert figures is not None and why is None and gpus.planning is not None
        assert figures.budget.capacity == (total_mb or 400) * MB
        _take(gpus, schedule, {"actor": actor, "critic": critic}, gpus.planning(schedule))
        assert any(tags is not None for _, tags in actor.calls), "the plan's tag moves"
        assert (tmp_path / "memory_plan.json").is_file()
    else:
        assert figures is None and why is not None and gpus.planning is None
        assert why in said[0]
        assert ("--gpu-memory-gib" if total_mb is None else "available") in why
        _take(gpus, schedule, {"actor": actor, "critic": critic}, None)
        assert all(tags is None for _, tags in actor.calls + critic.calls), "whole-role calls only"
        assert not (tmp_path / "memory_plan.json").exists()


def _whole_role_state(gpus: SharedGpus, schedule: StepSchedule, groups: dict[str, FakeGroup]) -> None:
    """Every role as `schedule` starts it under whole-role sleeps: those it starts asleep with every tag
    asleep, the others with none, and no train told to keep anything asleep through its passes."""
    asleep = asleep_between_steps(schedule)
    for role, group in groups.items():
        assert group.asleep == (set(TAGS) if role in asleep else set()), (role, sorted(group.asleep))
        assert group.at_step == [], role
        assert gpus.awake(role) == (role not in asleep)
    engines = gpus.engines
    assert isinstance(engines, FakeEngines)
    assert engines.released == ("engine" in asleep) and gpus.awake("engine") == ("engine" not in asleep)


@pytest.mark.parametrize("memory_plan", ["fit", "auto"])
def test_a_step_with_a_work_no_step_ran_runs_whole_and_a_refused_plan_is_whole_under_auto(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, memory_plan: str
) -> None:
    """A critic's warm-up, then the full step: the warm-up's second step is planned from the first's
    figures; the first full step, whose actor trains for the first time, runs whole and measures the train;
    the next is planned with it. Then the actor's train grows past the room (a longer rollout): under
    `auto` the refused plan puts every role back to the whole-role state and the run goes on with
    whole-role sleeps, said once; under `fit` the PlanError stops it before anything moves."""
    warm, full = step_schedule(FACTS.replace(warm_up=True)), step_schedule(FACTS)
    gpus, actor, critic, _ = _gpus(group=MeasuredGroup)
    groups: dict[str, FakeGroup] = {"actor": actor, "critic": critic}
    gpus.start_asleep(full)
    stats = {
        "kv_cache_gib": 30 / 1024,
        "sessions_gib": 0.0,
        "allocated_gib": 40 / 1024,
        "total_gib": 200 / 1024,
    }
    gpus.engine_stats = [stats]
    config = SimpleNamespace(gpu_memory_gib=None, memory_margin_gib=4 / 1024, prefetch_wakes=True)
    ran: frozenset[tuple[str, str | None]] = frozenset()
    figures: MemoryFigures | None = None

    def step(schedule: StepSchedule, *, planned: bool) -> str | None:
        nonlocal ran, figures
        if figures is not None:
            figures = replan_if_grown(gpus, figures, tmp_path)
        refused = begin_step(
            gpus,
            schedule,
            figures=figures,
            ran=ran,
            memory_plan=memory_plan,
            run_dir=tmp_path,  # type: ignore[arg-type]
        )
        assert (gpus.plan is not None) == planned, (schedule.describe(), gpus.plan)
        if refused is not None:  # as the driver does: no figures from then on
            figures = None
        if refused is not None or not planned:
            _whole_role_state(gpus, schedule, groups)
        calls = {role: len(group.calls) for role, group in groups.items()}
        _take(gpus, schedule, groups, gpus.plan, begun=True)
        made = [call for role, group in groups.items() for call in group.calls[calls[role] :]]
        assert made, "the step's wakes and sleeps"
        assert all(tags is None for _, tags in made) == (not planned), made
        ran |= schedule.works()
        return refused

    assert step(warm, planned=False) is None  # each start's first step: whole, measuring
    critic.peaks, actor.peaks = {"train": 20 * MB}, {"log_probs": 8 * MB}
    figures, why = auto_plans(gpus, config, tmp_path, warm)
    assert figures is not None and why is None
    with caplog.at_level(logging.INFO, logger="tandem"):
        assert step(warm, planned=True) is None
        assert step(full, planned=False) is None  # the actor's first train: whole, and measured
        said = [r.getMessage() for r in caplog.records if "ran in no step of this start" in r.getMessage()]
        assert len(said) == 1 and "actor/train" in said[0], said
        actor.peaks = {"train": 20 * MB, "log_probs": 8 * MB}
        assert step(full, planned=True) is None  # planned again, with the actor's train
        actor.peaks = {"train": 400 * MB, "log_probs": 8 * MB}  # grown past the GPU
        moved = len(actor.calls) + len(critic.calls)
        if memory_plan == "fit":
            with pytest.raises(PlanError, match="actor/train"):
                step(full, planned=True)
            assert len(actor.calls) + len(critic.calls) == moved, "refused before any tag moved"
            return
        why = step(full, planned=False)
        assert why is not None and "actor/train" in why
        refusals = [r.getMessage() for r in caplog.records if "is refused" in r.getMessage()]
        assert len(refusals) == 1 and why in refusals[0], refusals
        assert step(full, planned=False) is None  # whole from then on, said once
    assert len([r for r in caplog.records if "is refused" in r.getMessage()]) == 1


def _plan_with_moves_at_once() -> tuple[StepSchedule, MemoryModel, MemoryPlan, list[int]]:
    """A plan whose room lets some turns move the two roles' tags at once (the turn before's holding, less
    its train role's cache, and what wakes fit), but not every turn's; the turns that do."""
    schedule, memory = step_schedule(FACTS), _model()
    plan = plan_memory(schedule, memory, GpuBudget(170 * MB), planned_roles=("actor", "critic"))
    together = [i for i in range(len(plan.turns)) if plan.together(i)]
    two_roles = [i for i in range(len(plan.turns)) if len({r for r, _ in set().union(*plan.moves(i))}) > 1]
    assert together and set(together) < set(two_roles), (together, two_roles)
    return schedule, memory, plan, together


def test_where_the_plan_has_room_two_roles_move_at_once_else_one_after_the_other() -> None:
    schedule, memory, plan, together = _plan_with_moves_at_once()
    meeting = Meeting()
    gpus, actor, critic, events = _gpus(meeting)
    groups = {"actor": actor, "critic": critic}
    gpus.start_asleep(schedule)
    gpus.use_plans(
        lambda s: plan, {"actor": TAGS, "critic": TAGS}, {r: memory.nbytes(r) for r in memory.tags()}
    )
    # From the whole-role state (every tag asleep), which the plan's room does not count from: one by one.
    gpus.begin_step(schedule)
    gpus.enter(together[0])
    assert "time/handover" not in gpus.clock.values
    _take(gpus, schedule, groups, plan)  # the first planned step: from there to the plan's tags
    events.recorded.clear()
    gpus.clock.reset()
    _take(gpus, schedule, groups, plan, before_enter=lambda i: meeting.arm(i in together))
    assert meeting.met == len(together), "each turn with room moved its two roles at once"
    assert "time/handover" in gpus.clock.values
    at_once = {(f["role"], e, tuple(f["tags"])) for e, f in events.recorded if f.get("at_once")}
    expected = {
        (role, verb, tuple(t for t in TAGS if (role, t) in refs))
        for i in together
        for verb, refs in zip(("sleep", "wake"), plan.moves(i), strict=True)
        for role in ("actor", "critic")
        if any(r == role for r, _ in refs)
    }
    assert at_once == expected
    assert all(f.get("at_once") for e, f in events.recorded if e in ("sleep", "wake")) is False, (
        "the turns without room move one after the other"
    )
    # --no-overlap-moves: the same tags at every turn (`_take` checks), each move on its own.
    gpus.overlap_moves = False
    events.recorded.clear()
    gpus.clock.reset()
    _take(gpus, schedule, groups, plan)
    assert "time/handover" not in gpus.clock.values
    assert not any(f.get("at_once") for _, f in events.recorded)


def test_a_move_that_fails_at_once_keeps_the_others_and_the_next_entry_finishes_the_turn() -> None:
    schedule, memory, plan, together = _plan_with_moves_at_once()
    gpus, actor, critic, _ = _gpus()
    groups = {"actor": actor, "critic": critic}
    gpus.start_asleep(schedule)
    gpus.use_plans(
        lambda s: plan, {"actor": TAGS, "critic": TAGS}, {r: memory.nbytes(r) for r in memory.tags()}
    )
    _take(gpus, schedule, groups, plan)
    index = together[0]
    sleeps, wakes = plan.moves(index)
    waking = sorted({r for r, _ in wakes if r in groups})[0]
    sleeping = next(r for r, _ in sorted(sleeps) if r in groups and r != waking)
    gpus.begin_step(schedule)
    for i in range(index):
        gpus.enter(i)
    groups[waking].fail = "wake_up"
    with pytest.raises(RuntimeError, match=f"{waking}: wake_up failed"):
        gpus.enter(index)
    want = {t for r, t in plan.turns[index].asleep if r == sleeping}
    assert groups[sleeping].asleep == want, "the other role's move completed"
    gpus.enter(index)  # the fakes refuse a tag put to sleep twice: only the failed wake is made again
    for role, group in groups.items():
        assert group.asleep == {t for r, t in plan.turns[index].asleep if r == role}


@pytest.mark.parametrize("room_mb", [150, 230, 400])
def test_a_role_with_room_for_its_cache_keeps_it_and_the_others_hand_theirs_back(room_mb: int) -> None:
    # The step's caches: each train role's largest phase (20 MB). With room for everything both keep theirs
    # (resident mode's habit: the next train allocates nothing anew); with less, those the plan has no room
    # for hand theirs back after each turn they compute in, as the plan counts them.
    schedule = step_schedule(FACTS)
    memory = _model()
    plan = plan_memory(schedule, memory, GpuBudget(room_mb * MB), planned_roles=("actor", "critic"))
    gpus, actor, critic, _ = _gpus()
    groups = {"actor": actor, "critic": critic}
    gpus.start_asleep(schedule)
    _take(gpus, schedule, groups, None)
    gpus.use_plans(
        lambda s: plan, {"actor": TAGS, "critic": TAGS}, {r: memory.nbytes(r) for r in memory.tags()}
    )
    _take(gpus, schedule, groups, plan)  # the first planned step leaves the whole-role state
    for group in groups.values():
        group.calls.clear()
    _take(gpus, schedule, groups, plan)
    emptied = {role for role, group in groups.items() if ("empty_cache", None) in group.calls}
    expected = {
        t.turn.role
        for i, t in enumerate(plan.turns)
        if t.turn.role in groups
        and t.turn.work is not None
        and not any(ref[0] == t.turn.role for ref in plan.moves((i + 1) % len(plan.turns))[0])
    } - plan.keeps_cache
    assert emptied == expected, f"keeps {sorted(plan.keeps_cache)}; emptied {sorted(emptied)}"
    assert plan.keeps_cache == {"400": {"actor", "critic"}, "230": {"actor"}, "150": set()}[str(room_mb)], (
        plan.describe()
    )


@pytest.mark.parametrize("room_mb", [150, 400])
def test_on_shared_gpus_the_plan_keeps_the_engines_memory_where_it_has_room(room_mb: int) -> None:
    # The engines' tags are the plan's too (`planned_roles`): with room for everything they release nothing
    # (resident mode: their CUDA graphs stay); with less, they release what the plan says, the KV cache
    # first, and hold both tags whenever they generate or take the weights.
    schedule = step_schedule(FACTS)
    memory = _model()
    roles = planned_roles(schedule)
    assert roles == {"actor", "critic", "engine"}
    plan = plan_memory(schedule, memory, GpuBudget(room_mb * MB), planned_roles=roles)
    gpus, actor, critic, _ = _gpus()
    engines = gpus.engines
    assert isinstance(engines, FakeEngines)
    groups = {"actor": actor, "critic": critic}
    gpus.start_asleep(schedule)
    _take(gpus, schedule, groups, None)  # the first step runs whole: the engines release and resume
    assert ("release_memory", ["weights", "kv_cache"]) in engines.calls
    engines.resume_memory()  # the weight sync's resume, which `_take` does not run
    tags = {"actor": TAGS, "critic": TAGS, "engine": ["weights", "kv_cache"]}
    gpus.use_plans(lambda s: plan, tags, {r: memory.nbytes(r) for r in memory.tags()})
    for step in range(2):
        engines.calls.clear()
        gpus.begin_step(schedule)
        for index, turn in enumerate(schedule.turns):
            gpus.enter(index)
            gpus.before(turn)
            want = {tag for role, tag in plan.turns[index].asleep if role == "engine"}
            assert engines.released_tags == want, (
                f"step {step} {turn.describe()}: {sorted(engines.released_tags)}"
            )
            if turn.role == "engine":
                assert gpus.awake("engine") and not engines.released_tags, (
                    "the engines work with all their memory"
                )
            gpus.after(turn)
    if room_mb == 400:
        assert engines.calls == [], "with room for everything the engines release nothing"
        assert plan.moved() == frozenset()
    else:
        released = [tags for verb, tags in engines.calls if verb == "release_memory"]
        assert released and "kv_cache" in released[0], f"the KV cache goes first: {engines.calls}"


def _plan_with_a_background_wake() -> tuple[StepSchedule, MemoryModel, MemoryPlan]:
    """A plan of 100 MB (the engines' tags planned too) whose actor's log-probs turn wakes the critic's
    moments in its background, for the critic's train after it."""
    train = {"weights": 5 * MB, "grads": 5 * MB, "main_params": 10 * MB, "optimizer_moments": 30 * MB}
    memory = MemoryModel(
        {
            "engine": RoleMemory({"weights": 5 * MB, "kv_cache": 40 * MB}, fixed=MB),
            "actor": RoleMemory(train, fixed=MB),
            "critic": RoleMemory(dict(train), fixed=MB),
        },
        {
            ("engine", "generate"): 4 * MB,
            ("actor", "log_probs"): 2 * MB,
            ("critic", "train"): 8 * MB,
            ("actor", "train"): 8 * MB,
            ("engine", "weights"): 2 * MB,
        },
    )
    schedule = step_schedule(FACTS)
    plan = plan_memory(
        schedule, memory, GpuBudget(100 * MB), planned_roles=planned_roles(schedule), prefetch=True
    )
    return schedule, memory, plan


def test_a_wake_in_the_background_runs_beside_the_turns_work_and_the_next_turn_waits_for_it() -> None:
    # The critic's moments wake in the background of the actor's log-probs (the plan's `prefetch`): its
    # workers' wake and the turn's work meet at a barrier, which a wake made before the work never would.
    schedule, memory, plan = _plan_with_a_background_wake()
    log_probs = next(i for i, t in enumerate(plan.turns) if t.turn.work == "log_probs")
    assert plan.turns[log_probs].prefetch == {("critic", "optimizer_moments")}
    meeting = Meeting()
    gpus, actor, critic, events = _gpus(meeting)
    actor.meeting = None  # its own moves go on; the turn's work stands for it at the barrier
    groups = {"actor": actor, "critic": critic}
    gpus.start_asleep(schedule)
    _take(gpus, schedule, groups, None)
    tags = {"actor": TAGS, "critic": TAGS, "engine": ["weights", "kv_cache"]}
    gpus.use_plans(lambda s: plan, tags, {r: memory.nbytes(r) for r in memory.tags()})
    _take(gpus, schedule, groups, plan)  # the first planned step leaves the whole-role state
    gpus.begin_step(schedule)
    for index, turn in enumerate(schedule.turns):
        meeting.arm(index == log_probs)
        gpus.enter(index)
        gpus.before(turn)
        if index == log_probs:
            meeting.wait("actor")  # the turn's work, while the critic's moments wake
        for role, group in groups.items():  # a tag waking in the background may not be awake yet
            background = {t for r, t in plan.turns[index].prefetch if r == role}
            want = {t for r, t in plan.turns[index].asleep if r == role}
            assert group.asleep - background == want, f"{turn.describe()}: {role} has {sorted(group.asleep)}"
        gpus.after(turn)
    assert meeting.met == 1, "the background wake met the turn's work"
    assert ("wake", {"role": "critic", "tags": ["optimizer_moments"], "prefetch": True}) in events.recorded
    assert "time/critic_wake" in gpus.clock.values, "what was left to wait for, timed as the role's wake"


def test_a_background_wake_that_fails_is_raised_at_the_next_entry_and_made_again_there() -> None:
    # The critic's moments fail to wake in the log-probs turn's background: entering the critic's train
    # raises the workers' error (nothing of the turn's own moves made yet), the tags are as they were (asleep),
    # and entering again makes the wake, so the train finds them awake.
    schedule, memory, plan = _plan_with_a_background_wake()
    log_probs = next(i for i, t in enumerate(plan.turns) if t.prefetch)
    gpus, actor, critic, _ = _gpus()
    gpus.start_asleep(schedule)
    _take(gpus, schedule, {"actor": actor, "critic": critic}, None)
    tags = {"actor": TAGS, "critic": TAGS, "engine": ["weights", "kv_cache"]}
    gpus.use_plans(lambda s: plan, tags, {r: memory.nbytes(r) for r in memory.tags()})
    gpus.begin_step(schedule)
    for index in range(log_probs):
        gpus.enter(index)
    critic.fail = "wake_up"
    gpus.enter(log_probs)  # the wake goes to the background: the turn itself goes on
    with pytest.raises(RuntimeError, match="critic: wake_up failed"):
        gpus.enter(log_probs + 1)
    assert "optimizer_moments" in critic.asleep, "the failed wake changed nothing"
    gpus.enter(log_probs + 1)
    assert not critic.asleep & {t for r, t in plan.turns[log_probs + 1].needs if r == "critic"}


def test_a_train_that_fits_no_other_way_is_told_to_wake_its_state_for_its_steps_alone(tmp_path: Path) -> None:
    """The workers' figures split each train into its passes and its optimizer steps (`train/passes`,
    `train/optimizer_step`); with 90 MB a train fits only with its moments asleep through the passes (3 + 40 +
    max(20, 40 + 2) = 85 MB, against 103 MB with them awake): each train role is told so once, as its train
    turn is entered, and the turns find the plan's tags asleep."""
    schedule = step_schedule(FACTS)
    # (No background wakes: `_take` looks at each turn's tags as it is entered.)
    figures = MemoryFigures(_model(), GpuBudget(90 * MB), {"actor": TAGS, "critic": TAGS}, prefetch=False)
    gpus, actor, critic, _ = _gpus()
    groups = {"actor": actor, "critic": critic}
    gpus.start_asleep(schedule)
    with pytest.raises(PlanError, match="needs"):  # without the split the plan cannot fit the trains
        plan_memory(schedule, figures.model, figures.budget, planned_roles=("actor", "critic"))
    _take(gpus, schedule, groups, None)  # the first step runs whole, and its workers report their figures
    for group in groups.values():
        group.peaks = {"train": 20 * MB, "train/passes": 20 * MB, "train/optimizer_step": 2 * MB}
    figures = replan_if_grown(gpus, figures, tmp_path)  # and the plans are made from them
    split = TrainSplit(20 * MB, 2 * MB)
    assert figures.model.train_splits == {"actor": split, "critic": split}
    plan = plan_memory(
        schedule,
        figures.model,
        figures.budget,
        planned_roles=planned_roles(schedule),
        prefetch=figures.prefetch,
    )
    for _ in range(2):
        _take(gpus, schedule, groups, plan)
    assert gpus.plan == plan
    trains = [t for t in plan.turns if t.turn.work == "train"]
    assert [sorted(t.at_step) for t in trains] == [
        [("critic", "optimizer_moments")],
        [("actor", "optimizer_moments")],
    ]
    for group in groups.values():
        told = [tags for method, tags in group.calls if method == "keep_asleep_for_passes"]
        assert told == [["optimizer_moments"]], "told once, as its first train turn was entered"
    assert '"at_step": [\n     "critic/optimizer_moments"' in (tmp_path / "memory_plan.json").read_text()
