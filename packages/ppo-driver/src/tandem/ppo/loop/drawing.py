"""Step 1, the rollout: its rounds of sampling, the teacher's log-probs, and its split per data-parallel rank.

`RolloutDrawing` takes the turns of a rollout on the roles on the GPUs (`shared_gpus.SharedGpus`):
each round of sampling takes the engines' `generate` turn (or plays episodes there) and a reward
model's `score` turn, then the rule rewards; dynamic sampling draws rounds until its groups are
full; the drawn rollout takes a teacher's `log_probs` turn; then the rollout is split into the
per-rank batches of each train role. `PPODriver.draw` and its eval call it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from tandem.ppo.rollout.episodes.generation import generate_episodes
from tandem.ppo.rollout.samples import (
    Rollout,
    Sampled,
    dynamic_sample,
    generate_samples,
    sampling_params,
    score_requests,
    score_rollout,
)
from tandem.ppo.rollout.train_batches import shard_per_role, training_rewards

if TYPE_CHECKING:
    from tandem.ppo.config.ppo_config import PPOConfig
    from tandem.ppo.loop.schedule import StepSchedule
    from tandem.ppo.loop.shared_gpus import SharedGpus
    from tandem.ppo.rollout.data import PromptDataset, PromptSample
    from tandem.ppo.rollout.episodes.generation import EpisodeSetup
    from tandem.ppo.rollout.reward_mix import RewardMix
    from tandem.ppo.rollout.rewards import RewardFunction
    from tandem.ppo.run.log import EventLog, PhaseClock

__all__ = ["RolloutDrawing"]


@dataclasses.dataclass
class RolloutDrawing:
    """How a run draws its rollouts: the roles that take the turns, the data, the tokenizer, the rewards.

    Attributes:
        config: the run's config as it is now (`PPODriver.config`, which a bench's cells change between
            steps): read at each draw.
        schedule: a full step's schedule (`PPODriver.between_steps`): which turns a rollout takes.
        episodes: how episodes are played (`--env-path`, `--custom-generate-function-path`); None:
            single-turn samples.
        data_parallel_sizes: each train role's data-parallel size (the per-rank split).
    """

    config: Callable[[], PPOConfig]
    gpus: SharedGpus
    events: EventLog
    clock: PhaseClock
    dataset: PromptDataset
    tokenizer: Any
    reward_fn: RewardFunction | RewardMix
    episodes: EpisodeSetup | None
    data_parallel_sizes: Mapping[str, int]
    schedule: Callable[[], StepSchedule]

    def draw(self, rollout_id: int, background: bool = False) -> Sampled:
        """Rollout `rollout_id`: sampled, scored, the teacher's log-probs, split per data-parallel rank.

        `background`: drawn on the async loop's generation thread, outside any step's clock.
        """
        config = self.config()
        start = time.perf_counter()
        version = self.gpus.weights_version
        if not background:
            self.clock.announce("generate")
        self.events.record("generate_begin", rollout_id=rollout_id, weights_version=version)
        seed = config.seed * 1_000_003 + rollout_id
        counts: dict[str, float] = {}
        if config.dynamic_sampling:
            rounds = iter(range(config.dynamic_sampling_max_rounds))
            rollout, counts = dynamic_sample(
                lambda n: self.sample(
                    self.dataset.next_batch(n), seed=seed + 7919 * next(rounds), label=f"rollout{rollout_id}"
                ),
                num_prompts=config.rollout_batch_size,
                n_samples_per_prompt=config.n_samples_per_prompt,
                max_rounds=config.dynamic_sampling_max_rounds,
            )
        else:
            rollout = self.sample(
                self.dataset.next_batch(config.rollout_batch_size), seed=seed, label=f"rollout{rollout_id}"
            )
        rollout = self.teach(rollout)
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

    def sample(
        self, prompts: list[PromptSample], *, seed: int, eval_mode: bool = False, label: str = "rollout"
    ) -> Rollout:
        """One round of sampling: the engines' `generate` turn, the reward model's `score` turn, the rules.

        A run of episodes plays them in the generate turn, and their environments score them
        (`label` names the rollout in failed episodes' logs). On shared GPUs the reward model scores
        once the engines have released their memory (the generate turn's release, brought forward),
        and engines that generate again take it back first (another round of dynamic sampling, an eval).
        """
        config = self.config()
        schedule = self.schedule()
        generate, score = schedule.turn("engine", "generate"), schedule.turn("reward_model", "score")
        assert generate is not None
        self.gpus.ready("engine")
        params = sampling_params(
            config, eos_token_id=self.tokenizer.eos_token_id, seed=seed, eval_mode=eval_mode
        )
        n = config.n_samples_per_eval_prompt if eval_mode else config.n_samples_per_prompt
        if self.episodes is not None:
            return generate_episodes(
                self.gpus.engines,
                prompts,
                n_samples_per_prompt=n,
                params=params,
                tokenizer=self.tokenizer,
                setup=self.episodes,
                label=label,
            )
        rollout = generate_samples(
            self.gpus.engines, prompts, n_samples_per_prompt=n, params=params, tokenizer=self.tokenizer
        )
        if score is None:
            return score_rollout(rollout, self.reward_fn)
        reward_model = self.gpus.reward_model
        assert reward_model is not None
        start = time.perf_counter()
        if score.wake_before:
            self.gpus.after(generate)  # the engines make room for the reward model
        with self.gpus.turn(score), self.gpus.phase("reward_model_score"):
            scores = reward_model.score(score_requests(rollout))
        rollout.seconds["reward_model"] = time.perf_counter() - start
        return score_rollout(rollout, self.reward_fn, scores)

    def teach(self, rollout: Rollout) -> Rollout:
        """The teacher's `log_probs` turn: `rollout` with the teacher's log-probs of its samples (as it is
        without a teacher).

        Taken once a rollout is drawn (dynamic sampling's rounds done), before it is split into
        the per-rank batches that carry the log-probs. On shared GPUs the teacher wakes once the
        engines have released their memory (the generate turn's release, brought forward).
        """
        schedule = self.schedule()
        turn = schedule.turn("teacher", "log_probs")
        if turn is None:
            return rollout
        teacher = self.gpus.teacher
        assert teacher is not None
        start = time.perf_counter()
        if turn.wake_before:
            generate = schedule.turn("engine", "generate")
            assert generate is not None
            self.gpus.after(generate)  # the engines make room for the teacher
        with self.gpus.turn(turn), self.gpus.phase("teacher_log_probs"):
            log_probs = teacher.log_probs(score_requests(rollout))
        return dataclasses.replace(
            rollout,
            teacher_log_probs=log_probs,
            seconds={**rollout.seconds, "teacher": time.perf_counter() - start},
        )
