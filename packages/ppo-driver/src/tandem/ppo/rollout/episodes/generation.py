"""A rollout of episodes: every prompt's samples played at once, as the single-turn rollout's samples.

`generate_episodes` is the engines' `generate` turn of a run with `--env-path` or
`--custom-generate-function-path`: `n_samples_per_prompt` episodes per prompt, all in flight
together (`batcher.TurnBatcher`), scored by their environments. Each episode becomes one
sample of the `Rollout`: its first prompt as the prompt, everything after it as the
response, with its loss mask and its rewards at their tokens (`Rollout.episodes`);
`rewards` are the episodes' returns. Failed episodes are logged and counted
(`failures.EnvFailures`), and the step goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.ppo.engines import SamplingParams
from tandem.ppo.rollout.data import PromptSample
from tandem.ppo.rollout.episodes.batcher import Generator, TurnBatcher
from tandem.ppo.rollout.episodes.custom import CustomGenerate, EpisodeContext, run_custom
from tandem.ppo.rollout.episodes.environment import EnvFactory, EnvFailure, EpisodeSample
from tandem.ppo.rollout.episodes.failures import EnvFailures
from tandem.ppo.rollout.episodes.runner import (
    EnvCalls,
    EpisodeLimits,
    failure_text,
    play_episodes,
    run_episode,
)
from tandem.ppo.rollout.episodes.trajectory import Episode, Trajectory
from tandem.ppo.rollout.samples import Rollout

if TYPE_CHECKING:
    from tandem.ppo.rollout.episodes.endpoint import EndpointOptions

__all__ = ["EpisodeSetup", "generate_episodes"]

_SEED_MOD = 2**31


@dataclass
class EpisodeSetup:
    """How a run's episodes are played: an environment factory or a custom generate function."""

    name: str
    """The `--env-path` or `--custom-generate-function-path` given."""
    limits: EpisodeLimits
    failures: EnvFailures
    factory: EnvFactory | None = None
    custom: CustomGenerate | None = None
    endpoint: EndpointOptions | None = None
    """The chat endpoint's address and key, for a custom generate function."""
    keep_kv: bool = False
    """The engines keep each episode's KV cache between its turns (`--keep-episode-kv`)."""


def episode_sample(prompt: PromptSample, index: int, seed: int) -> EpisodeSample:
    """What `reset` (or a custom generate function) gets of the rollout's sample `index`."""
    record = prompt.record
    return EpisodeSample(
        prompt=record.prompt,
        messages=record.messages,
        label=record.label,
        metadata=dict(record.metadata),
        index=index,
        seed=(seed * 1_000_003 + index) % _SEED_MOD,
    )


def generate_episodes(
    engines: Generator,
    prompts: Sequence[PromptSample],
    *,
    n_samples_per_prompt: int,
    params: SamplingParams,
    tokenizer: Any,
    setup: EpisodeSetup,
    label: str,
) -> Rollout:
    """Play `n_samples_per_prompt` episodes per prompt on the engines; the rollout, scored.

    `label` names the rollout in failed episodes' logs (`rollout3`, `eval3`).
    """
    repeated = [p for p in prompts for _ in range(n_samples_per_prompt)]
    seed = params.seed or 0
    samples = [episode_sample(p, i, seed) for i, p in enumerate(repeated)]
    start = time.perf_counter()
    episodes, engine_seconds = asyncio.run(_play(engines, repeated, samples, params, tokenizer, setup))
    seconds = {"generate": time.perf_counter() - start, "generate_engine": engine_seconds}
    setup.failures.record(label, episodes, samples)
    responses = [
        tokenizer.decode(
            [t for t, m in zip(e.token_ids, e.loss_mask, strict=True) if m], skip_special_tokens=True
        )
        for e in episodes
    ]
    rollout = Rollout(
        prompts=[
            PromptSample(p.record, e.prompt_ids, e.prompt_text)
            for p, e in zip(repeated, episodes, strict=True)
        ],
        generations=[e.as_generation() for e in episodes],
        responses=responses,
        rewards=[e.reward for e in episodes],
        seconds=seconds,
        episodes=episodes,
    )
    return rollout


async def _play(
    engines: Generator,
    prompts: Sequence[PromptSample],
    samples: Sequence[EpisodeSample],
    params: SamplingParams,
    tokenizer: Any,
    setup: EpisodeSetup,
) -> tuple[list[Episode], float]:
    batcher = TurnBatcher(engines, params, episodes=len(samples), keep_kv=setup.keep_kv)
    env_calls = EnvCalls(setup.limits.env_timeout_s)
    endpoint = None
    if setup.custom is not None and setup.endpoint is not None:
        from tandem.ppo.rollout.episodes.endpoint import ChatEndpoint

        endpoint = ChatEndpoint(setup.endpoint, tokenizer=tokenizer, batcher=batcher, limits=setup.limits)

    async def one(i: int, batcher: TurnBatcher, env_calls: EnvCalls) -> Episode:
        if setup.factory is not None:
            return await run_episode(
                setup.factory,
                samples[i],
                batcher=batcher,
                tokenizer=tokenizer,
                limits=setup.limits,
                env_calls=env_calls,
                fallback_prompt=prompts[i].prompt_ids,
            )
        assert setup.custom is not None
        context = EpisodeContext(
            samples[i],
            prompt_ids=prompts[i].prompt_ids,
            tokenizer=tokenizer,
            params=params,
            limits=setup.limits,
            batcher=batcher,
            endpoint=endpoint,
        )
        try:
            return await run_custom(setup.custom, context, setup.name)
        except EnvFailure as exc:
            episode = Trajectory(prompts[i].prompt_ids, prompts[i].prompt_text).finish("failed")
            episode.failure = failure_text(exc)
            return episode
        finally:
            batcher.leave()

    try:
        if endpoint is not None:
            endpoint.start()
        episodes = await play_episodes(one, len(samples), batcher=batcher, env_calls=env_calls)
    finally:
        if endpoint is not None:
            endpoint.stop()
        await batcher.close()
    return episodes, batcher.seconds
