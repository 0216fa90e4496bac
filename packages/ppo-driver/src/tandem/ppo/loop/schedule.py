"""The step's schedule: which role takes the GPUs when during one PPO step, and its lifecycle around it.

The driver owns the plan (docs/design.md, "The step's schedule"); this module is
that plan as data. `step_schedule(facts)` builds the ordered turns of one step
from the facts of the run that decide it (`StepFacts`), e.g. on shared GPUs with
a reward model and a distillation teacher:

    engine: generate, release → reward_model: wake, score, sleep → teacher: wake, log_probs, sleep
    → actor: wake, log_probs, sleep → critic: wake, train, sleep → actor: wake, train, sleep
    → engine: resume, weights

`PPODriver.step` executes the turns in order, dispatching on each turn's work;
`save_schedule(facts)` is a checkpoint save's turns between two steps, which
`PPODriver.save` takes;
the wakes and sleeps in them are the driver's decision, never a worker's.
`check_exclusive` replays a schedule and refuses one in which two roles compute
on the same GPUs at once, or a role that time-shares them is awake beside
another. Pure: no Ray, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Residents",
    "Role",
    "ScheduleError",
    "StepFacts",
    "StepSchedule",
    "Turn",
    "Work",
    "asleep_between_steps",
    "check_exclusive",
    "residents_at_each_turn",
    "save_schedule",
    "step_schedule",
]

Role = Literal["engine", "reward_model", "teacher", "actor", "critic"]
Work = Literal["generate", "score", "log_probs", "train", "start_next", "await_next", "weights", "save"]
"""What a turn does:

- `generate`: the engines sample the step's rollout (in the async loop, rollouts after the
  first were generated during the step before, and are taken as they are);
- `score`: the reward model scores every sample; taken by each round of the rollout's
  sampling, after the engines' generation and before the rule rewards (dynamic sampling
  decides on each round's rewards);
- `log_probs`: the teacher's log-probs of every sample (on-policy distillation; taken once the rollout is
  drawn, after its rounds of sampling and before the split into per-rank batches, which carry them), or
  the actor's old and reference log-probs (the KL-first plan);
- `train`: the role's train step on the rollout;
- `start_next` / `await_next`: the async loop's next rollout starts generating on the
  engines' own GPUs / is waited for;
- `weights`: the actor's weights into the engines;
- `save`: the role's model into the run's checkpoint (a save between two steps, `save_schedule`).
"""

TRAIN_ROLES: frozenset[Role] = frozenset({"actor", "critic"})
_WORDS: dict[Role, tuple[str, str]] = {"engine": ("resume", "release")}  # (wake, sleep) as the role says them


class ScheduleError(ValueError):
    """A schedule that lets two roles compute on the same GPUs at once, or breaks a role's lifecycle."""


@dataclass(frozen=True)
class Turn:
    """One role's turn: wake (when `wake_before`), do `work` (None: the lifecycle alone), sleep (`sleep_after`).

    For the engines, waking is resuming their memory (weights, KV cache) and sleeping is
    releasing it.
    """

    role: Role
    work: Work | None
    wake_before: bool = False
    sleep_after: bool = False

    def describe(self) -> str:
        """The turn as "critic: wake, train, sleep"."""
        wake, sleep = _WORDS.get(self.role, ("wake", "sleep"))
        steps = [wake] if self.wake_before else []
        steps += [self.work] if self.work is not None else []
        steps += [sleep] if self.sleep_after else []
        return f"{self.role}: {', '.join(steps)}"


@dataclass(frozen=True)
class StepSchedule:
    """One step's turns in order, and whether the engines' GPUs are the train GPUs (`colocated`)."""

    turns: tuple[Turn, ...]
    colocated: bool

    def describe(self) -> str:
        """The human-readable line: "engine: generate, release → critic: wake, train, sleep → ..."."""
        return " → ".join(t.describe() for t in self.turns)

    def turn(self, role: Role, work: Work) -> Turn | None:
        """The first turn of `role` doing `work`, None when the step has none."""
        return next((t for t in self.turns if t.role == role and t.work == work), None)

    def works(self) -> frozenset[tuple[Role, Work]]:
        """Each role's work in the step, as (role, work)."""
        return frozenset((t.role, t.work) for t in self.turns if t.work is not None)

    def gpus(self, role: Role) -> str:
        """The GPUs `role` runs on: the actor and critic on the train GPUs, engines, reward model and
        teacher on the rollout GPUs, and all of them on the same ones when colocated."""
        if self.colocated:
            return "shared"
        return "train" if role in TRAIN_ROLES else "rollout"


@dataclass(frozen=True)
class StepFacts:
    """The facts of a run that decide its step's schedule.

    Attributes:
        colocate: the engines run on the train GPUs (`--colocate`).
        offload_train: the actor and critic sleep between their turns (`--offload-train`); with
            `colocate` the engines release their memory for them and a reward model and a teacher
            sleep too.
        critic: the run has a critic (GAE; a critic-free `--advantage-estimator` has none).
        reward_model: a reward model scores the rollout (`--rm-type model`).
        teacher: a distillation teacher gives the rollout's log-probs (`--teacher-hf-checkpoint`).
        kl_first: the actor's log-probs come before the critic trains (`kl_coef != 0` with a critic).
        warm_up: a critic-only warm-up step (`--num-critic-only-steps`): no actor turn, no weights.
        generate_ahead: the async loop generates the next rollout during this step (`--async`).
    """

    colocate: bool
    offload_train: bool
    critic: bool
    reward_model: bool = False
    teacher: bool = False
    kl_first: bool = False
    warm_up: bool = False
    generate_ahead: bool = False

    @property
    def engines_release(self) -> bool:
        """Whether the engines hand their memory back for the models (shared GPUs, time-shared)."""
        return self.colocate and self.offload_train

    def replace(self, **changes: bool) -> StepFacts:
        """These facts with `changes`."""
        return dataclasses.replace(self, **changes)


def step_schedule(facts: StepFacts) -> StepSchedule:
    """The turns of one step, in order, as docs/design.md's "One PPO step" and "The step's schedule" say.

    The reward model scores after the engines released their memory and before any model
    trains, and the teacher's log-probs follow (the rollout's rewards first, then what the
    models train on beside them); the critic trains before the actor so that the actor's advantages use the
    baseline the critic trained against; the weights reach the engines last, once the
    async loop's next rollout is generated.
    """
    release = facts.engines_release
    sleeps = facts.offload_train
    turns = [Turn("engine", "generate", sleep_after=release)]
    if facts.reward_model:
        turns.append(Turn("reward_model", "score", wake_before=release, sleep_after=release))
    if facts.teacher:
        turns.append(Turn("teacher", "log_probs", wake_before=release, sleep_after=release))
    if facts.generate_ahead:
        turns.append(Turn("engine", "start_next"))
    if facts.kl_first and facts.critic:
        turns.append(Turn("actor", "log_probs", wake_before=sleeps, sleep_after=sleeps))
    if facts.critic:
        turns.append(Turn("critic", "train", wake_before=sleeps, sleep_after=sleeps))
    if not facts.warm_up:
        turns.append(Turn("actor", "train", wake_before=sleeps, sleep_after=sleeps))
    if facts.generate_ahead:
        turns.append(Turn("engine", "await_next"))
    if not facts.warm_up:
        turns.append(Turn("engine", "weights", wake_before=release))
    elif release:
        turns.append(Turn("engine", None, wake_before=True))
    return StepSchedule(tuple(turns), colocated=facts.colocate)


def save_schedule(facts: StepFacts) -> StepSchedule:
    """The turns of a checkpoint save between two steps: each model wakes, saves and sleeps.

    The critic saves before the actor (the driver's order). A model's save needs its whole
    training state on the GPU, so on shared, time-shared GPUs the engines release their
    memory first, as they do for a train, and take it back last with the actor's weights
    (`weights`: a released engine need not keep its weights; SGLang's keeps them only
    when started to back them up).
    """
    release = facts.engines_release
    sleeps = facts.offload_train
    turns = [Turn("engine", None, sleep_after=True)] if release else []
    if facts.critic:
        turns.append(Turn("critic", "save", wake_before=sleeps, sleep_after=sleeps))
    turns.append(Turn("actor", "save", wake_before=sleeps, sleep_after=sleeps))
    if release:
        turns.append(Turn("engine", "weights", wake_before=True))
    return StepSchedule(tuple(turns), colocated=facts.colocate)


@dataclass(frozen=True)
class Residents:
    """Who holds GPU memory (`awake`) and who computes (`computing`, background work included) during a turn."""

    turn: Turn
    awake: frozenset[Role]
    computing: frozenset[Role]


def residents_at_each_turn(schedule: StepSchedule) -> list[Residents]:
    """Replay `schedule`: who holds memory and who computes while each turn works; ScheduleError on a conflict.

    A role starts the step asleep when its first lifecycle call in the schedule is a wake,
    else awake, and must end it as it started (the next step starts from the same state).
    The rules, on each set of GPUs (`StepSchedule.gpus`):

    - a role wakes only when asleep, sleeps only when awake, and computes only when awake;
    - at most one role computes at a time (the async loop's background generation counts
      from `start_next` to `await_next`);
    - a role that time-shares the GPUs (it sleeps or wakes in this schedule) is awake only
      when no other role there is, and no role computes beside it.
    """
    sharing = frozenset(t.role for t in schedule.turns if t.wake_before or t.sleep_after)
    roles = {t.role for t in schedule.turns}
    start = frozenset(roles - asleep_between_steps(schedule))
    awake = set(start)
    background: set[Role] = set()
    out: list[Residents] = []

    def refuse(turn: Turn, why: str) -> ScheduleError:
        return ScheduleError(f"{turn.describe()!r} in {schedule.describe()!r}: {why}")

    def check(turn: Turn, computing: set[Role]) -> None:
        for gpus in {schedule.gpus(r) for r in roles}:
            here = {r for r in awake if schedule.gpus(r) == gpus}
            busy = {r for r in computing if schedule.gpus(r) == gpus}
            if len(busy) > 1:
                raise refuse(turn, f"{sorted(busy)} compute on the {gpus} GPUs at once")
            shared = here & sharing
            if shared and len(here) > 1:
                raise refuse(turn, f"{sorted(here)} are awake on the {gpus} GPUs at once")

    for t in schedule.turns:
        if t.wake_before:
            if t.role in awake:
                raise refuse(t, f"{t.role} is woken while awake")
            awake.add(t.role)
        if t.work is not None:
            if t.role not in awake:
                raise refuse(t, f"{t.role} works while asleep")
            if t.role in background and t.work != "await_next":
                raise refuse(t, f"{t.role} works while still generating in the background")
        computing = set(background)
        if t.work == "start_next":
            background.add(t.role)
            computing.add(t.role)
        elif t.work == "await_next":
            if t.role not in background:
                raise refuse(t, "nothing was started to wait for")
            background.discard(t.role)
        elif t.work is not None:
            computing.add(t.role)
        check(t, computing)
        out.append(Residents(t, frozenset(awake), frozenset(computing)))
        if t.sleep_after:
            if t.role not in awake:
                raise refuse(t, f"{t.role} sleeps while asleep")
            awake.discard(t.role)
    if background:
        raise ScheduleError(f"{schedule.describe()!r}: {sorted(background)} still generating at the end")
    if frozenset(awake) != start:
        raise ScheduleError(
            f"{schedule.describe()!r}: ends with {sorted(awake)} awake, started with {sorted(start)}"
        )
    return out


def asleep_between_steps(schedule: StepSchedule) -> frozenset[Role]:
    """The roles that `schedule` starts asleep (and so ends asleep): those whose first lifecycle call in it
    is a wake. The start of a run puts them to sleep once they are up (`SharedGpus.start_asleep`)."""
    first: dict[Role, bool] = {}
    for t in schedule.turns:
        if t.wake_before or t.sleep_after:
            first.setdefault(t.role, t.wake_before)
    return frozenset(role for role, wakes in first.items() if wakes)


def check_exclusive(schedule: StepSchedule) -> StepSchedule:
    """`schedule` once `residents_at_each_turn` found no two roles computing on the same GPUs at once."""
    residents_at_each_turn(schedule)
    return schedule
