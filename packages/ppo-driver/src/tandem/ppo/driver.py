"""The PPO driver: it owns the plan (when each model sleeps and wakes); the workers own the mechanism.

One step is its schedule (`schedule.step_schedule`, docs/design.md's "The step's
schedule"), e.g. on shared GPUs: engine: generate, release → critic: wake, train,
sleep → actor: wake, train, sleep → engine: resume, weights. `PPODriver.step`
takes the turns in order (`turns.StepTurns`): the rollout (sampled, scored, a
reward model's wake, score and sleep inside it, split per data-parallel rank),
the KL-first log-probs, the critic, the actor (not in the critic-only warm-up),
the weights to the engines. Checkpoints when due: the driver's state, then the
save's turns (`schedule.save_schedule`: on shared GPUs the engines release, each
model wakes, saves and sleeps, the engines resume with the weights). With `--no-offload-train` nothing sleeps and
the engines keep their memory, so the same run can be compared with both models resident.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.lifecycle import OffloadPlan
from tandem.ppo import startup
from tandem.ppo.config import PPOConfig
from tandem.ppo.hub import resolve_checkpoints
from tandem.ppo.loop import run_loop
from tandem.ppo.reward_model import uses_reward_model
from tandem.ppo.rollout import (
    Rollout,
    Sampled,
    dynamic_sample,
    generate_rollout,
    sampling_params,
    shard_per_role,
    training_rewards,
)
from tandem.ppo.run_checkpoint import save_run_checkpoint
from tandem.ppo.run_folder import RunFolder
from tandem.ppo.run_log import PhaseClock, RunSummary
from tandem.ppo.schedule import StepFacts, StepSchedule, Turn, check_exclusive, save_schedule, step_schedule
from tandem.ppo.state import DriverState, load_state
from tandem.ppo.step_metrics import step_metrics
from tandem.ppo.turns import StepTurns
from tandem.ppo.weight_sync import send_to_restarted, sync_weights

if TYPE_CHECKING:
    from tandem.megatron.group import TrainGroup
    from tandem.placement import Placements
    from tandem.ppo.engines import EngineGroup
    from tandem.ppo.metrics import MetricsLogger
    from tandem.ppo.reward_model._role import RewardModelRole
    from tandem.ppo.run_log import EventLog

logger = logging.getLogger(__name__)


class PPODriver:
    """One PPO run: setup, the loop, checkpoints, eval, and clean shutdown."""

    # Set by `setup` (`startup`), which a run calls before anything else.
    events: EventLog
    tokenizer: Any
    reward_fn: Any
    dataset: Any
    eval_dataset: Any
    start_rollout_id: int
    logger: MetricsLogger

    def __init__(self, config: PPOConfig) -> None:
        config = resolve_checkpoints(config)  # hub ids -> local folders, before the checks read them
        config.validate()
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.plan = OffloadPlan.time_shared() if config.offload_train else OffloadPlan.resident()
        self.facts = StepFacts(
            colocate=config.colocate,
            offload_train=config.offload_train,
            critic=config.use_critic,
            reward_model=uses_reward_model(config),
            kl_first=config.kl_coef != 0 and config.use_critic,
        )
        """What decides each step's schedule (`schedule_of`)."""
        self.release_engines = self.facts.engines_release
        self.metrics_so_far: list[dict[str, Any]] = []
        self._started_ray = False
        self.weights_version = 0
        self.weight_pack: Any = None
        self.clock = PhaseClock(track_gpu_memory=config.gpu_memory_metrics and config.device != "cpu")
        roles: tuple[Any, ...] = ("actor", "critic") if config.use_critic else ("actor",)
        self.data_parallel_sizes = {r: config.data_parallel_size(config.actor_num_gpus, r) for r in roles}
        self.actor: TrainGroup = None  # type: ignore[assignment]  # set by setup
        self.critic: TrainGroup | None = None
        self.engines: EngineGroup = None  # type: ignore[assignment]  # set by setup
        self.placements: Placements | None = None
        self.last_sampled: Sampled | None = None
        self.generating: Future[Sampled] | None = None
        self._driver_log = contextlib.ExitStack()
        self.started_logs = False
        """Whether this start got as far as writing RUN_DIR/logs (its inputs were checked)."""
        self.refused = False
        """Whether this start was refused for its input (a flag the placed workers cannot use): a run
        folder that it created is then removed, logs and all, on `close`."""
        self.eval_before: dict[str, float] | None = None
        self.folder: RunFolder | None = None
        self.engine_restarts = 0
        """Engines restarted so far in this run (`--max-engine-restarts`)."""

        self.reward_model: RewardModelRole | None = None
        self._engines_released_to_score = False

    # --- setup and shutdown (`startup`) ------------------------------------------------------
    def setup(self) -> None:
        """Ray, placement groups, engines and train groups (concurrently), data, reward, logging.

        The run folder is locked first and changed only once everything is up
        (`RunFolder.commit`): a start that fails leaves it as it was. A run whose
        folder holds every rollout already starts nothing (`complete`).
        """
        startup.setup(self)

    @property
    def complete(self) -> bool:
        """Whether the run folder held every rollout already (after `setup`, which then started nothing)."""
        return self.folder is not None and self.folder.complete

    def complete_summary(self) -> RunSummary:
        """The summary of a run that was complete before this start (`complete`)."""
        assert self.folder is not None and self.folder.resume.rollout_id is not None
        last = self.folder.resume.rollout_id
        hf_dir = self.run_dir / "hf"
        metrics = load_state(self.run_dir, last).metrics
        return RunSummary(
            self.run_dir, last, metrics, hf_dir if hf_dir.is_dir() else None, already_complete=True
        )

    def schedule_of(self, rollout_id: int, *, generate_ahead: bool = False) -> StepSchedule:
        """Step `rollout_id`'s turns (`schedule`), checked by `check_exclusive`; `generate_ahead`:
        the async loop generates the next rollout during the step."""
        warm_up = rollout_id < self.config.num_critic_only_steps
        return _checked_schedule(self.facts.replace(warm_up=warm_up, generate_ahead=generate_ahead))

    def _models(self) -> list[TrainGroup]:
        return [g for g in (self.critic, self.actor) if g is not None]

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Run from the resumed rollout to `num_rollout`; checkpoints, eval, the HF export at the end (`loop`)."""
        return run_loop(self)

    def _draw(self, rollout_id: int, background: bool = False) -> Sampled:
        """Step 1, the rollout: sample, score and split rollout `rollout_id` per data-parallel rank.

        `background`: drawn on the async loop's generation thread, outside any step's clock.
        """
        config = self.config
        start = time.perf_counter()
        version = self.weights_version
        self.events.record("generate_begin", rollout_id=rollout_id, weights_version=version)
        seed = config.seed * 1_000_003 + rollout_id
        counts: dict[str, float] = {}
        if config.dynamic_sampling:
            rounds = iter(range(config.dynamic_sampling_max_rounds))
            rollout, counts = dynamic_sample(
                lambda n: self._generate(self.dataset.next_batch(n), seed=seed + 7919 * next(rounds)),
                num_prompts=config.rollout_batch_size,
                n_samples_per_prompt=config.n_samples_per_prompt,
                max_rounds=config.dynamic_sampling_max_rounds,
            )
        else:
            rollout = self._generate(self.dataset.next_batch(config.rollout_batch_size), seed=seed)
        data_state = self.dataset.state_dict()
        rewards, shaping = training_rewards(rollout, config)
        counts.update(shaping)
        data_refs, sample_indices = shard_per_role(
            rollout, self.data_parallel_sizes, rewards=rewards, filter_truncated=config.filter_truncated
        )
        self.events.record("generate_end", rollout_id=rollout_id)
        seconds = {f"time/{k}": v for k, v in rollout.seconds.items()}
        seconds["time/rollout"] = time.perf_counter() - start
        return Sampled(
            rollout_id, rollout, data_refs, sample_indices, data_state, version, counts, seconds, background
        )

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
        config = self.config
        self.clock.reset()
        restarts_before = self.engine_restarts
        step_start = time.perf_counter()
        self.events.record("step_begin", rollout_id=rollout_id)
        schedule = self.schedule_of(rollout_id, generate_ahead=start_next is not None)
        # The schedule's turns in order (docs/design.md, "The step's schedule"): 1. rollout,
        # 2. engines release, 2b. KL-first log-probs, 3. critic, 4. actor, 5. weights
        turns = StepTurns(self, rollout_id, sampled, start_next)
        for turn in schedule.turns:
            turns.take(turn)
        sampled, metrics = turns.rollout, turns.metrics

        seconds = time.perf_counter() - step_start
        self.events.record("step_end", rollout_id=rollout_id, seconds=seconds)
        return step_metrics(
            metrics,
            sampled,
            seconds=seconds,
            clock=self.clock.values,
            rollout_id=rollout_id,
            critic_only=schedule.turn("actor", "train") is None,
            accuracy_threshold=config.accuracy_threshold,
            dropped_prompts=self.dataset.num_dropped,
            restarts=self.engine_restarts - restarts_before,
            restarts_total=self.engine_restarts,
        )

    def _generate(self, prompts: list[Any], *, seed: int, eval_mode: bool = False) -> Rollout:
        config = self.config
        if self._engines_released_to_score:
            # A reward model scored the last batch (another round of dynamic sampling, or an eval):
            # the engines released their memory for it and generate again now.
            self._engines_released_to_score = False
            self.events.record("engine_resume")
            with self._phase("engine_resume"):
                self.engines.resume_memory()
        params = sampling_params(
            config, eos_token_id=self.tokenizer.eos_token_id, seed=seed, eval_mode=eval_mode
        )
        n = config.n_samples_per_eval_prompt if eval_mode else config.n_samples_per_prompt
        return generate_rollout(
            self.engines,
            prompts,
            n_samples_per_prompt=n,
            params=params,
            tokenizer=self.tokenizer,
            reward_fn=self.reward_fn,
        )

    def _score_with_reward_model(self, requests: list[Any]) -> list[float]:
        """Step 1b, the reward model's term: the engines release their memory (on shared GPUs), then
        the reward model wakes, scores prompt + response of every sample, and sleeps again."""
        rm = self.reward_model
        assert rm is not None
        if not rm.sleeps:
            return list(rm.score(requests))
        if not self._engines_released_to_score:
            self._release_engines()
            self._engines_released_to_score = True
        with self._phase("reward_model_wake"):
            self.clock.record_lifecycle("reward_model_wake", rm.wake())
        try:
            with self._phase("reward_model_score"):
                return list(rm.score(requests))
        finally:
            self._sleep_reward_model()

    def _sleep_reward_model(self) -> None:
        assert self.reward_model is not None
        with self._phase("reward_model_sleep"):
            self.clock.record_lifecycle("reward_model_sleep", self.reward_model.sleep())

    def _release_engines(self) -> None:
        """The engines hand their memory back (`engine_release`, its phase and its event)."""
        with self._phase("engine_release"):
            self.engines.release_memory()
        self.events.record("engine_release")

    def _wake(self, group: TrainGroup) -> None:
        with self._phase(f"{group.role}_wake"):
            self.events.record("wake", role=group.role)
            self.clock.record_lifecycle(f"{group.role}_wake", group.wake_up())

    def _sleep(self, group: TrainGroup) -> None:
        with self._phase(f"{group.role}_sleep"):
            self.clock.record_lifecycle(f"{group.role}_sleep", group.sleep())
            self.events.record("sleep", role=group.role)

    def _sync_weights(self, *, resume: bool | None = None) -> None:
        """Step 5: engines' weights back -> the actor's weights into them -> KV cache back (`weight_sync`).

        `resume`: whether the engines take their memory back around the sync (default: when they
        release it in this run's steps).
        """
        sync_weights(
            self.actor,
            self.engines,
            pack=self.weight_pack,
            release_engines=self.release_engines if resume is None else resume,
            events=self.events,
            clock=self.clock,
            adapters=self.config.syncs_adapters,
        )

    def _engine_restarted(self, rank: int, handle: Any) -> None:
        """A restarted engine (`EngineGroup.restart`) starts from the HF folder: give it the actor's weights."""
        self.engine_restarts += 1
        send_to_restarted(
            self.actor,
            self.engines,
            rank,
            handle,
            weights_version=self.weights_version,
            events=self.events,
            adapters=self.config.syncs_adapters,
        )

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        with self.clock.phase(name):
            yield

    # --- checkpoints, eval, export ---------------------------------------------------------------
    def save_schedule(self) -> StepSchedule:
        """A checkpoint save's turns (`schedule.save_schedule`), checked by `check_exclusive`."""
        return _checked_save_schedule(self.facts)

    def save(self, rollout_id: int, data_state: dict[str, Any] | None = None) -> None:
        """The driver's state, then each model, as the save's turns say (`save_schedule`); `data_state`:
        the data cursor right after this rollout (default: the cursor now)."""
        data = self.dataset.state_dict() if data_state is None else data_state
        turns = self.save_schedule().turns

        def save_model(turn: Turn) -> None:
            group = self.critic if turn.role == "critic" else self.actor
            assert group is not None and group.role == turn.role
            if turn.wake_before:
                self._wake(group)
            self.events.record("save", role=group.role, rollout_id=rollout_id)
            group.save_model(rollout_id)
            if turn.sleep_after:
                self._sleep(group)

        state = DriverState.capture(rollout_id, data, self.metrics_so_far)
        saves = [(t.role, functools.partial(save_model, t)) for t in turns if t.work == "save"]
        with self._phase("save"):
            # (An eval's reward model may have had the engines release already.)
            if turns[0].role == "engine" and turns[0].sleep_after and not self._engines_released_to_score:
                self._release_engines()
            # The run's checkpoint of this rollout: the driver state, then each model (run_checkpoint).
            save_run_checkpoint(self.run_dir, state, saves)
            if turns[-1].role == "engine" and turns[-1].work == "weights":
                self._sync_weights(resume=True)
                self._engines_released_to_score = False

    def evaluate(self) -> dict[str, float]:
        """Eval metrics on the eval JSONL (engines awake, holding the latest weights)."""
        assert self.eval_dataset is not None
        with self._phase("eval"):
            prompts = self.eval_dataset.next_batch(len(self.eval_dataset))
            rollout = self._generate(prompts, seed=self.config.seed, eval_mode=True)
        return rollout.metrics(accuracy_threshold=self.config.accuracy_threshold, prefix="eval")

    def export_hf(self) -> Path:
        """The actor as a Hugging Face folder at RUN_DIR/hf."""
        from tandem.ppo.export import export_actor

        with self._phase("export_hf"):
            lora = self.config.actor_config().lora_of("actor")
            return Path(export_actor(self.actor, self.run_dir / "hf", self.config.hf_checkpoint, lora))

    # --- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers and engines, release the placement groups, stop Ray if we started it."""
        startup.close(self)


@functools.cache
def _checked_schedule(facts: StepFacts) -> StepSchedule:
    return check_exclusive(step_schedule(facts))


@functools.cache
def _checked_save_schedule(facts: StepFacts) -> StepSchedule:
    return check_exclusive(save_schedule(facts))


def train(config: PPOConfig) -> RunSummary:
    """Run PPO with `config` (validated first); the summary. Raises `Interrupted` on Ctrl-C, and
    `errors.WorkerDied` naming the worker when a train worker's process dies. The driver's log
    lines also go to `RUN_DIR/logs/driver.log` once the run folder is locked and its inputs checked."""
    from ray.exceptions import RayActorError

    from tandem.ppo.errors import dead_worker
    from tandem.ppo.worker_logs import from_a_worker, note_worker_logs, remove_empty_logs

    driver = PPODriver(config)
    try:
        driver.setup()
        if driver.complete:
            return driver.complete_summary()
        return driver.run()
    except RayActorError as exc:
        # A train worker's process died: name its role, rank, pid and log (the last complete
        # checkpoint stays, and the next start resumes from it).
        died = dead_worker(exc, driver._models(), run_dir=config.run_dir)
        if died is None:
            note_worker_logs(exc, config.run_dir)
            raise
        raise died from exc
    except Exception as exc:
        # Refused input (exit 2) found by the driver itself, not a worker's failure with a log to read.
        driver.refused = isinstance(exc, ValueError) and not from_a_worker(exc)
        note_worker_logs(exc, config.run_dir)  # an error from a worker names its log file
        raise
    finally:
        driver.close()
        if driver.started_logs:
            remove_empty_logs(config.run_dir)
