"""The fields of a run whose rollout is made of episodes: an environment or a custom generate function.

`EpisodeFields` is a part of `RunFields` (every flag of `ppo-driver train`), kept apart so that
each module stays one concept. With neither `--env-path` nor `--custom-generate-function-path`
the rollout is single-turn and none of these fields is read. docs/design.md, "Episodes".
"""

from __future__ import annotations

import dataclasses

__all__ = ["ENDPOINT_KEY_VARIABLE", "EpisodeFields"]

ENDPOINT_KEY_VARIABLE = "TANDEM_ENDPOINT_API_KEY"
"""The environment variable that holds the chat endpoint's API key (never a flag: a flag would be
written to config.yaml and the logs)."""


@dataclasses.dataclass(frozen=True)
class EpisodeFields:
    """The flags of multi-turn rollouts: the environment, the budgets, tools and the chat endpoint."""

    env_path: str | None = None
    """The rollout's samples are episodes with an environment: `package.module:factory`,
    `/path/to/file.py:factory` (a callable of no argument that makes one episode's environment, with
    `reset(sample)` and `step(turn) -> (observation, reward, done)`), or `textarena:GameId` for a
    TextArena single-player game (extra `tandem-ppo-driver[textarena]`). The environment gives the rewards."""

    custom_generate_function_path: str | None = None
    """Whole control of each episode: `package.module:function` or `/path/to/file.py:function`, called
    with an `EpisodeContext` (the sample, the model's turns, the chat renderer, the OpenAI-compatible
    endpoint) and returning the `Episode`; sync or async."""

    max_turns: int = 4
    """Model turns per episode at most (a turn that calls tools counts); an episode still going then
    ends truncated."""

    max_episode_tokens: int | None = None
    """Tokens after the first prompt per episode at most, the model's and the environment's; an episode
    that would pass it ends truncated. None: only the engines' context bounds it (each model turn is
    bounded by `--rollout-max-response-len`)."""

    env_timeout: float = 60.0
    """Seconds one environment call (`reset`, `step`) may take; a call past it fails its episode."""

    tool_timeout: float = 10.0
    """Seconds one tool call may take; past it the model gets an error message instead of a result."""

    max_env_failures: int = 16
    """Failed episodes (the environment raised, returned the wrong types or timed out) a run tolerates;
    one more stops it, naming the environment, the sample and its log in RUN_DIR/logs/episodes."""

    keep_episode_kv: bool = False
    """The embedded engine keeps each episode's KV cache between its turns, so that a turn prefills only
    the tokens that are new since the last one (the environment's reply); off: each turn prefills the
    whole episode again. Off by default: on one H200 (a Qwen2.5-0.5B shape, 256 episodes of 4 turns of
    128 tokens; docs/benchmarks.md, "Multi-turn episodes on the embedded engine") keeping the KV ran
    at 0.77 times the speed of re-prefilling, its copies of the kept rows costing more than the
    batched prefill they save. SGLang reuses the prefixes itself either way."""

    endpoint_host: str = "127.0.0.1"
    """Where the OpenAI-compatible chat endpoint of a custom generate function listens. Any address but
    the loopback needs an API key in the environment variable TANDEM_ENDPOINT_API_KEY (checked on every
    request; never written to config.yaml or the logs)."""

    endpoint_port: int = 0
    """The chat endpoint's port; 0: a free port, chosen at each rollout."""

    @property
    def plays_episodes(self) -> bool:
        """Whether the rollout's samples are episodes (`--env-path` or `--custom-generate-function-path`)."""
        return self.env_path is not None or self.custom_generate_function_path is not None
