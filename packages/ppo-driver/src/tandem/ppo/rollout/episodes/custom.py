"""A custom generate function (`--custom-generate-function-path`): whole control of an episode.

The function takes one `EpisodeContext` and returns the episode (`Episode`, or a `Trajectory`,
finished as `done`); it may be a plain function or an `async def` (a plain one runs on a
daemon thread of its own, `threads`: as many at once as there are episodes). The context gives
the sample, the tokenizer, the model's turns through the same batcher as every other episode
(`generate`), the chat renderer, and the chat-completions
endpoint (`endpoint_session`), whose calls become the episode without re-tokenizing. A
function that raises or returns something else fails its episode, like an environment;
an engine's error inside `generate` stays the run's own.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tandem.ppo.engines import Generation, SamplingParams
from tandem.ppo.rollout.episodes.batcher import TurnBatcher
from tandem.ppo.rollout.episodes.chat import ChatRenderer
from tandem.ppo.rollout.episodes.environment import EnvFailure, EpisodeSample
from tandem.ppo.rollout.episodes.runner import EpisodeLimits
from tandem.ppo.rollout.episodes.threads import in_daemon_thread
from tandem.ppo.rollout.episodes.trajectory import Episode, Trajectory

if TYPE_CHECKING:
    from tandem.ppo.rollout.episodes.endpoint import ChatEndpoint, ChatSession

__all__ = ["CustomGenerate", "EpisodeContext", "run_custom"]

CustomGenerate = Callable[["EpisodeContext"], Any]
"""What `--custom-generate-function-path` names: `fn(ctx) -> Episode | Trajectory` (sync or async)."""


class EngineFailed(RuntimeError):
    """The engines failed inside a custom generate function's `generate`: the run's error, not the function's."""


class EpisodeContext:
    """What a custom generate function gets for one episode."""

    def __init__(
        self,
        sample: EpisodeSample,
        *,
        prompt_ids: Sequence[int],
        tokenizer: Any,
        params: SamplingParams,
        limits: EpisodeLimits,
        batcher: TurnBatcher,
        endpoint: ChatEndpoint | None,
    ) -> None:
        self.sample = sample
        """The prompt data's line for this episode."""
        self.prompt_ids = list(prompt_ids)
        """The line's prompt through the chat template, as a single-turn rollout would start."""
        self.tokenizer = tokenizer
        self.params = params
        """The run's sampling parameters (temperature, top-p, top-k, stop tokens)."""
        self.limits = limits
        self._batcher = batcher
        self._endpoint = endpoint
        self._loop = asyncio.get_running_loop()
        self.engine_error: BaseException | None = None

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> Generation:
        """The model's continuation of `prompt_ids` (at most `max_new_tokens`, default and cap
        `--rollout-max-response-len`), batched with the other episodes' turns (the episode's KV kept
        between its calls with `--keep-episode-kv`)."""
        budget = (
            self.limits.max_turn_tokens
            if max_new_tokens is None
            else min(max_new_tokens, self.limits.max_turn_tokens)
        )
        try:
            return await self._batcher.generate(prompt_ids, budget, str(self.sample.index))
        except Exception as exc:
            self.engine_error = exc
            raise EngineFailed(f"the rollout engines failed: {exc}") from exc

    def generate_blocking(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> Generation:
        """`generate` for a plain (not async) function running on its thread."""
        return asyncio.run_coroutine_threadsafe(
            self.generate(prompt_ids, max_new_tokens), self._loop
        ).result()

    def chat(self, tools: Sequence[Any] = ()) -> ChatRenderer:
        """A renderer of this model's chat template (first prompt, context after each turn)."""
        return ChatRenderer(self.tokenizer, tools)

    def trajectory(self, prompt_ids: Sequence[int] | None = None, prompt_text: str = "") -> Trajectory:
        """A new trajectory from `prompt_ids` (default: the line's prompt)."""
        return Trajectory(self.prompt_ids if prompt_ids is None else prompt_ids, prompt_text)

    def endpoint_session(self) -> ChatSession:
        """A chat-completions session of this episode on the run's OpenAI-compatible endpoint: give its
        `base_url` and `api_key` to an OpenAI client; `session.episode()` is what its calls produced."""
        if self._endpoint is None:
            raise RuntimeError("the chat endpoint is not running for this rollout")
        return self._endpoint.session(self.sample.index)


async def run_custom(fn: CustomGenerate, context: EpisodeContext, name: str) -> Episode:
    """`fn(context)` as an episode; a failure of the function is an `EnvFailure` (its episode fails)."""
    try:
        if inspect.iscoroutinefunction(fn):
            result = await fn(context)
        else:
            result = await in_daemon_thread(fn, context, name="tandem-episode")
            if inspect.isawaitable(result):
                result = await result
    except EngineFailed as exc:
        raise exc.__cause__ or exc from None
    except Exception as exc:
        if context.engine_error is not None:
            raise context.engine_error from exc
        raise EnvFailure(
            f"--custom-generate-function-path {name} raised {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(result, Trajectory):
        result = result.finish("done")
    if not isinstance(result, Episode):
        raise EnvFailure(
            f"--custom-generate-function-path {name} returned {type(result).__name__}; return an Episode "
            "(or a Trajectory: ctx.trajectory(), then .finish())"
        )
    return result
