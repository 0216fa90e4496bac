"""The run's hints said: `run.health`'s judgements of each step, on the terminal, in driver.log and events.jsonl.

`RunHints` builds the facts the hints need from the run's config and its engines (how large
the loaded weights are, for the lr hint's spacing), replays a resumed run's earlier steps so
that a hint said before the resume is not said again, and after each step gives
`run.health.RunHealth` the step's figures and two responses of prompts whose samples tied.
Each hint is one warning line of the `tandem.ppo.hints` logger (the terminal and
RUN_DIR/logs/driver.log) and a `hint` event; `--no-hints` keeps them off the terminal and
driver.log (the events, the figures and `critic/explained_variance_window` stay).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tandem.ppo.rollout.reward_mix import reward_terms
from tandem.ppo.rollout.rewards import NO_REWARD
from tandem.ppo.run.health import RunFacts, RunHealth, StepFigures, WeightMagnitudes, tied_examples

if TYPE_CHECKING:
    from tandem.ppo.config.ppo_config import PPOConfig
    from tandem.ppo.rollout.samples import Rollout
    from tandem.ppo.run.log import EventLog

__all__ = ["RunHints", "run_facts"]

logger = logging.getLogger("tandem.ppo.hints")


def run_facts(config: PPOConfig, weights: dict[str, Any] | None) -> RunFacts:
    """What the hints need of the run: its flags, and the engines' `weight_magnitudes()` (None: unknown)."""
    return RunFacts(
        lr=config.lr,
        critic_lr=config.critic_lr,
        num_critic_only_steps=config.num_critic_only_steps if config.use_critic else 0,
        rollout_max_response_len=config.rollout_max_response_len,
        n_samples_per_prompt=config.n_samples_per_prompt,
        optimizer_steps_per_rollout=config.ppo_epochs
        * config.samples_per_rollout
        // config.global_batch_size,
        weights=WeightMagnitudes.of(weights),
        rewarded=bool(set(reward_terms(config)) - {NO_REWARD}),
    )


class RunHints:
    """The hints of one run (`after_step` once a step); `say`: whether they are said (`--hints`)."""

    def __init__(
        self,
        config: PPOConfig,
        weights: dict[str, Any] | None,
        *,
        events: EventLog,
        before: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.health = RunHealth(run_facts(config, weights))
        self.health.replay([StepFigures.from_metrics(k, m) for k, m in enumerate(before)])
        self.n_samples_per_prompt = config.n_samples_per_prompt
        self.say = config.hints
        self.events = events

    def after_step(self, rollout_id: int, metrics: dict[str, Any], rollout: Rollout) -> dict[str, float]:
        """Judge step `rollout_id` from its metrics; say the hints it brings; the window metrics to log."""
        examples = tied_examples(rollout.responses, rollout.rewards, self.n_samples_per_prompt)
        hints = self.health.observe(StepFigures.from_metrics(rollout_id, metrics), examples)
        for hint in hints:
            self.events.record("hint", rollout_id=rollout_id, name=hint.name, message=hint.message)
            if self.say:
                logger.warning("hint: %s", hint.message)
        return self.health.window_metrics()
