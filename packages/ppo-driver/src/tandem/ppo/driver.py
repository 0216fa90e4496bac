"""The PPO driver: it owns the plan (when each model sleeps and wakes); the workers own the mechanism.

One step, exactly as docs/design.md's "One PPO step" says:

1. rollout: the engines sample `rollout_batch_size * n_samples_per_prompt`
   responses, rewards are computed, the batch is split per data-parallel rank
   and put in Ray's object store; a reward model (`--rm-type model`) scores once
   the engines have released their memory: wake, score, sleep (`_score_with_reward_model`);
2. the engines release their GPU memory (weights, KV cache);
3. critic: wake, train (old values, GAE returns, value loss), sleep; it
   returns its old values per rank (GAE only: with a critic-free
   `--advantage-estimator` no critic exists, and the step has no critic phase);
4. actor: wake, train with the critic's per-rank results as `critic=` (`CriticValues` inside),
   sleep (skipped during the critic-only warm-up);
5. weights: the engines resume their weights, the actor (asleep) sends its
   weights, the engines flush and resume their KV cache (skipped in warm-up,
   where the engines just resume);
6. checkpoint when due: the driver's state, then for each model wake -> save -> sleep.

With `--no-offload-train` nothing sleeps and the engines keep their memory,
so the same run can be compared with both models resident.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.lifecycle import OffloadPlan
from tandem.ppo.cluster import start_groups, start_ray, weight_pack
from tandem.ppo.config import PPOConfig
from tandem.ppo.hub import resolve_checkpoints
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
from tandem.ppo.run_log import EventLog, Interrupted, PhaseClock, RunSummary
from tandem.ppo.state import DriverState, load_state
from tandem.ppo.worker_logs import driver_log, logs_dir

if TYPE_CHECKING:
    from tandem.megatron.group import TrainGroup
    from tandem.megatron.payloads import ActorLogProbs, TrainResult
    from tandem.placement import Placements
    from tandem.ppo.engines import EngineGroup
    from tandem.ppo.reward_model._role import RewardModelRole

logger = logging.getLogger(__name__)


class PPODriver:
    """One PPO run: setup, the loop, checkpoints, eval, and clean shutdown."""

    def __init__(self, config: PPOConfig) -> None:
        config = resolve_checkpoints(config)  # hub ids -> local folders, before the checks read them
        config.validate()
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.plan = OffloadPlan.time_shared() if config.offload_train else OffloadPlan.resident()
        self.release_engines = config.colocate and config.offload_train
        self.metrics_so_far: list[dict[str, Any]] = []
        self._stop_requested = False
        self._started_ray = False
        self.weights_version = 0
        self.weight_pack: Any = None
        self.clock = PhaseClock(track_gpu_memory=config.gpu_memory_metrics and config.device != "cpu")
        worker = config.worker_config()
        roles: tuple[Any, ...] = ("actor", "critic") if config.use_critic else ("actor",)
        self.data_parallel_sizes = {r: worker.data_parallel_size(config.actor_num_gpus, r) for r in roles}
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

    # --- setup -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Ray, placement groups, engines and train groups (concurrently), data, reward, logging.

        The run folder is locked first and changed only once everything is up
        (`RunFolder.commit`): a start that fails leaves it as it was. A run whose
        folder holds every rollout already starts nothing (`complete`).
        """
        config = self.config
        self.folder = RunFolder.open(config)
        if self.folder.complete:
            return
        self.events = EventLog(self.run_dir / "events.jsonl", defer=True)
        self._setup_inputs()
        self._setup_ray()
        # From here on a failure is the run's own (the workers): its lines are kept in RUN_DIR/logs.
        self._driver_log.enter_context(driver_log(self.run_dir))
        self.started_logs = True
        self._setup_groups()
        self._setup_reward_model()
        self._resume()
        self.folder.commit()
        self.events.start()
        self._setup_metrics()

    def _setup_inputs(self) -> None:
        """Model folders, tokenizer, reward and prompts, each checked before Ray starts (`preflight`)."""
        from tandem.ppo.preflight import read_inputs

        inputs = read_inputs(self.config, reward_model=self._score_with_reward_model)
        self.tokenizer, self.reward_fn = inputs.tokenizer, inputs.reward_fn
        self.dataset, self.eval_dataset = inputs.dataset, inputs.eval_dataset

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

    def _setup_ray(self) -> None:
        from tandem.ppo.worker_logs import ray_runtime_env

        runtime_env = ray_runtime_env(self.run_dir)
        self._started_ray = start_ray(self.config.ray_address, self.config.local_gpus, runtime_env)

    def _setup_groups(self) -> None:
        assert self.folder is not None
        started = start_groups(self.config, self.folder.worker_config(), lock_file=self.folder.lock.path)
        self.placements, self.actor, self.critic, self.engines = started
        slots = {"actor": started.placements.actor, "rollout": started.placements.rollout}
        self.events.record("placement", **{f"{k}_nodes": list(v.node_ips) for k, v in slots.items()})
        from tandem.ppo.worker_logs import group_workers, name_worker_logs

        roles = (("actor", self.actor), ("critic", self.critic), ("engine", self.engines))
        name_worker_logs(
            self.run_dir, [w for role, g in roles if g is not None for w in group_workers(role, g)]
        )
        self.weight_pack = weight_pack(self.config)
        self.engines.on_restart = self._engine_restarted
        self.events.record("setup_done")
        if self.plan.sleep_after_train:
            # Both models start awake; the engine needs the GPU first.
            for group in self._models():
                self._sleep(group)

    def _setup_reward_model(self) -> None:
        """The reward model's workers (`--rm-type model`), on the rollout bundles; asleep when the plan says."""
        from tandem.ppo.reward_model import start_reward_model, uses_reward_model

        if not uses_reward_model(self.config):
            return
        self.reward_model = start_reward_model(
            self.config, self.placements, events=self.events, sleeps=self.release_engines
        )
        if self.reward_model.sleeps:
            self._sleep_reward_model()

    def _resume(self) -> None:
        assert self.folder is not None
        start = self.folder.resume.next_rollout_id
        loaded = {g.role: g.start_rollout_id for g in self._models()}
        if any(v != start for v in loaded.values()):
            raise RuntimeError(f"the models loaded other rollouts than {start - 1}: {loaded}")
        self.start_rollout_id = start
        self.weights_version = start
        if start > 0:
            state = load_state(self.run_dir, start - 1)
            self.dataset.load_state_dict(state.data)
            state.restore_rng()
            self.metrics_so_far = list(state.metrics)  # steps 0 .. start - 1, saved with the state
            # The engines start from the HF folder: they need the resumed actor's weights.
            self._sync_weights()
            logger.info("resumed after rollout %d", start - 1)

    def _setup_metrics(self) -> None:
        from tandem.ppo.metrics import MetricsLogger
        from tandem.ppo.trackers import open_trackers

        config, start = self.config, self.start_rollout_id
        self.logger = MetricsLogger(
            self.run_dir,
            total_steps=config.num_rollout,
            start_step=start,
            tensorboard=config.tensorboard,
            progress=config.progress,
            sinks=open_trackers(config),
        )

    def _models(self) -> list[TrainGroup]:
        return [g for g in (self.critic, self.actor) if g is not None]

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Run from the resumed rollout to `num_rollout`; checkpoints, eval, the HF export at the end.

        With `--async`, rollout k+1 is generated (on the engines' own GPUs, with the weights
        of before step k) while the models train on rollout k; the weights reach the engines
        once that generation is done, so every rollout but the first is one step off-policy.
        """
        config = self.config
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        last = self.start_rollout_id - 1
        saved = last
        pending: Future[Sampled] | None = None
        try:
            if (
                self.eval_dataset is not None
                and config.eval_interval is not None
                and config.eval_before_train
                and self.start_rollout_id == 0
            ):
                # The starting weights' eval, "after step -1" as every eval is after its step. A resumed
                # run has logged its step start - 1 already: no second record of that step.
                self.eval_before = self.evaluate()
                self.logger.log(-1, self.eval_before)
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") as generation:
                for rollout_id in range(self.start_rollout_id, config.num_rollout):
                    # Sync loop: step() draws its own rollout (inside its clock). Async: the
                    # rollout was generated in the background; step() starts the next one as
                    # soon as this one is in hand.
                    sampled = pending.result() if pending is not None else None
                    pending = None
                    ahead = None
                    if config.async_mode and rollout_id + 1 < config.num_rollout:
                        ahead = functools.partial(generation.submit, self._draw, rollout_id + 1, True)
                    metrics = self.step(rollout_id, sampled, start_next=ahead)
                    pending, drawn = self.generating, self.last_sampled
                    assert drawn is not None
                    last = rollout_id
                    final = rollout_id == config.num_rollout - 1
                    if self.eval_dataset is not None and (
                        final or self._due(config.eval_interval, rollout_id)
                    ):
                        metrics.update(self.evaluate())
                    self.metrics_so_far.append(metrics)
                    self.logger.log(rollout_id, metrics)
                    due = final or self._due(config.save_interval, rollout_id)
                    if due or (self._stop_requested and config.save_on_interrupt):
                        self.save(rollout_id, drawn.data_state)
                        saved = rollout_id
                    if self._stop_requested:
                        raise Interrupted(f"interrupted after rollout {rollout_id} (saved: {saved})")
            hf_dir = self.export_hf() if config.export_hf and last >= 0 else None
            return RunSummary(self.run_dir, last, self.metrics_so_far, hf_dir, eval_before=self.eval_before)
        finally:
            signal.signal(signal.SIGINT, previous)

    @staticmethod
    def _due(interval: int | None, rollout_id: int) -> bool:
        return interval is not None and (rollout_id + 1) % interval == 0

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._stop_requested:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now; the last complete checkpoint stays
        self._stop_requested = True
        logger.warning("Ctrl-C: finishing the step under way, then stopping (Ctrl-C again: stop now)")

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
        """One PPO step (docs/design.md's six steps) on `sampled` (drawn now when None); its metrics.

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
        critic_only = rollout_id < config.num_critic_only_steps

        # 1. rollout: sample, score, split per data-parallel rank
        if sampled is None:
            sampled = self._draw(rollout_id)
        self.last_sampled = sampled
        self._engines_released_to_score = False  # released from here to step 5 (step 2 holds them)
        generating = self.generating = start_next() if start_next is not None else None

        # 2. the engines hand their GPU memory back
        if self.release_engines:
            with self._phase("engine_release"):
                self.engines.release_memory()

        # 2b. KL-first plan (kl_coef != 0 with a critic): the actor's old and reference log-probs
        #     before the critic trains, so that both fold the same per-token KL into their rewards
        #     (without a critic the actor computes them in its own train step)
        kl_first = config.kl_coef != 0 and self.critic is not None
        log_probs = self._kl_first(rollout_id, sampled) if kl_first else None

        # 3. critic (GAE only): wake, old values + returns + value loss, sleep
        critic_out = None
        metrics: dict[str, Any] = {}
        if self.critic is not None:
            critic_out = self._train(self.critic, rollout_id, sampled, log_probs=log_probs)
            metrics.update({f"critic/{k}": v for k, v in critic_out[0].metrics.items()})
            metrics.update(self._allocator_calls("critic", critic_out))

        # 4. actor: wake, train with the critic's values (and its own log-probs), sleep
        if not critic_only:
            actor_out = self._train(self.actor, rollout_id, sampled, critic=critic_out, log_probs=log_probs)
            metrics.update({f"actor/{k}": v for k, v in actor_out[0].metrics.items()})
            metrics.update(self._allocator_calls("actor", actor_out))

        # 5. weights to the engines (weights back -> sync -> KV cache back)
        if generating is not None:
            with self._phase("wait_for_next_rollout"):
                generating.result()
        if not critic_only:
            self._sync_weights()
            self.weights_version = rollout_id + 1
        elif self.release_engines:
            with self._phase("engine_resume"):
                self.engines.resume_memory()

        seconds = time.perf_counter() - step_start
        self.events.record("step_end", rollout_id=rollout_id, seconds=seconds)
        rollout = sampled.rollout
        metrics.update(rollout.metrics(accuracy_threshold=config.accuracy_threshold))
        metrics.update(self._aliases(metrics))
        metrics.update(sampled.seconds)
        metrics.update(self.clock.values)
        metrics.update(sampled.counts)
        metrics.update(
            {
                "time/step": seconds,
                "throughput/tokens_per_s": rollout.response_tokens() / seconds,
                "data/epoch": float(sampled.data_state.get("epoch", 0)),
                "data/dropped_prompts": float(self.dataset.num_dropped),
                "step/critic_only": float(critic_only),
                "async/staleness": float(rollout_id - sampled.weights_version),
                "engine/restarts": float(self.engine_restarts - restarts_before),
                "engine/restarts_total": float(self.engine_restarts),
            }
        )
        return metrics

    @staticmethod
    def _allocator_calls(role: str, out: list[TrainResult]) -> dict[str, float]:
        """`alloc/<role>_train/device_mallocs` (and frees): the most any rank made in its train (GPU)."""
        figures: dict[str, float] = {}
        for rank_out in out:
            for name, count in rank_out.allocator.items():
                key = f"alloc/{role}_train/{name.removeprefix('alloc/')}"
                figures[key] = max(figures.get(key, 0.0), float(count))
        return figures

    @staticmethod
    def _aliases(metrics: dict[str, Any]) -> dict[str, Any]:
        names = {
            "loss/policy": "actor/pg_loss",
            "loss/value": "critic/value_loss",
            "actor/kl": "actor/approx_kl",
        }
        return {alias: metrics[name] for alias, name in names.items() if name in metrics}

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
            with self._phase("engine_release"):
                self.engines.release_memory()
            self._engines_released_to_score = True
            self.events.record("engine_release")
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

    def _kl_first(self, rollout_id: int, sampled: Sampled) -> list[ActorLogProbs | None]:
        """The actor, woken briefly, computes its old and reference log-probs for the rollout."""
        import ray

        with self._phase("kl_first"):
            if self.plan.wake_up_before_train:
                self._wake(self.actor)
            self.events.record("log_probs_begin", role="actor", rollout_id=rollout_id)
            out: list[ActorLogProbs | None] = ray.get(
                self.actor.compute_log_probs(rollout_id, sampled.data_refs["actor"])
            )
            self.events.record("log_probs_end", role="actor", rollout_id=rollout_id)
            if self.plan.sleep_after_train:
                self._sleep(self.actor)
        return out

    def _train(
        self,
        group: TrainGroup,
        rollout_id: int,
        sampled: Sampled,
        *,
        critic: list[TrainResult] | None = None,
        log_probs: list[ActorLogProbs | None] | None = None,
    ) -> list[TrainResult]:
        import ray

        role = group.role
        if self.plan.wake_up_before_train:
            self._wake(group)
        with self._phase(f"{role}_train"):
            self.events.record("train_begin", role=role, rollout_id=rollout_id)
            refs = group.train(
                rollout_id,
                sampled.data_refs[role],
                critic=critic,
                log_probs=log_probs,
                sample_indices=sampled.sample_indices[role],
            )
            out: list[TrainResult] = ray.get(refs)
            self.events.record("train_end", role=role, rollout_id=rollout_id)
        if self.plan.sleep_after_train:
            self._sleep(group)
        return out

    def _wake(self, group: TrainGroup) -> None:
        with self._phase(f"{group.role}_wake"):
            self.events.record("wake", role=group.role)
            self.clock.record_lifecycle(f"{group.role}_wake", group.wake_up())

    def _sleep(self, group: TrainGroup) -> None:
        with self._phase(f"{group.role}_sleep"):
            self.clock.record_lifecycle(f"{group.role}_sleep", group.sleep())
            self.events.record("sleep", role=group.role)

    def _sync_weights(self) -> None:
        """Engines' weights back -> the actor's weights into them -> KV cache back."""
        if self.release_engines:
            with self._phase("engine_resume_weights"):
                self.engines.resume_memory(["weights"])
        with self._phase("weight_sync"):
            self.events.record("weight_sync", path="ipc" if self.weight_pack is not None else "cpu")
            try:
                self.actor.update_weights(self.engines.handles, self.weight_pack)
            except Exception as exc:
                # An engine that died during the sync is restarted (with these weights), then all
                # engines get them again; any other failure is the sync's own.
                if not self._restart_dead_engines(exc):
                    raise
                self.actor.update_weights(self.engines.handles, self.weight_pack)
            self.engines.flush_cache()
            self._check_engines_agree()
        if self.release_engines:
            with self._phase("engine_resume_kv_cache"):
                self.engines.resume_memory(["kv_cache"])

    def _engine_restarted(self, rank: int, handle: Any) -> None:
        """A restarted engine (`EngineGroup.restart`) starts from the HF folder: give it the actor's weights."""
        import ray

        self.engine_restarts += 1
        digest = getattr(handle, "weights_digest", None)
        before = ray.get(digest.remote()) if digest is not None else None
        if self.weights_version > 0:
            self.actor.update_weights([handle])  # CPU copies: to this engine alone
        after = ray.get(digest.remote()) if digest is not None else None
        self.events.record(
            "engine_restart",
            rank=rank,
            restarts=self.engines.restarts[rank],
            weights_version=self.weights_version,
            digest_before=before,
            digest_after=after,
        )

    def _restart_dead_engines(self, exc: BaseException) -> bool:
        """Restart the engines that no longer answer after `exc`; whether there were any."""
        from tandem.ppo.engines import EngineDied

        dead = [rank for rank, alive in enumerate(self.engines.health()) if not alive]
        for rank in dead:
            self.engines.restart(
                rank, EngineDied(rank, f"weight sync failed: {' '.join(str(exc).split())[:300]}")
            )
        return bool(dead)

    def _check_engines_agree(self) -> None:
        """Every engine's weight fingerprints, into events.jsonl; a warning when they differ."""
        digests = self.engines.weights_digest()
        if digests is None:
            return
        agree = all(d == digests[0] for d in digests)
        self.events.record("weights_received", digests=digests, agree=agree)
        if not agree:
            logger.warning("after the weight sync the engines hold different weights: %s", digests)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        with self.clock.phase(name):
            yield

    # --- checkpoints, eval, export ---------------------------------------------------------------
    def save(self, rollout_id: int, data_state: dict[str, Any] | None = None) -> None:
        """The driver's state, then each model: wake -> save -> sleep (as the plan says).

        `data_state`: the data cursor right after this rollout (default: the cursor now).
        """
        data = self.dataset.state_dict() if data_state is None else data_state

        def save_model(group: TrainGroup) -> None:
            if self.plan.wake_up_before_save:
                self._wake(group)
            self.events.record("save", role=group.role, rollout_id=rollout_id)
            group.save_model(rollout_id)
            if self.plan.sleep_after_save:
                self._sleep(group)

        state = DriverState.capture(rollout_id, data, self.metrics_so_far)
        saves = [(g.role, functools.partial(save_model, g)) for g in self._models()]
        with self._phase("save"):
            # The run's checkpoint of this rollout: the driver state, then each model (run_checkpoint).
            save_run_checkpoint(self.run_dir, state, saves)

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
            return Path(export_actor(self.actor, self.run_dir / "hf", self.config.hf_checkpoint))

    # --- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers and engines, release the placement groups, stop Ray if we started it."""
        import ray

        for name in ("logger", "events"):
            obj = getattr(self, name, None)
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
        if self.engines is not None:
            with contextlib.suppress(Exception):
                self.engines.shutdown()
        if self.reward_model is not None:
            with contextlib.suppress(Exception):
                self.reward_model.shutdown()
        for group in self._models():
            with contextlib.suppress(Exception):
                group.shutdown()
            with contextlib.suppress(Exception):
                group.kill()
        if self.placements is not None:
            with contextlib.suppress(Exception):
                self.placements.remove()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._driver_log.close()
        if self.folder is not None:
            if self.refused and self.folder.created and not self.folder.committed:
                # Nothing ran: the error line says why, and the new folder goes as if never made.
                shutil.rmtree(logs_dir(self.run_dir), ignore_errors=True)
            self.folder.close()


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
