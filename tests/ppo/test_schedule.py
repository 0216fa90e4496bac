"""The step's schedule: every schedule the facts can build keeps the GPUs exclusive, and a real run follows it.

The property test draws every combination of the facts that decide a step
(shared or resident GPUs, critic, reward model, teacher, KL-first, warm-up, async) and
checks the built schedule against `check_exclusive` and its expected shape, and
so for a checkpoint save's; the checker refuses hand-made bad schedules; a
demo-sized CPU run records its events in the order of each step's schedule and
of its save's.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.ppo.loop.schedule import (
    ScheduleError,
    StepFacts,
    StepSchedule,
    Turn,
    check_exclusive,
    residents_at_each_turn,
    save_schedule,
    step_schedule,
)

from .conftest import KlFirstRun

FACTS = (
    "colocate",
    "offload_train",
    "critic",
    "reward_model",
    "teacher",
    "kl_first",
    "warm_up",
    "generate_ahead",
)


def accepted(facts: StepFacts) -> bool:
    """Whether the config accepts these facts: `--async` is refused with `--colocate`."""
    return not (facts.generate_ahead and facts.colocate)


facts_strategy = st.builds(StepFacts, **{name: st.booleans() for name in FACTS}).filter(accepted)


def index(schedule: StepSchedule, role: str, work: str | None) -> int:
    (i,) = [i for i, t in enumerate(schedule.turns) if t.role == role and t.work == work]
    return i


@given(facts_strategy)
def test_every_schedule_keeps_the_gpus_exclusive_and_has_its_shape(facts: StepFacts) -> None:
    schedule = check_exclusive(step_schedule(facts))
    turns = schedule.turns
    roles = [t.role for t in turns]
    assert turns[0] == Turn("engine", "generate", sleep_after=facts.engines_release)
    if not facts.critic:
        assert "critic" not in roles
        assert schedule.turn("actor", "log_probs") is None
    else:
        critic = index(schedule, "critic", "train")
        if facts.kl_first:
            assert index(schedule, "actor", "log_probs") < critic
        if not facts.warm_up:
            assert critic < index(schedule, "actor", "train")
    if not facts.offload_train:  # resident: nothing sleeps or wakes
        assert not any(t.wake_before or t.sleep_after for t in turns)
    elif not facts.colocate:  # the engines keep their own GPUs; the models time-share theirs
        assert all(t.wake_before and t.sleep_after for t in turns if t.role in ("actor", "critic"))
        rollout_gpus = ("engine", "reward_model", "teacher")
        assert not any(t.wake_before or t.sleep_after for t in turns if t.role in rollout_gpus)
    if facts.warm_up:
        assert schedule.turn("actor", "train") is None
        assert schedule.turn("engine", "weights") is None
        if facts.engines_release:
            assert turns[-1] == Turn("engine", None, wake_before=True)  # the engines just resume
        else:  # nothing to resume
            assert all(t.work is not None for t in turns)
    else:
        assert turns[-1] == Turn("engine", "weights", wake_before=facts.engines_release)
    if facts.reward_model:
        score = index(schedule, "reward_model", "score")
        assert score == 1  # right after the engines generated (and released their memory)
        assert all(score < i for i, t in enumerate(turns) if t.role in ("actor", "critic"))
        turn = turns[score]
        assert turn.wake_before == turn.sleep_after == facts.engines_release
    else:
        assert "reward_model" not in roles
    if facts.teacher:
        # After the rollout and its scores, before anything trains on its log-probs (the KL-first
        # log-probs included) and before the next rollout starts generating.
        teacher = index(schedule, "teacher", "log_probs")
        assert teacher == 1 + facts.reward_model
        later = [i for i, t in enumerate(turns) if t.role in ("actor", "critic") or t.work == "start_next"]
        assert all(teacher < i for i in later)
        turn = turns[teacher]
        assert turn.wake_before == turn.sleep_after == facts.engines_release
    else:
        assert "teacher" not in roles
    assert (schedule.turn("engine", "start_next") is not None) == facts.generate_ahead
    if facts.generate_ahead:
        assert index(schedule, "engine", "start_next") < index(schedule, "engine", "await_next")
    # Time-shared on shared GPUs, every role that computes is the only one awake.
    if facts.engines_release:
        for residents in residents_at_each_turn(schedule):
            if residents.computing:
                assert residents.computing == residents.awake == {residents.turn.role}


@given(facts_strategy)
def test_every_save_keeps_the_gpus_exclusive_and_has_its_shape(facts: StepFacts) -> None:
    schedule = check_exclusive(save_schedule(facts))
    turns = schedule.turns
    saves = [t for t in turns if t.work == "save"]
    assert [t.role for t in saves] == (["critic", "actor"] if facts.critic else ["actor"])
    assert all(t.wake_before == t.sleep_after == facts.offload_train for t in saves)
    engines = [t for t in turns if t.role == "engine"]
    if facts.engines_release:
        # A model's whole state comes back for its save: the engines make room first, then
        # take their memory back with the actor's weights, as at the end of a step.
        assert turns[0] == Turn("engine", None, sleep_after=True)
        assert turns[-1] == Turn("engine", "weights", wake_before=True)
        for residents in residents_at_each_turn(schedule):
            if residents.turn.work == "save":
                assert residents.awake == residents.computing == {residents.turn.role}
    else:
        assert engines == []
    assert save_schedule(facts.replace(warm_up=not facts.warm_up)) == save_schedule(facts)


def test_a_save_beside_engines_that_keep_their_memory_is_refused() -> None:
    # What a save did before it had a schedule: each model woke on the shared GPUs while the
    # engines held their weights and KV cache.
    before = StepSchedule(
        (
            Turn("engine", "generate"),
            Turn("critic", "save", wake_before=True, sleep_after=True),
            Turn("actor", "save", wake_before=True, sleep_after=True),
        ),
        colocated=True,
    )
    with pytest.raises(ScheduleError, match=r"\['critic', 'engine'\] are awake on the shared GPUs"):
        check_exclusive(before)
    shared = save_schedule(StepFacts(colocate=True, offload_train=True, critic=True))
    assert shared.describe() == (
        "engine: release → critic: wake, save, sleep → actor: wake, save, sleep → engine: resume, weights"
    )


def test_every_accepted_combination_is_checked() -> None:
    # All 2^8 combinations (hypothesis draws them; this walks them all once).
    combinations = [
        StepFacts(**dict(zip(FACTS, values, strict=True)))
        for values in itertools.product((False, True), repeat=len(FACTS))
    ]
    assert len(combinations) == 256
    for facts in combinations:
        if accepted(facts):
            check_exclusive(step_schedule(facts))
        elif facts.critic or not facts.warm_up:
            # The async loop on shared GPUs: the next rollout would generate while a model trains.
            with pytest.raises(ScheduleError, match=r"at once|works while asleep"):
                check_exclusive(step_schedule(facts))


def test_the_shared_schedule_reads_as_the_design_says() -> None:
    facts = StepFacts(colocate=True, offload_train=True, critic=True, reward_model=True)
    assert step_schedule(facts).describe() == (
        "engine: generate, release → reward_model: wake, score, sleep → critic: wake, train, sleep"
        " → actor: wake, train, sleep → engine: resume, weights"
    )
    # A teacher whose reverse KL is in the rewards: the critic's returns need the student's log-probs.
    distilled = step_schedule(facts.replace(teacher=True, kl_first=True))
    assert distilled.describe() == (
        "engine: generate, release → reward_model: wake, score, sleep → teacher: wake, log_probs, sleep"
        " → actor: wake, log_probs, sleep → critic: wake, train, sleep → actor: wake, train, sleep"
        " → engine: resume, weights"
    )
    resident = step_schedule(StepFacts(colocate=True, offload_train=False, critic=True, teacher=True))
    assert resident.describe() == (
        "engine: generate → teacher: log_probs → critic: train → actor: train → engine: weights"
    )
    warm_up = step_schedule(facts.replace(warm_up=True, reward_model=False))
    assert warm_up.describe() == "engine: generate, release → critic: wake, train, sleep → engine: resume"
    resident = step_schedule(StepFacts(colocate=True, offload_train=False, critic=False))
    assert resident.describe() == "engine: generate → actor: train → engine: weights"


SHARED = Turn("engine", "generate", sleep_after=True)
CRITIC = Turn("critic", "train", wake_before=True, sleep_after=True)
ACTOR = Turn("actor", "train", wake_before=True, sleep_after=True)
WEIGHTS = Turn("engine", "weights", wake_before=True)


@pytest.mark.parametrize(
    ("turns", "colocated", "why"),
    [
        # The engines keep their memory while the critic trains beside them.
        ((Turn("engine", "generate"), CRITIC, ACTOR, Turn("engine", "weights")), True, "awake on the shared"),
        # The critic trains without being woken.
        ((SHARED, Turn("critic", "train"), CRITIC, ACTOR, WEIGHTS), True, "works while asleep"),
        # The critic is never put back to sleep: it is awake when the actor wakes.
        ((SHARED, Turn("critic", "train", wake_before=True), ACTOR, WEIGHTS), True, "awake on the shared"),
        # The next rollout generates on the train GPUs while the actor trains.
        (
            (Turn("engine", "generate"), Turn("engine", "start_next"), Turn("actor", "train")),
            True,
            "compute on the shared GPUs at once",
        ),
        # The weights go to the engines before the next rollout was waited for.
        (
            (
                Turn("engine", "generate"),
                Turn("engine", "start_next"),
                Turn("actor", "train"),
                Turn("engine", "weights"),
                Turn("engine", "await_next"),
            ),
            False,
            "still generating in the background",
        ),
        # The engines are released and never come back.
        ((SHARED, CRITIC, ACTOR, Turn("engine", "weights")), True, "works while asleep"),
    ],
)
def test_check_exclusive_refuses_a_bad_schedule(turns: tuple[Turn, ...], colocated: bool, why: str) -> None:
    with pytest.raises(ScheduleError, match=why):
        check_exclusive(StepSchedule(turns, colocated=colocated))


def test_residents_follow_the_turns() -> None:
    schedule = step_schedule(StepFacts(colocate=True, offload_train=True, critic=True, kl_first=True))
    seen = [
        (r.turn.describe(), sorted(r.awake), sorted(r.computing)) for r in residents_at_each_turn(schedule)
    ]
    assert seen == [
        ("engine: generate, release", ["engine"], ["engine"]),
        ("actor: wake, log_probs, sleep", ["actor"], ["actor"]),
        ("critic: wake, train, sleep", ["critic"], ["critic"]),
        ("actor: wake, train, sleep", ["actor"], ["actor"]),
        ("engine: resume, weights", ["engine"], ["engine"]),
    ]


# --- a real run follows its schedule -------------------------------------------------------------

_LIFECYCLE = {"reward_model": ("rm_wake", "rm_sleep")}
_WORK_EVENT = {
    "generate": "generate_begin",
    "score": "score_begin",
    "log_probs": "log_probs_begin",
    "train": "train_begin",
    "weights": "weight_sync",
    "save": "save",
}
STEP_EVENTS = {"generate_begin", "score_begin", "log_probs_begin", "train_begin", "weight_sync"}
STEP_EVENTS |= {"wake", "sleep", "rm_wake", "rm_sleep"}


def expected_events(schedule: StepSchedule) -> list[str]:
    """The events of the schedule's turns, in order, as `role_event` names (the engines' lifecycle has none)."""
    out: list[str] = []
    for t in schedule.turns:
        wake, sleep = _LIFECYCLE.get(t.role, ("wake", "sleep"))
        if t.wake_before and t.role != "engine":
            out.append(f"{t.role}:{wake}")
        if t.work in _WORK_EVENT:
            out.append(f"{t.role}:{_WORK_EVENT[t.work]}")
        if t.sleep_after and t.role != "engine":
            out.append(f"{t.role}:{sleep}")
    return out


def steps_events(events: list[dict[str, Any]]) -> dict[int, list[str]]:
    """Each step's events of `STEP_EVENTS` as `role:event` (the engine's and reward model's have their role)."""
    out: dict[int, list[str]] = {}
    current: int | None = None
    for e in events:
        if e["event"] == "step_begin":
            current = e["rollout_id"]
            out[current] = []
        elif e["event"] == "step_end":
            current = None
        elif current is not None and e["event"] in STEP_EVENTS:
            default = "engine" if e["event"] in ("generate_begin", "weight_sync") else "reward_model"
            out[current].append(f"{e.get('role') or default}:{e['event']}")
    return out


def save_events(events: list[dict[str, Any]]) -> list[str]:
    """The events of the save after the run's last step, as `expected_events` names them (the
    engines' release is an event of its own here)."""
    last_end = max(i for i, e in enumerate(events) if e["event"] == "step_end")
    out = []
    for e in events[last_end + 1 :]:
        if e["event"] == "engine_release":
            out.append("engine:release")
        elif e["event"] in {"wake", "sleep", "save", "weight_sync"}:
            out.append(f"{e.get('role') or 'engine'}:{e['event']}")
    return out


def check_run_follows_its_schedules(events: list[dict[str, Any]], schedules: list[StepSchedule]) -> None:
    """Every step's events come in the order of its schedule's turns."""
    recorded = steps_events(events)
    assert sorted(recorded) == list(range(len(schedules)))
    for k, schedule in enumerate(schedules):
        assert recorded[k] == expected_events(schedule), (k, schedule.describe())


@pytest.mark.slow
def test_a_cpu_run_records_its_events_in_the_schedules_order(kl_first_run: KlFirstRun) -> None:
    """Shared and time-shared, KL-first, one critic-only warm-up step (tests/ppo/conftest.py's run)."""
    schedules = kl_first_run.schedules
    assert schedules[0].describe() == (
        "engine: generate, release → actor: wake, log_probs, sleep → critic: wake, train, sleep → engine: resume"
    )
    events = kl_first_run.events
    check_run_follows_its_schedules(events, schedules)
    # The final step's checkpoint, after it: the engines make room for each model's save.
    save = kl_first_run.save
    assert save.describe() == (
        "engine: release → critic: wake, save, sleep → actor: wake, save, sleep → engine: resume, weights"
    )
    assert save_events(events) == ["engine:release", *expected_events(save)]
