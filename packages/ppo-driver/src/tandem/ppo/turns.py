"""One step's turns taken: `PPODriver.step` hands each turn of its `StepSchedule` to `StepTurns.take`.

Each turn's work goes to the driver's roles (the engines, the reward model, the
actor and critic train groups), with the wake before it and the sleep after it
that the turn asks for: the schedule is the driver's plan, and the workers
only carry it out. The step's results (its rollout, the critic's values, the
actor's log-probs, the roles' metrics) are gathered here for the turns after.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tandem.ppo.schedule import Turn, Work
from tandem.ppo.step_metrics import KL_COEF, kl_coef_of_step, role_metrics

if TYPE_CHECKING:
    from tandem.megatron.group import TrainGroup
    from tandem.megatron.payloads import ActorLogProbs, TrainResult
    from tandem.ppo.driver import PPODriver
    from tandem.ppo.rollout import Sampled

__all__ = ["StepTurns"]


class StepTurns:
    """The turns of step `rollout_id` on `driver`'s roles, taken one after the other (`take`).

    `sampled`: the step's rollout when drawn before the step (the async loop), else the
    `generate` turn draws it. `start_next`: starts generating the next rollout (`start_next`).
    """

    def __init__(
        self,
        driver: PPODriver,
        rollout_id: int,
        sampled: Sampled | None,
        start_next: Callable[[], Future[Sampled]] | None,
    ) -> None:
        self.driver = driver
        self.rollout_id = rollout_id
        self.sampled = sampled
        self.start_next = start_next
        self.metrics: dict[str, Any] = {}
        self.critic_out: list[TrainResult] | None = None
        self.log_probs: list[ActorLogProbs | None] | None = None
        self._work: dict[Work | None, Callable[[Turn], None]] = {
            "generate": self._generate,
            "score": self._score,
            "log_probs": self._log_probs,
            "train": self._train,
            "start_next": self._start_next,
            "await_next": self._await_next,
            "weights": self._weights,
            None: self._lifecycle,
        }

    def take(self, turn: Turn) -> None:
        """Take `turn`: its wake, its work, its sleep."""
        self._work[turn.work](turn)

    @property
    def rollout(self) -> Sampled:
        assert self.sampled is not None, "the step's turns start with the rollout"
        return self.sampled

    # 1. rollout: sample, score, split per data-parallel rank; 2. the engines hand their memory back
    def _generate(self, turn: Turn) -> None:
        driver = self.driver
        if self.sampled is None:
            self.sampled = driver._draw(self.rollout_id)
        driver.last_sampled = self.sampled
        released = driver._engines_released_to_score  # for a reward model's score, inside the rollout
        driver._engines_released_to_score = False  # released from here to the weights (step 2 holds them)
        driver.generating = None
        if turn.sleep_after:
            if released:  # idempotent: only the phase's time, no second event
                with driver._phase("engine_release"):
                    driver.engines.release_memory()
            else:
                driver._release_engines()

    def _score(self, turn: Turn) -> None:
        # 1b. Taken inside the rollout (`generate`), once per generation round, by the reward
        # function: the engines release their memory, the reward model wakes, scores and sleeps
        # (`PPODriver._score_with_reward_model`, with this turn's wake and sleep, set at setup).
        assert self.sampled is not None

    # 2b. KL-first plan: the actor's old and reference log-probs before the critic trains, so
    #     that both fold the same per-token KL into their rewards
    def _log_probs(self, turn: Turn) -> None:
        import ray

        driver, rollout_id = self.driver, self.rollout_id
        with driver._phase("kl_first"):
            if turn.wake_before:
                driver._wake(driver.actor)
            driver.events.record("log_probs_begin", role="actor", rollout_id=rollout_id)
            self.log_probs = ray.get(
                driver.actor.compute_log_probs(rollout_id, self.rollout.data_refs["actor"])
            )
            driver.events.record("log_probs_end", role="actor", rollout_id=rollout_id)
            if turn.sleep_after:
                driver._sleep(driver.actor)

    # 3. critic: wake, old values + returns + value loss, sleep;
    # 4. actor: wake, train with the critic's values (and its own log-probs), sleep
    def _train(self, turn: Turn) -> None:
        import ray

        driver, rollout_id, sampled = self.driver, self.rollout_id, self.rollout
        group: TrainGroup | None = driver.critic if turn.role == "critic" else driver.actor
        assert group is not None and group.role == turn.role
        if turn.wake_before:
            driver._wake(group)
        kl_coef = kl_coef_of_step(driver.config, driver.metrics_so_far)  # adaptive KL: both roles alike
        if kl_coef is not None:
            self.metrics[KL_COEF] = kl_coef
        with driver._phase(f"{group.role}_train"):
            driver.events.record("train_begin", role=group.role, rollout_id=rollout_id)
            refs = group.train(
                rollout_id,
                sampled.data_refs[group.role],
                critic=self.critic_out if group.role == "actor" else None,
                log_probs=self.log_probs,
                sample_indices=sampled.sample_indices[group.role],
                kl_coef=kl_coef,
            )
            out: list[TrainResult] = ray.get(refs)
            driver.events.record("train_end", role=group.role, rollout_id=rollout_id)
        if turn.sleep_after:
            driver._sleep(group)
        if group.role == "critic":
            self.critic_out = out
        self.metrics.update(role_metrics(group.role, out))

    # async: the next rollout generates on the engines' own GPUs while the models train
    def _start_next(self, turn: Turn) -> None:
        assert self.start_next is not None
        self.driver.generating = self.start_next()

    def _await_next(self, turn: Turn) -> None:
        generating = self.driver.generating
        assert generating is not None
        with self.driver._phase("wait_for_next_rollout"):
            generating.result()

    # 5. weights to the engines (weights back -> sync -> KV cache back)
    def _weights(self, turn: Turn) -> None:
        self.driver._sync_weights(resume=turn.wake_before)
        self.driver.weights_version = self.rollout_id + 1

    def _lifecycle(self, turn: Turn) -> None:
        # The engines just resume (the warm-up has no weights to send).
        assert turn.role == "engine" and turn.wake_before and not turn.sleep_after, turn
        with self.driver._phase("engine_resume"):
            self.driver.engines.resume_memory()
        self.driver.events.record("engine_resume")
