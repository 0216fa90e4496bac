"""The actor's and the critic's memory tags asleep as the step's memory plan says (`--memory-plan fit`).

`PlannedMoves` is the memory-plan side of `shared_gpus.SharedGpus` (a mixin: the roles, who is
awake and the whole-role lifecycle are SharedGpus's). With plans (`use_plans`), before each turn
(`enter`) the train roles put to sleep and wake the tags the plan has asleep at that turn
(`memory_plan.MemoryPlan`), sleeps first, or, where the plan finds room for both
(`PlannedTurn.at_once`) and `overlap_moves` is on, the moves of different roles at once, each
role's in its own order, timed together as the phase `handover`: one role's copy to the host
beside another's copy back (the two directions of the host link), its process groups torn down
beside the other's reload. Each move is a phase of the step's clock (`time/<role>_sleep`,
`time/<role>_wake`, or `time/handover`) and an event (`sleep` / `wake` with the role and its tags,
`at_once` where they ran at once); `moved_bytes` counts what the step moved.

A train turn whose plan keeps some of its role's optimizer state asleep through the passes
(`PlannedTurn.at_step`) tells the role's workers so as it is entered (`keep_asleep_for_passes`): their train
wakes those tags for each optimizer step alone and puts them back after it.

On shared GPUs the plan also chooses the engines' memory tags (`weights`, `kv_cache`; `planned_roles`):
where it has room they stay on the GPU, so the engines release nothing and keep their CUDA graphs, as in
resident mode; otherwise they release what the plan says (`time/engine_release`, `time/engine_resume`, the
events `engine_release` / `engine_resume` with the tags), one after the other: their sleeps before the
train roles' moves, their wakes after.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tandem.ppo.loop.memory_plan import MemoryPlan
from tandem.ppo.loop.schedule import TRAIN_ROLES, Role, StepSchedule, Turn, asleep_between_steps

if TYPE_CHECKING:
    from tandem.megatron.group import TrainGroup
    from tandem.ppo.engines import EngineGroup
    from tandem.ppo.run.log import EventLog, PhaseClock

__all__ = ["PlannedMoves"]


class PlannedMoves:
    """The train roles' tags asleep at each turn as the memory plan has them (mixin of `SharedGpus`, which
    gives `events`, `clock`, who is awake and each role's `group`)."""

    events: EventLog
    clock: PhaseClock
    engines: EngineGroup
    _awake: set[Role]

    def group(self, role: Role) -> TrainGroup:
        raise NotImplementedError  # SharedGpus's

    def _init_plans(self) -> None:
        self.plan: MemoryPlan | None = None
        """The memory plan of the step under way (`begin_step`); None: whole-role wakes and sleeps."""
        self.moved_bytes = 0
        """Bytes the plan's tag sleeps and wakes moved since `begin_step` (each tag's model figure)."""
        self._tag_bytes: dict[tuple[Role, str], int] = {}
        self._tags: dict[Role, list[str]] = {}
        """Each planned role's memory tags (`use_plans`): the train roles', and the engines'."""
        self._asleep_tags: dict[Role, set[str]] = {}
        """The tags each of those roles has asleep now (kept once `use_plans` is called)."""
        self.planning: Callable[[StepSchedule], MemoryPlan] | None = None
        """The planner `use_plans` gave: each schedule's memory plan."""
        self.overlap_moves = True
        """Under a plan, run a turn's moves of different roles at once where the plan has room for both
        (`PlannedTurn.at_once`; `--overlap-moves`); False: sleeps first, one role after the other."""
        self._pending: dict[Role, tuple[list[str], Future[list[dict[str, float]]]]] = {}
        """Each train role's wakes under way in the background (`PlannedTurn.prefetch`), waited for by the
        next move (`_settle`)."""
        self._background: ThreadPoolExecutor | None = None
        self._entered: int | None = None
        """The turn of the step's plan entered last (`enter`); None before the step's first."""
        self._at_step: dict[Role, list[str]] = {}
        """The tags each train role's workers were last told to keep asleep through their passes (`_step_wakes`)."""

    def use_plans(
        self,
        planner: Callable[[StepSchedule], MemoryPlan],
        tags: dict[Role, list[str]],
        tag_bytes: dict[tuple[Role, str], int],
    ) -> None:
        """From the next `begin_step` on, the roles the plans choose for (`MemoryPlan.planned_roles`: the train
        roles, and on shared GPUs the engines) sleep by tag as `planner(schedule)` says.

        `tags`: each such role's memory tags (a train role's workers' `memory_tags()`, the engines'
        `weights` and `kv_cache`); `tag_bytes`: each tag's bytes (the memory model's, for `moved_bytes`). The
        roles' tags asleep now: as the last plan left them where plans ran before (figures planned again
        between two planned steps), else as who is awake says (the whole-role state).
        """
        self.planning, self._tags, self._tag_bytes = planner, {r: list(t) for r, t in tags.items()}, tag_bytes
        known = self._asleep_tags
        self._asleep_tags = {
            r: set(known[r]) if r in known else set() if r in self._awake else set(t)
            for r, t in self._tags.items()
        }

    def drop_plans(self, schedule: StepSchedule) -> None:
        """No plan from now on: each role the plans chose for back to the whole-role state `schedule` starts
        from (`asleep_between_steps`: every tag of a role it starts asleep asleep, every tag of the others
        awake; the sleeps first, so that no moment holds more than either state), and every train role's
        workers told to keep nothing asleep through their passes. The schedule's own wakes and sleeps move
        whole roles after it, as they did before the first plan."""
        self._settle()
        self.planning, self.plan, self._entered = None, None, None
        asleep = asleep_between_steps(schedule)
        sleeps = {r: set(self._tags[r]) - tags for r, tags in self._asleep_tags.items() if r in asleep}
        wakes = {r: set(tags) for r, tags in self._asleep_tags.items() if r not in asleep}
        for role, tags in sleeps.items():
            if tags and role == "engine":
                self._move_engine_tags(sleep=self._ordered(role, tags))
            elif tags:
                self._move_tags(role, sleep=tags)
        for role, tags in wakes.items():
            if tags and role == "engine":
                self._move_engine_tags(wake=self._ordered(role, tags))
            elif tags:
                self._move_tags(role, wake=tags)
        for role, at_step in self._at_step.items():
            if at_step:
                self.group(role).run("keep_asleep_for_passes", [])
        self._at_step = {}

    def begin_step(self, schedule: StepSchedule) -> None:
        """The step about to run takes `schedule`: its memory plan, where `use_plans` gave a planner."""
        self.moved_bytes = 0
        self._entered = None
        self.plan = self.planning(schedule) if self.planning is not None else None

    def enter(self, index: int) -> None:
        """Before turn `index` of the step's schedule: the train roles' tags asleep as the plan says, sleeps
        first (so no moment holds more than the turn after it), or the roles' moves at once where the plan
        has room for that (`_at_once`); nothing without a plan. The moves go from
        the tags asleep now, so entering a turn twice (the rollout's draw entered a reward model's turn
        already, another round of sampling enters the generate turn again) moves nothing the second time.

        A train role that computed in the turn before and sleeps nothing now hands its allocator's cached
        blocks back (`empty_cache`): the next role's process cannot use them; but not where the plan has
        room for them (`MemoryPlan.keeps_cache`): then its next phase allocates nothing anew.
        """
        if self.plan is None or index == self._entered:
            return  # entered already (the draw enters the generate turn the step entered): nothing to move
        self._settle()
        target = self.plan.turns[index].asleep
        background = self.plan.turns[index].prefetch
        previous = self.plan.turns[index - 1].turn
        computed = (
            previous.work is not None
            and index > 0
            and previous.role in TRAIN_ROLES
            and self._planned(previous.role)
            and previous.role not in self.plan.keeps_cache
        )
        moves: dict[Role, tuple[list[str], list[str]]] = {}
        for role, asleep in self._asleep_tags.items():
            if self._planned(role):
                later = {
                    tag for r, tag in background if r == role and tag in asleep
                }  # woken after, in the background
                want = {tag for r, tag in target if r == role} | later
                moves[role] = (self._ordered(role, want - asleep), self._ordered(role, asleep - want))
        engine_sleep, engine_wake = moves.pop("engine", ([], []))
        if engine_sleep:  # the engines' sleeps first, their wakes last: one after the other, never at once
            self._move_engine_tags(sleep=engine_sleep)
        self._move_train_tags(index, moves, computed, previous.role)
        if engine_wake:
            self._move_engine_tags(wake=engine_wake)
        for role in {r for r, _ in background}:
            tags = self._ordered(role, {t for r, t in background if r == role} & self._asleep_tags[role])
            if tags:
                self._prefetch(role, tags)
        self._step_wakes(index)
        self._entered = index  # its moves made: entering it again moves nothing

    def _step_wakes(self, index: int) -> None:
        """Tell the role that trains in turn `index` which of its tags its train keeps asleep through the passes
        and wakes for each optimizer step alone (`PlannedTurn.at_step`, `keep_asleep_for_passes`), where that
        changed since it was last told."""
        assert self.plan is not None
        turn = self.plan.turns[index]
        role = turn.turn.role
        if turn.turn.work != "train" or role not in TRAIN_ROLES or not self._planned(role):
            return
        tags = self._ordered(role, {t for r, t in turn.at_step if r == role})
        if self._at_step.get(role, []) != tags:
            self.group(role).run("keep_asleep_for_passes", tags)
            self._at_step[role] = tags

    def _prefetch(self, role: Role, tags: list[str]) -> None:
        """Start waking `role`'s `tags` in the background (its workers copy them back while the turn under way
        works on the others'); the next move waits for them (`_settle`)."""
        if self._background is None:
            self._background = ThreadPoolExecutor(2, thread_name_prefix="prefetch")
        self.events.record("wake", role=role, tags=tags, prefetch=True)
        self._pending[role] = (tags, self._background.submit(self.group(role).run, "wake_up", tags))

    def _settle(self) -> None:
        """Wait for the wakes under way in the background, each timed as `time/<role>_wake` (what their
        overlap with the turn before left to wait for), and count them; a failed one is raised once every
        other has ended."""
        failed: BaseException | None = None
        while self._pending:
            role, (tags, future) = self._pending.popitem()
            try:
                with self.clock.phase(f"{role}_wake"):
                    timings = future.result()
            except BaseException as err:  # the others are waited for; raised below
                failed = failed or err
                continue
            self._moved(role, "wake", tags, timings)
        if failed is not None:
            raise failed

    def _move_train_tags(
        self, index: int, moves: dict[Role, tuple[list[str], list[str]]], computed: bool, previous: Role
    ) -> None:
        """The train roles' `moves` (tags to sleep, to wake) into turn `index`: at once where the plan has room
        for it, else sleeps first; the cache of `previous`, the turn before's role, handed back where it
        `computed` there and does not keep it."""
        if self._at_once(index, moves):
            if computed:  # its cached blocks back before anything wakes: the plan's room counts so
                self.group(previous).run("empty_cache")
            self._move_at_once(moves)
            return
        for role, (sleep, _) in moves.items():
            if sleep:
                self._move_tags(role, sleep=set(sleep))
            elif computed and role == previous:
                self.group(role).run("empty_cache")
        for role, (_, wake) in moves.items():
            if wake:
                self._move_tags(role, wake=set(wake))

    def _at_once(self, index: int, moves: dict[Role, tuple[list[str], list[str]]]) -> bool:
        """Whether entering turn `index` makes its roles' `moves` (tags to sleep, to wake) at once: the plan
        has room for it, the roles hold the tags the plan's turn before has asleep (its room is counted
        from there: not so when the first planned step leaves the whole-role state), and two roles or more
        move."""
        assert self.plan is not None
        if not (self.overlap_moves and self.plan.turns[index].at_once):
            return False
        before = {ref for ref in self.plan.turns[index - 1].asleep if ref[0] in moves}
        now = {(role, tag) for role, tags in self._asleep_tags.items() if role in moves for tag in tags}
        return now == before and sum(1 for sleep, wake in moves.values() if sleep or wake) > 1

    def _move_at_once(self, moves: dict[Role, tuple[list[str], list[str]]]) -> None:
        """Each role's moves (its sleeps, then its wakes), the roles at once (a thread each waits for its
        role's workers), timed as one phase, `handover`; each move recorded as `_move_tags` records it, with
        `at_once`. A role's failure is raised once every role's moves have ended, those that completed kept."""
        calls = {
            role: [(verb, tags) for verb, tags in (("sleep", sleep), ("wake", wake)) if tags]
            for role, (sleep, wake) in moves.items()
            if sleep or wake
        }
        for role, mine in calls.items():
            for verb, tags in mine:
                self.events.record(verb, role=role, tags=tags, at_once=True)

        def run(role: Role) -> tuple[list[tuple[str, list[str], Any]], BaseException | None]:
            done = []
            for verb, tags in calls[role]:
                method = "sleep" if verb == "sleep" else "wake_up"
                try:
                    done.append((verb, tags, self.group(role).run(method, tags)))
                except BaseException as err:  # the other roles' moves go on; raised below
                    return done, err
            return done, None

        pool = ThreadPoolExecutor(len(calls), thread_name_prefix="handover")
        with self.clock.phase("handover"), pool:
            results = {role: pool.submit(run, role) for role in calls}
        failed: BaseException | None = None
        for role, future in results.items():
            done, err = future.result()
            for verb, tags, timings in done:
                self._moved(role, verb, tags, timings)
            failed = failed or err
        if failed is not None:
            raise failed

    def _enter_turn_of(self, turn: Turn) -> None:
        """Enter `turn`'s place in the plan where a plan is under way, the turn is in it and its role works
        on the train GPUs beside the actor and the critic, so that their tags are as the plan has them for it.
        Never on GPUs of their own: there the async loop's rollout, drawn on another thread, must not move
        the train roles' tags, and the plan's turns move them in order."""
        plan = self.plan
        if plan is None or not plan.schedule.colocated or turn.role in TRAIN_ROLES:
            return
        if turn in plan.schedule.turns:
            self.enter(plan.schedule.turns.index(turn))

    def _planned(self, role: Role) -> bool:
        """Whether the step's plan chooses `role`'s tags (`MemoryPlan.planned_roles`)."""
        plan = self.plan
        return (
            plan is not None
            and role in self._asleep_tags
            and (plan.planned_roles is None or role in plan.planned_roles)
        )

    def plans(self, role: Role) -> bool:
        """Whether the memory plan under way chooses `role`'s tags: its own turns' wakes and sleeps do nothing
        then, `enter` moves them."""
        return self._planned(role)

    def _move_engine_tags(self, *, sleep: list[str] | None = None, wake: list[str] | None = None) -> None:
        """The engines release `sleep` of their memory tags, or resume `wake`, as the plan says."""
        for verb, tags in (("sleep", sleep), ("wake", wake)):
            if not tags:
                continue
            if verb == "sleep":
                with self.clock.phase("engine_release"):
                    self.engines.release_memory(tags)  # type: ignore[arg-type]
                self.events.record("engine_release", tags=tags)
                self._asleep_tags["engine"] |= set(tags)
            else:
                self.events.record("engine_resume", tags=tags)
                with self.clock.phase("engine_resume"):
                    self.engines.resume_memory(tags)  # type: ignore[arg-type]
                self._asleep_tags["engine"] -= set(tags)
            self.moved_bytes += sum(self._tag_bytes.get(("engine", t), 0) for t in tags)
        if self._asleep_tags["engine"]:
            self._awake.discard("engine")
        else:
            self._awake.add("engine")

    def _ordered(self, role: Role, tags: set[str]) -> list[str]:
        """`tags` in `role`'s own tag order."""
        return [t for t in self._tags[role] if t in tags]

    def _move_tags(self, role: Role, *, sleep: set[str] | None = None, wake: set[str] | None = None) -> None:
        """Put `sleep` of `role`'s tags to sleep, or wake `wake`, in the role's own tag order (once the wakes
        under way in the background are done)."""
        self._settle()
        group = self.group(role)
        for verb, chosen, method in (("sleep", sleep, "sleep"), ("wake", wake, "wake_up")):
            tags = self._ordered(role, chosen or set())
            if not tags:
                continue
            with self.clock.phase(f"{role}_{verb}"):
                self.events.record(verb, role=role, tags=tags)
                self._moved(role, verb, tags, group.run(method, tags))

    def _moved(self, role: Role, verb: str, tags: list[str], timings: list[dict[str, float]]) -> None:
        """What `role`'s move of `tags` (`verb`: sleep or wake) changed: its tags asleep, whether it is awake,
        the step's moved bytes, the workers' `timings`."""
        self.clock.record_lifecycle(f"{role}_{verb}", timings)
        if verb == "sleep":
            self._asleep_tags[role] |= set(tags)
        else:
            self._asleep_tags[role] -= set(tags)
        self.moved_bytes += sum(self._tag_bytes.get((role, t), 0) for t in tags)
        if self._asleep_tags[role] == set(self._tags[role]):
            self._awake.discard(role)
        else:
            self._awake.add(role)
