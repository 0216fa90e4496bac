"""The roles on the run's GPUs and their lifecycle state: who is awake, the engines' memory, the first sleep.

`SharedGpus` holds the run's roles (the rollout engines, a reward model, a
distillation teacher, the critic's and the actor's train groups) and is the one place that wakes them and puts them to
sleep. The step's turns, a checkpoint's save and the start-up act through its
methods; what they ask for is the schedule's (`schedule.Turn`'s wake before and sleep
after), never a role's own initiative. It knows who is awake, so a role is woken only
when asleep and put to sleep only when awake: the engines release their memory once
for a reward model's score, and the generate turn's release that follows finds them
released already; an eval or another round of dynamic sampling that generates again
takes their memory back first (`ready`).

Each lifecycle step is a phase of the step's clock (`time/<role>_wake`,
`time/<role>_sleep`, `time/engine_release`, `time/engine_resume`) with the roles'
own timings (`lifecycle/...`) and an event in events.jsonl (`wake` / `sleep` with the
role, `engine_release`, `engine_resume`; the forward-only roles record their own: the
reward model `rm_wake` / `rm_sleep`, the teacher `wake` / `sleep` with its role).

With a memory plan (`--memory-plan fit`, `use_plans`), the actor and the critic, and on shared
GPUs the engines, sleep by memory tag instead (`planned_moves.PlannedMoves`, which this class is):
before each turn (`enter`) the tags the plan has asleep at that turn, and their own turns' wakes and
sleeps do nothing; a save between steps wakes what a train role has asleep and puts it back after.
The other roles keep the schedule's whole-role wakes and sleeps, which the plan counts as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, Protocol

from tandem.ppo.loop.planned_moves import PlannedMoves
from tandem.ppo.loop.schedule import TRAIN_ROLES, Role, StepSchedule, Turn, asleep_between_steps
from tandem.ppo.loop.weight_sync import send_to_restarted, sync_weights

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from tandem.megatron.group import TrainGroup
    from tandem.ppo.engines import EngineGroup
    from tandem.ppo.rollout.reward_model import RewardModelRole
    from tandem.ppo.rollout.teacher import TeacherRole
    from tandem.ppo.run.log import EventLog, PhaseClock

__all__ = ["SharedGpus"]

TrainRole = Literal["actor", "critic"]

FORWARD_ROLES: tuple[Role, ...] = ("reward_model", "teacher")
"""The forward-only roles on the rollout GPUs (`rollout.forward`): each wakes, computes and sleeps as a whole."""


class ForwardRole(Protocol):
    """What `SharedGpus` asks of a forward-only role (`RewardModelRole`, `TeacherRole`): its lifecycle, each
    step's timings per worker (the role records its own events)."""

    def wake(self) -> list[dict[str, float]]: ...

    def sleep(self) -> list[dict[str, float]]: ...

    def shutdown(self) -> None: ...


SLEEP_ORDER: tuple[Role, ...] = ("critic", "actor", "reward_model", "teacher", "engine")
"""The order in which the roles that sleep between steps go to sleep at the start (the models first,
so that a reward model or a teacher started after them loads onto a GPU they have left)."""


class SharedGpus(PlannedMoves):
    """The roles of a run on its GPUs, awake or asleep; every wake and sleep goes through here.

    All roles start awake, as their processes start. `weights_version` is the step whose
    weights the engines hold; `engine_restarts`, the engines restarted so far (each given
    those weights, `EngineGroup.on_restart`).
    """

    def __init__(
        self,
        *,
        engines: EngineGroup,
        actor: TrainGroup,
        critic: TrainGroup | None,
        events: EventLog,
        clock: PhaseClock,
        weight_pack: Callable[..., Any] | None = None,
        sync_adapters: bool = False,
    ) -> None:
        self.engines = engines
        self.actor = actor
        self.critic = critic
        self.reward_model: RewardModelRole | None = None
        self.teacher: TeacherRole | None = None
        self.events = events
        self.clock = clock
        self.weight_pack = weight_pack
        """The engines' `ipc_payload` where actor rank r and engine r share a GPU, else None (CPU copies)."""
        self.sync_adapters = sync_adapters
        """A LoRA actor's weight syncs send its adapters alone (`PPOConfig.syncs_adapters`)."""
        self.weights_version = 0
        self.weight_changes: dict[str, float] | None = None
        """What the last weight sync changed in the engines' weights (`weight_sync.sync_weights`)."""
        self.engine_restarts = 0
        self._awake: set[Role] = {"engine", "actor"}
        if critic is not None:
            self._awake.add("critic")
        engines.on_restart = self._engine_restarted
        self._init_plans()
        self._woken_for_save: dict[Role, set[str]] = {}
        self.keep_engine_stats = False
        """Keep the engines' `memory_stats` as they release their memory (`engine_stats`): their KV cache is
        built then, which the memory plan counts (`--memory-plan fit`)."""
        self.engine_stats: list[dict[str, float]] | None = None

    # --- the roles ------------------------------------------------------------------------------
    def add_reward_model(self, reward_model: RewardModelRole) -> None:
        """The run's reward model, started (awake) on the rollout bundles."""
        self.reward_model = reward_model
        self._awake.add("reward_model")

    def add_teacher(self, teacher: TeacherRole) -> None:
        """The run's distillation teacher, started (awake) on the rollout bundles."""
        self.teacher = teacher
        self._awake.add("teacher")

    def forward_role(self, role: Role) -> ForwardRole:
        """The forward-only role `role` (`reward_model` or `teacher`), started."""
        found: ForwardRole | None = {"reward_model": self.reward_model, "teacher": self.teacher}.get(role)
        assert found is not None, f"no {role} started"
        return found

    def models(self) -> list[TrainGroup]:
        """The train groups, the critic's first (the order they train and save in)."""
        return [g for g in (self.critic, self.actor) if g is not None]

    def group(self, role: Role) -> TrainGroup:
        """The train group of `role` (`actor` or `critic`)."""
        group = self.critic if role == "critic" else self.actor if role == "actor" else None
        assert group is not None and group.role == role, f"no train group of role {role!r}"
        return group

    def roles(self) -> list[Role]:
        """The roles this run has."""
        present: list[Role] = ["engine", "actor"]
        present += ["critic"] if self.critic is not None else []
        present += ["reward_model"] if self.reward_model is not None else []
        present += ["teacher"] if self.teacher is not None else []
        return present

    # --- the lifecycle ----------------------------------------------------------------------------
    def awake(self, role: Role) -> bool:
        """Whether `role` holds its GPU memory now (the engines: their weights and KV cache)."""
        return role in self._awake

    def before(self, turn: Turn) -> None:
        """What `turn` asks before its work: its role woken. Under a memory plan a train role's turn in the
        step asks nothing (`enter` woke what it touches), and a save wakes what the role has asleep; a
        reward model's or a teacher's turn, which the rollout's draw takes inside the generate turn,
        first enters its own turn of the plan (`enter`)."""
        self._enter_turn_of(turn)
        if self._planned(turn.role):
            if turn.role not in TRAIN_ROLES:  # the engines: `enter` moved their tags
                return
            if turn.work == "save" or (turn.work is None and turn.wake_before):
                woken = set(self._asleep_tags[turn.role])
                self._move_tags(turn.role, wake=woken)
                self._woken_for_save[turn.role] = woken
            return
        if turn.wake_before:
            self.wake(turn.role)

    def after(self, turn: Turn) -> None:
        """What `turn` asks after its work: its role put to sleep. Under a memory plan a train role's turn
        in the step asks nothing (the next turn's `enter` sleeps what the plan says); a save puts back
        to sleep what its `before` woke."""
        if self._planned(turn.role):
            if turn.role in TRAIN_ROLES:
                self._move_tags(turn.role, sleep=self._woken_for_save.pop(turn.role, set()))
            return
        if turn.sleep_after:
            self.sleep(turn.role)

    @contextlib.contextmanager
    def turn(self, turn: Turn) -> Iterator[None]:
        """`turn`'s wake, the `with` block (its work), its sleep, also when the work fails (a failed
        score leaves no reward model awake beside the next role)."""
        self.before(turn)
        try:
            yield
        finally:
            self.after(turn)

    def ready(self, role: Role) -> None:
        """`role` is about to work: the engines take their memory back if a turn released it (another
        round of dynamic sampling, or an eval, after a reward model's score); any other role must be
        awake already, as its turn's wake saw to."""
        if role == "engine":
            generate = self.plan.schedule.turn("engine", "generate") if self.plan is not None else None
            if (
                generate is not None
            ):  # the planned roles' tags as the plan has them while the engines generate
                self._enter_turn_of(generate)
            if not self._planned("engine"):
                self.wake("engine")
        assert self.awake(role), f"{role} works while asleep"

    def wake(self, role: Role) -> None:
        """Wake `role` (the engines resume their memory); nothing when it is awake."""
        if self.awake(role):
            return
        if role == "engine":
            self.events.record("engine_resume")
            with self.clock.phase("engine_resume"):
                self.engines.resume_memory()
        elif role in FORWARD_ROLES:
            with self.clock.phase(f"{role}_wake"):
                self.clock.record_lifecycle(f"{role}_wake", self.forward_role(role).wake())
        else:
            group = self.group(role)
            with self.clock.phase(f"{role}_wake"):
                self.events.record("wake", role=role)
                self.clock.record_lifecycle(f"{role}_wake", group.wake_up())
        if role in self._asleep_tags:  # a role the plans choose for: every tag awake
            self._asleep_tags[role] = set()
        self._awake.add(role)

    def sleep(self, role: Role) -> None:
        """Put `role` to sleep (the engines release their memory); nothing when it is asleep."""
        if not self.awake(role):
            return
        if role == "engine":
            if self.keep_engine_stats and self.engine_stats is None:
                self.engine_stats = self.engines.all("memory_stats")
            with self.clock.phase("engine_release"):
                self.engines.release_memory()
            self.events.record("engine_release")
        elif role in FORWARD_ROLES:
            with self.clock.phase(f"{role}_sleep"):
                self.clock.record_lifecycle(f"{role}_sleep", self.forward_role(role).sleep())
        else:
            group = self.group(role)
            with self.clock.phase(f"{role}_sleep"):
                self.clock.record_lifecycle(f"{role}_sleep", group.sleep())
                self.events.record("sleep", role=role)
        if role in self._asleep_tags:  # a role the plans choose for: every tag asleep
            self._asleep_tags[role] = set(self._tags[role])
        self._awake.discard(role)

    def start_asleep(self, schedule: StepSchedule) -> None:
        """Put to sleep the roles (of those started so far) that `schedule` keeps asleep between steps:
        those whose first lifecycle call in it is a wake (`schedule.asleep_between_steps`)."""
        asleep = asleep_between_steps(schedule)
        for role in SLEEP_ORDER:
            if role in asleep and role in self.roles():
                self.sleep(role)

    # --- the engines' weights -----------------------------------------------------------------------
    def sync_weights(self, weights_version: int | None = None) -> None:
        """The actor's weights into the engines (`weight_sync.sync_weights`); engines that released their
        memory take it back around the sync (weights first, then the KV cache). `weights_version`: the
        step whose weights they now hold (None: as before)."""
        self.weight_changes = sync_weights(
            self.actor,
            self.engines,
            pack=self.weight_pack,
            release_engines=not self.awake("engine"),
            events=self.events,
            clock=self.clock,
            adapters=self.sync_adapters,
        )
        self._awake.add("engine")
        if "engine" in self._asleep_tags:  # every engine tag back, as the sync took them
            self._asleep_tags["engine"] = set()
        if weights_version is not None:
            self.weights_version = weights_version

    def _engine_restarted(self, rank: int, handle: ActorHandle) -> None:
        """A restarted engine (`EngineGroup.restart`) starts from the HF folder: give it the actor's weights."""
        self.engine_restarts += 1
        send_to_restarted(
            self.actor,
            self.engines,
            rank,
            handle,
            weights_version=self.weights_version,
            events=self.events,
            adapters=self.sync_adapters,
        )

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the `with` block as the step's phase `name` (`time/<name>`)."""
        with self.clock.phase(name):
            yield

    # --- shutdown -----------------------------------------------------------------------------------
    def shutdown(self, *, graceful: bool = True) -> None:
        """Stop the engines, the forward-only roles and the train groups, each on its own (one failure to stop
        does not keep the others running).

        `graceful` False (a signal stopped the run in the middle of a step): the train workers are killed
        without a shutdown call, which each would answer only once it finished the call under way.
        """
        if graceful:
            with contextlib.suppress(Exception):
                self._settle()  # the wakes under way in the background
            with contextlib.suppress(Exception):
                self.engines.shutdown()
            for forward in (self.reward_model, self.teacher):
                if forward is not None:
                    with contextlib.suppress(Exception):
                        forward.shutdown()
        for group in self.models():
            if graceful:
                with contextlib.suppress(Exception):
                    group.shutdown()
            with contextlib.suppress(Exception):
                group.kill()
