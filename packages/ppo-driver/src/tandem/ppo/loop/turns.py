"""One step's turns taken: `PPODriver.step` hands each turn of its `StepSchedule` to `StepTurns.take`.

Each turn's work goes to the roles on the GPUs (`SharedGpus`: the engines, the
reward model, the teacher, the actor and critic train groups), with the wake before it and the
sleep after it that the turn asks for: the schedule is the driver's plan, and the
workers only carry it out. The step's results (its rollout, the critic's values, the
actor's log-probs, the roles' metrics) are gathered here for the turns after.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

import ray

from tandem.ppo.loop.schedule import Turn, Work
from tandem.ppo.loop.step_metrics import KL_COEF, policy_metrics, role_metrics

if TYPE_CHECKING:
    from tandem.megatron.payloads import ActorLogProbs, TrainResult
    from tandem.ppo.loop.shared_gpus import SharedGpus
    from tandem.ppo.rollout.samples import Sampled

__all__ = ["StepTurns"]


class StepTurns:
    """The turns of step `rollout_id` on the roles of `gpus`, taken one after the other (`take`).

    `sampled`: the step's rollout when drawn before the step (the async loop), else the
    `generate` turn draws it with `draw`, whose rounds take the `generate` and `score`
    turns' work and whose drawn rollout the teacher's `log_probs` turn's (`PPODriver.draw`). `start_next`: starts generating the next rollout
    (`start_next`); the future is `generating`. `kl_coef`: the step's reward-level KL coefficient
    where the adaptive controller steers it (`step_metrics.kl_coef_of_step`), the same for both
    roles; None: the config's.
    """

    def __init__(
        self,
        gpus: SharedGpus,
        rollout_id: int,
        *,
        sampled: Sampled | None,
        draw: Callable[[], Sampled],
        start_next: Callable[[], Future[Sampled]] | None,
        kl_coef: float | None = None,
    ) -> None:
        self.gpus = gpus
        self.kl_coef = kl_coef
        self.rollout_id = rollout_id
        self.sampled = sampled
        self.draw = draw
        self.start_next = start_next
        self.generating: Future[Sampled] | None = None
        self.metrics: dict[str, Any] = {} if kl_coef is None else {KL_COEF: kl_coef}
        self.critic_out: list[TrainResult] | None = None
        self.log_probs: list[ActorLogProbs | None] | None = None

    # Each turn's work by name; looked up at each turn rather than held as bound methods, which would
    # make every step's turns a reference cycle that keeps the step's rollout (its token ids,
    # log-probs and batches in Ray's object store) alive until the cyclic collector runs.
    _WORK: ClassVar[dict[Work | None, str]] = {
        "generate": "_generate",
        "score": "_score",
        "log_probs": "_log_probs",
        "train": "_train",
        "start_next": "_start_next",
        "await_next": "_await_next",
        "weights": "_weights",
        None: "_lifecycle",
    }

    def take(self, turn: Turn) -> None:
        """Take `turn`: its wake, its work, its sleep."""
        getattr(self, self._WORK[turn.work])(turn)

    @property
    def rollout(self) -> Sampled:
        assert self.sampled is not None, "the step's turns start with the rollout"
        return self.sampled

    # 1. rollout: sample, score, split per data-parallel rank; 2. the engines hand their memory back
    def _generate(self, turn: Turn) -> None:
        if self.sampled is None:
            self.sampled = self.draw()
        self.gpus.after(turn)  # already released where a reward model's score needed the GPUs

    # 1b. The reward model's turn: each round of the rollout's sampling takes it, between the engines'
    #     generation and the rule rewards (dynamic sampling decides on each round's rewards). Here,
    #     after the rollout: the turn left the reward model as it asks.
    def _score(self, turn: Turn) -> None:
        assert self.sampled is not None, "the rollout's rounds take the score turn"
        assert not (turn.sleep_after and self.gpus.awake("reward_model")), "the score turn sleeps it"

    # 1c. The teacher's turn: the draw takes it once the rollout is drawn, before the split into the
    #     per-rank batches that carry its log-probs. Here, after the rollout: the turn left it as it asks.
    # 2b. KL-first plan: the actor's old and reference log-probs before the critic trains, so
    #     that both fold the same per-token KL into their rewards
    def _log_probs(self, turn: Turn) -> None:
        if turn.role == "teacher":
            assert self.rollout.rollout.teacher_log_probs is not None, "the draw takes the teacher's turn"
            assert not (turn.sleep_after and self.gpus.awake("teacher")), "the teacher's turn sleeps it"
            return
        gpus, rollout_id = self.gpus, self.rollout_id
        with gpus.phase("kl_first"):
            gpus.before(turn)
            gpus.events.record("log_probs_begin", role="actor", rollout_id=rollout_id)
            self.log_probs = ray.get(
                gpus.actor.compute_log_probs(rollout_id, self.rollout.data_refs["actor"])
            )
            gpus.events.record("log_probs_end", role="actor", rollout_id=rollout_id)
            gpus.after(turn)

    # 3. critic: wake, old values + returns + value loss, sleep;
    # 4. actor: wake, train with the critic's values (and its own log-probs), sleep
    def _train(self, turn: Turn) -> None:
        gpus, rollout_id, sampled = self.gpus, self.rollout_id, self.rollout
        group = gpus.group(turn.role)
        gpus.before(turn)
        with gpus.phase(f"{group.role}_train"):
            gpus.events.record("train_begin", role=group.role, rollout_id=rollout_id)
            refs = group.train(
                rollout_id,
                sampled.data_refs[group.role],
                critic=self.critic_out if group.role == "actor" else None,
                log_probs=self.log_probs,
                sample_indices=sampled.sample_indices[group.role],
                kl_coef=self.kl_coef,
            )
            out: list[TrainResult] = ray.get(refs)
            gpus.events.record("train_end", role=group.role, rollout_id=rollout_id)
        gpus.after(turn)
        if group.role == "critic":
            self.critic_out = out
        self.metrics.update(role_metrics(group.role, out))

    # async: the next rollout generates on the engines' own GPUs while the models train
    def _start_next(self, turn: Turn) -> None:
        assert self.start_next is not None
        self.generating = self.start_next()

    def _await_next(self, turn: Turn) -> None:
        assert self.generating is not None
        with self.gpus.phase("wait_for_next_rollout"):
            self.generating.result()

    # 5. weights to the engines: their weights back -> sync -> their KV cache back (the turn's wake, in
    #    two parts around the sync)
    def _weights(self, turn: Turn) -> None:
        assert self.gpus.plans("engine") or turn.wake_before == (not self.gpus.awake("engine")), turn
        self.gpus.sync_weights(weights_version=self.rollout_id + 1)
        self.metrics.update(policy_metrics(self.gpus.weight_changes))

    # a turn of the lifecycle alone (the warm-up's engines resume: no weights to send)
    def _lifecycle(self, turn: Turn) -> None:
        self.gpus.before(turn)
        self.gpus.after(turn)
