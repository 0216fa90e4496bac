"""The PPO driver: it owns the plan (when each model sleeps and wakes); the workers own the mechanism.

One step is its schedule (`schedule.step_schedule`, docs/design.md's "The step's
schedule"), e.g. on shared GPUs: engine: generate, release → critic: wake, train,
sleep → actor: wake, train, sleep → engine: resume, weights. `PPODriver.step`
takes the turns in order (`turns.StepTurns`) on the roles on the GPUs
(`shared_gpus.SharedGpus`, the one owner of who is awake): the rollout
(`drawing.RolloutDrawing`: each round of sampling takes the engines' `generate` turn and a reward model's `score` turn,
then the rule rewards; the drawn rollout takes a teacher's `log_probs` turn; the
rollout is split per data-parallel rank), the KL-first
log-probs, the critic, the actor (not in the critic-only warm-up), the weights to
the engines. Checkpoints when due: the driver's state, then the save's turns
(`schedule.save_schedule`: on shared GPUs the engines release, each model wakes,
saves and sleeps, the engines resume with the weights). With `--no-offload-train`
nothing sleeps and the engines keep their memory, so the same run can be compared
with both models resident.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.ppo.config.hub import resolve_checkpoints
from tandem.ppo.config.ppo_config import PPOConfig
from tandem.ppo.loop import startup
from tandem.ppo.loop.drawing import RolloutDrawing
from tandem.ppo.loop.hints import RunHints
from tandem.ppo.loop.out_of_memory import out_of_memory
from tandem.ppo.loop.run_loop import run_loop
from tandem.ppo.loop.schedule import (
    StepFacts,
    StepSchedule,
    Turn,
    check_exclusive,
    save_schedule,
    step_schedule,
)
from tandem.ppo.loop.step_metrics import kl_coef_of_step, step_metrics
from tandem.ppo.loop.step_plans import StepPlans
from tandem.ppo.loop.turns import StepTurns
from tandem.ppo.rollout.preflight import read_inputs
from tandem.ppo.rollout.reward_model import uses_reward_model
from tandem.ppo.rollout.samples import (
    Sampled,
)
from tandem.ppo.rollout.teacher import uses_teacher
from tandem.ppo.run.checkpoint import check_free_space, prune_checkpoints, save_run_checkpoint
from tandem.ppo.run.export import export_actor
from tandem.ppo.run.folder import model_folders
from tandem.ppo.run.log import EventLog, PhaseClock, RunSummary
from tandem.ppo.run.state import DriverState, load_state, metrics_before, state_dir
from tandem.ppo.run.worker_logs import driver_log

if TYPE_CHECKING:
    from tandem.megatron.choices import Role
    from tandem.megatron.group import TrainGroup
    from tandem.placement import Placements
    from tandem.ppo.engines import EngineGroup
    from tandem.ppo.loop.shared_gpus import SharedGpus
    from tandem.ppo.rollout.data import PromptDataset
    from tandem.ppo.rollout.episodes.generation import EpisodeSetup
    from tandem.ppo.rollout.reward_mix import RewardMix
    from tandem.ppo.rollout.reward_model import RewardModelRole
    from tandem.ppo.rollout.rewards import RewardFunction
    from tandem.ppo.rollout.teacher import TeacherRole
    from tandem.ppo.run.folder import RunFolder
    from tandem.ppo.run.metrics import MetricsLogger

__all__ = ["PPODriver", "RunSummary"]

# The name its lines show on the terminal, kept from before the layers.
logger = logging.getLogger("tandem.ppo.driver")


class PPODriver:
    """One PPO run: setup, the loop, checkpoints, eval, and clean shutdown."""

    # Set by `setup`, which a run calls before anything else.
    events: EventLog
    gpus: SharedGpus
    placements: Placements
    tokenizer: Any
    reward_fn: RewardFunction | RewardMix
    dataset: PromptDataset
    eval_dataset: PromptDataset | None
    episodes: EpisodeSetup | None
    """How episodes are played (`--env-path`, `--custom-generate-function-path`); None: single-turn."""
    start_rollout_id: int
    logger: MetricsLogger
    hints: RunHints
    drawing: RolloutDrawing
    """How the run draws its rollouts (step 1's turns, and an eval's sampling)."""

    def __init__(self, config: PPOConfig) -> None:
        config = resolve_checkpoints(config)  # hub ids -> local folders, before the checks read them
        config.validate()
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.facts = StepFacts(
            colocate=config.colocate,
            offload_train=config.offload_train,
            critic=config.use_critic,
            reward_model=uses_reward_model(config),
            teacher=uses_teacher(config),
            kl_first=config.kl_first,
        )
        """What decides each step's schedule (`schedule_of`)."""
        self.metrics_so_far: list[dict[str, Any]] = []
        self.clock = PhaseClock(track_gpu_memory=config.gpu_memory_metrics and config.device != "cpu")
        roles: tuple[Role, ...] = ("actor", "critic") if config.use_critic else ("actor",)
        self.data_parallel_sizes: dict[str, int] = {
            r: config.data_parallel_size(config.actor_num_gpus, r) for r in roles
        }
        self.last_sampled: Sampled | None = None
        self.generating: Future[Sampled] | None = None
        self.started_logs = False
        """Whether this start got as far as writing RUN_DIR/logs (its inputs were checked)."""
        self.refused = False
        """Whether this start was refused for its input (a flag the placed workers cannot use): a run
        folder that it created is then removed, logs and all, on `close`."""
        self.eval_before: dict[str, float] | None = None
        self.folder: RunFolder | None = None
        self._closing = contextlib.ExitStack()
        """How to stop what `setup` started, in reverse order (`close`)."""
        self.stopping_now = False
        """A signal stopped the run in the middle of a step: `close` kills the workers without asking them
        to finish first."""
        self.plans = StepPlans(lambda: self.config, self.run_dir)
        """This start's memory plan as its steps take it (`--memory-plan`; loop/step_plans.py)."""

    # --- setup and shutdown ------------------------------------------------------------------

    def new_drawing(self) -> RolloutDrawing:
        """The rollout's turns over this driver's roles, data and config (read at each draw: a bench's
        cells and tests change `config` between steps)."""
        return RolloutDrawing(
            lambda: self.config,
            self.gpus,
            events=self.events,
            clock=self.clock,
            dataset=self.dataset,
            tokenizer=self.tokenizer,
            reward_fn=self.reward_fn,
            episodes=self.episodes,
            data_parallel_sizes=self.data_parallel_sizes,
            schedule=self.between_steps,
        )

    def setup(self) -> None:
        """Ray, placement groups, engines and train groups (concurrently), data, reward, logging.

        The run folder is locked first and changed only once everything is up
        (`RunFolder.commit`): a start that fails leaves it as it was. A run whose
        folder holds every rollout already starts nothing (`complete`).
        """
        config, closing = self.config, self._closing
        # 1. The run folder: locked, where it resumes found; nothing else written yet.
        self.folder = startup.open_folder(config, closing, refused=lambda: self.refused)
        if self.folder.complete:
            return
        self.events = EventLog(self.run_dir / "events.jsonl", defer=True)
        closing.callback(startup.quietly(self.events.close))
        # 2. The inputs, each checked before Ray starts.
        inputs = read_inputs(config)
        self.tokenizer, self.reward_fn = inputs.tokenizer, inputs.reward_fn
        self.dataset, self.eval_dataset = inputs.dataset, inputs.eval_dataset
        self.episodes = inputs.episodes
        # 3. Ray; from here on a failure is the run's own (the workers'): its lines go to RUN_DIR/logs.
        startup.start_cluster(config, self.run_dir, closing)
        closing.enter_context(driver_log(self.run_dir))
        self.started_logs = True
        # Until the progress bar shows, the terminal would say nothing for the minute or so this takes on a CPU.
        models = "the actor, the critic and the engine" if config.use_critic else "the actor and the engine"
        logger.info("Ray is up; starting the workers: %s load %s", models, config.hf_checkpoint)
        # 4. The roles on the GPUs, the models asleep where the schedule keeps them asleep between
        #    steps (the engine needs the GPU first); then the reward model and the teacher, likewise.
        self.placements, self.gpus = startup.start_roles(
            config,
            self.folder,
            events=self.events,
            clock=self.clock,
            closing=closing,
            stopping_now=lambda: self.stopping_now,
        )
        self.gpus.start_asleep(self.between_steps())
        self.gpus.keep_engine_stats = config.may_plan_memory
        self.gpus.overlap_moves = config.overlap_moves
        if self.episodes is not None:  # an episode's context is the engines'
            limits = dataclasses.replace(self.episodes.limits, max_context=self.engines.max_context_len)
            self.episodes = dataclasses.replace(self.episodes, limits=limits)
        if self.facts.reward_model:
            startup.start_reward(config, self.placements, self.gpus, events=self.events)
            self.gpus.start_asleep(self.between_steps())
        if self.facts.teacher:
            startup.start_teacher(config, self.placements, self.gpus, events=self.events)
            self.gpus.start_asleep(self.between_steps())
        self.drawing = self.new_drawing()
        # 5. The resumed rollout: data cursor, RNG, metrics; the engines get the resumed actor's weights.
        self.start_rollout_id, self.metrics_so_far = startup.resume(self.folder, self.gpus, self.dataset)
        self.hints = RunHints(
            config, self.engines.weight_magnitudes(), events=self.events, before=self.metrics_so_far
        )
        # 6. Everything is up: the run folder changes now, and the metrics start.
        self.folder.commit()
        self.events.start()
        self.logger = startup.open_metrics(config, self.start_rollout_id, closing)
        self.clock.on_begin = self.logger.status  # the bar names the phase under way

    def close(self) -> None:
        """Stop what `setup` started: the metrics, the workers and engines, the placement groups, Ray if this
        start started it, the run folder's lock."""
        self._closing.close()

    @property
    def complete(self) -> bool:
        """Whether the run folder held every rollout already (after `setup`, which then started nothing)."""
        return self.folder is not None and self.folder.complete

    def complete_summary(self) -> RunSummary:
        """The summary of a run that was complete before this start (`complete`)."""
        assert self.folder is not None and self.folder.resume.rollout_id is not None
        last = self.folder.resume.rollout_id
        hf_dir = self.run_dir / "hf"
        metrics = metrics_before(self.run_dir, last + 1, load_state(self.run_dir, last))
        return RunSummary(
            self.run_dir, last, metrics, hf_dir if hf_dir.is_dir() else None, already_complete=True
        )

    # --- the roles (`SharedGpus`) ---------------------------------------------------------------
    @property
    def actor(self) -> TrainGroup:
        return self.gpus.actor

    @property
    def critic(self) -> TrainGroup | None:
        return self.gpus.critic

    @property
    def engines(self) -> EngineGroup:
        return self.gpus.engines

    @property
    def reward_model(self) -> RewardModelRole | None:
        return self.gpus.reward_model

    @property
    def teacher(self) -> TeacherRole | None:
        return self.gpus.teacher

    # --- the plan ----------------------------------------------------------------------------
    def schedule_of(self, rollout_id: int, *, generate_ahead: bool = False) -> StepSchedule:
        """Step `rollout_id`'s turns (`schedule`), checked by `check_exclusive`; `generate_ahead`:
        the async loop generates the next rollout during the step."""
        warm_up = rollout_id < self.config.num_critic_only_steps
        return _checked_schedule(self.facts.replace(warm_up=warm_up, generate_ahead=generate_ahead))

    def between_steps(self) -> StepSchedule:
        """A full step's schedule (no warm-up): who it keeps asleep between steps is who sleeps at the start."""
        return _checked_schedule(self.facts)

    def save_schedule(self) -> StepSchedule:
        """A checkpoint save's turns (`schedule.save_schedule`), checked by `check_exclusive`."""
        return _checked_save_schedule(self.facts)

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Run from the resumed rollout to `num_rollout`; checkpoints, eval, the HF export at the end (`loop`)."""
        return run_loop(self)

    def draw(self, rollout_id: int, background: bool = False) -> Sampled:
        """Step 1, the rollout `rollout_id`: sampled, scored, the teacher's log-probs, split per data-parallel
        rank (`drawing.RolloutDrawing.draw`). `background`: drawn on the async loop's generation thread,
        outside any step's clock."""
        return self.drawing.draw(rollout_id, background)

    def step(
        self,
        rollout_id: int,
        sampled: Sampled | None = None,
        *,
        start_next: Callable[[], Future[Sampled]] | None = None,
    ) -> dict[str, Any]:
        """One PPO step, the turns of its schedule (`schedule_of`), on `sampled` (drawn now when None); its metrics.

        `time/step` is this call's wall clock, read once from one timer: it includes the
        rollout when the step draws it, and not when `sampled` was drawn before the call.
        `start_next`: called once this step's rollout is in hand, to start generating the next
        one on the engines (async loop; kept in `self.generating`); the weights go to the
        engines only once that generation is done. The step's rollout is `self.last_sampled`.
        """
        self.clock.reset()
        restarts_before = self.gpus.engine_restarts
        step_start = time.perf_counter()
        self.events.record("step_begin", rollout_id=rollout_id)
        schedule = self.schedule_of(rollout_id, generate_ahead=start_next is not None)
        self.plans.begin(self.gpus, schedule)  # its memory plan, or whole roles (loop/step_plans.py)
        # The schedule's turns in order (docs/design.md, "The step's schedule"): 1. rollout (its
        # scores and the teacher's log-probs), 2. engines release, 2b. KL-first log-probs, 3. critic,
        # 4. actor, 5. weights
        turns = StepTurns(
            self.gpus,
            rollout_id,
            sampled=sampled,
            draw=functools.partial(self.draw, rollout_id),
            start_next=start_next,
            kl_coef=kl_coef_of_step(self.config, self.metrics_so_far),
        )
        for index, turn in enumerate(schedule.turns):
            self.take_turn(turns, index, turn)
        self.plans.end(self.gpus, schedule)  # the next step counts what this one needed
        self.last_sampled, self.generating = turns.rollout, turns.generating

        seconds = time.perf_counter() - step_start
        self.events.record("step_end", rollout_id=rollout_id, seconds=seconds)
        metrics = step_metrics(
            turns.metrics,
            turns.rollout,
            seconds=seconds,
            clock=self.clock.values,
            rollout_id=rollout_id,
            critic_only=schedule.turn("actor", "train") is None,
            accuracy_threshold=self.config.accuracy_threshold,
            n_samples_per_prompt=self.config.n_samples_per_prompt,
            dropped_prompts=self.dataset.num_dropped,
            restarts=self.gpus.engine_restarts - restarts_before,
            restarts_total=self.gpus.engine_restarts,
        )
        if self.gpus.plan is not None:
            metrics["memory/moved_gib"] = self.gpus.moved_bytes / 2**30
        # Why a run may not be learning, said once each, never while the reward rises (loop/hints.py).
        metrics.update(self.hints.after_step(rollout_id, metrics, turns.rollout.rollout))
        return metrics

    def take_turn(self, turns: StepTurns, index: int, turn: Turn) -> None:
        """Turn `index` of the step: the memory plan's tag sleeps and wakes (nothing without a plan), then the
        turn's work. An out-of-memory error gains a note: the turn, the plan's figures for it, the flags that
        give it room."""
        try:
            self.gpus.enter(index)
            turns.take(turn)
        except Exception as exc:
            if out_of_memory(exc):
                exc.add_note(self.plans.note(self.gpus, index, turn))
            raise

    # --- checkpoints, eval, export ---------------------------------------------------------------
    def save(self, rollout_id: int, data_state: dict[str, Any] | None = None) -> None:
        """The driver's state, then each model, as the save's turns say (`save_schedule`); `data_state`:
        the data cursor right after this rollout (default: the cursor now)."""
        gpus = self.gpus
        data = self.dataset.state_dict() if data_state is None else data_state
        turns = self.save_schedule().turns
        # Room for it, as the last save took (known after the first): else stop before writing anything.
        check_free_space([*(m.save for m in model_folders(self.config) if m.save), state_dir(self.run_dir)])

        def save_model(index: int) -> None:
            turn = turns[index]
            gpus.before(turn)
            gpus.events.record("save", role=turn.role, rollout_id=rollout_id)
            gpus.group(turn.role).save_model(rollout_id)
            gpus.after(turn)

        state = DriverState.capture(rollout_id, data, self.metrics_so_far)
        saves = [(t.role, functools.partial(save_model, i)) for i, t in enumerate(turns) if t.work == "save"]
        with gpus.phase("save"):
            for turn in turns:
                if (
                    turn.work is None
                ):  # the engines make room (an eval's reward model may have had them do so)
                    gpus.before(turn)
                    gpus.after(turn)
            # The run's checkpoint of this rollout: the driver state, then each model (run_checkpoint).
            save_run_checkpoint(self.run_dir, state, saves)
            prune_checkpoints(self.run_dir, model_folders(self.config), keep=self.config.keep_checkpoints)
            if any(t.work == "weights" for t in turns):
                gpus.sync_weights()

    def evaluate(self) -> dict[str, float]:
        """Eval metrics on the eval JSONL (engines awake, holding the latest weights)."""
        assert self.eval_dataset is not None
        with self.gpus.phase("eval"):
            prompts = self.eval_dataset.next_batch(len(self.eval_dataset))
            rollout = self.drawing.sample(prompts, seed=self.config.seed, eval_mode=True, label="eval")
        return rollout.metrics(
            accuracy_threshold=self.config.accuracy_threshold,
            prefix="eval",
            n_samples_per_prompt=self.config.n_samples_per_eval_prompt,
        )

    def export_hf(self) -> Path:
        """The actor as a Hugging Face folder at RUN_DIR/hf."""
        with self.gpus.phase("export_hf"):
            lora = self.config.actor_config().lora_of("actor")
            return Path(export_actor(self.actor, self.run_dir / "hf", self.config.hf_checkpoint, lora))


@functools.cache
def _checked_schedule(facts: StepFacts) -> StepSchedule:
    return check_exclusive(step_schedule(facts))


@functools.cache
def _checked_save_schedule(facts: StepFacts) -> StepSchedule:
    return check_exclusive(save_schedule(facts))
