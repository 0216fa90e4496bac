"""The episode loop: reset, then model turn → tools or environment step → context, until an end.

`run_episode` plays one episode against a fresh environment; `play_episodes` runs all the
episodes of a rollout at once in one event loop, their model turns batched on the engines
(`batcher.TurnBatcher`). What ends an episode (`trajectory.END_REASONS`): the environment's
`done`; `--max-turns` model turns; `--max-episode-tokens` tokens after the first prompt
(model and context); the engines' context. A model turn cut at `--rollout-max-response-len`
is counted (`episodes/cut_turns`) and goes on to the environment as it is.

Everything the environment does runs guarded (`EnvCalls`): an exception, a result of the wrong
type or a call past `--env-timeout` fails the episode (it trains nothing and is counted); any
other error (an engine's) is the run's own and propagates. Plain (not `async`) environment
methods run one at a time on a daemon thread of their own, in the order the episodes call them
(an environment library may keep global state, as TextArena's games seed Python's `random`); a
call that times out leaves that thread behind (neither the rollout nor the process waits for
it) and the next call gets a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.ppo.rollout.episodes.batcher import TurnBatcher
from tandem.ppo.rollout.episodes.chat import ChatRenderer
from tandem.ppo.rollout.episodes.environment import (
    EnvFactory,
    EnvFailure,
    EpisodeSample,
    ModelTurn,
    checked_messages,
    checked_step,
)
from tandem.ppo.rollout.episodes.threads import DaemonWorker
from tandem.ppo.rollout.episodes.tools import ParsedCalls, ToolBox, parse_tool_calls
from tandem.ppo.rollout.episodes.trajectory import EndReason, Episode, Trajectory

__all__ = ["EnvCalls", "EpisodeLimits", "failure_text", "play_episodes", "run_episode"]


@dataclass(frozen=True)
class EpisodeLimits:
    """The budgets of one episode and the patience with its environment and tools."""

    max_turns: int
    """Model turns at most (`--max-turns`; a turn that calls tools counts)."""
    max_turn_tokens: int
    """Tokens of one model turn at most (`--rollout-max-response-len`)."""
    max_context: int | None = None
    """First prompt and everything after it, at most (the engines' context, set once they run)."""
    max_episode_tokens: int | None = None
    """Tokens after the first prompt at most, model's and context (`--max-episode-tokens`); None: no limit
    but the context."""
    env_timeout_s: float = 60.0
    """Seconds one environment call may take (`--env-timeout`)."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may take (`--tool-timeout`)."""


class EnvCalls:
    """Runs an environment's methods guarded: any failure is an `EnvFailure` (see the module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._worker = DaemonWorker("tandem-env")
        self._queue = asyncio.Lock()

    async def __call__(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            if inspect.iscoroutinefunction(fn):
                return await asyncio.wait_for(fn(*args), self.timeout_s)
            async with self._queue:
                try:
                    result = await asyncio.wait_for(self._worker.run(fn, *args), self.timeout_s)
                except TimeoutError:
                    # The call keeps its (daemon) thread; the next one gets a new thread.
                    self._worker.stop()
                    self._worker = DaemonWorker("tandem-env")
                    raise
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(_awaited(result), self.timeout_s)
            return result
        except TimeoutError:
            raise EnvFailure(f"{what} did not return within --env-timeout {self.timeout_s:g} s") from None
        except EnvFailure:
            raise
        except Exception as exc:
            raise EnvFailure(f"{what} raised {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        self._worker.stop()


async def _awaited(result: Awaitable[Any]) -> Any:
    return await result


def failure_text(exc: BaseException) -> str:
    """An episode's failure for its log: the exception and its traceback."""
    return "".join(traceback.format_exception(exc)).rstrip()


async def run_episode(
    factory: EnvFactory,
    sample: EpisodeSample,
    *,
    batcher: TurnBatcher,
    tokenizer: Any,
    limits: EpisodeLimits,
    env_calls: EnvCalls,
    fallback_prompt: Sequence[int],
) -> Episode:
    """One episode of a fresh environment from `factory` (see the module docstring).

    `fallback_prompt`: the sample's own prompt tokens, the first prompt of an episode whose
    environment failed before it gave one.
    """
    name = getattr(factory, "__qualname__", None) or type(factory).__name__
    trajectory: Trajectory | None = None
    env: Any = None
    try:
        env = await env_calls(f"the environment factory {name}", factory)
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise EnvFailure(f"{name}() made {type(env).__name__}, which has no {method}() method")
        first = await env_calls(f"{type(env).__name__}.reset", env.reset, sample)
        messages = checked_messages(first, f"{type(env).__name__}.reset", first=True)
        try:
            tools = ToolBox(getattr(env, "tools", None) or (), timeout_s=limits.tool_timeout_s)
            chat = ChatRenderer(tokenizer, tools.schemas)
        except (TypeError, ValueError) as exc:  # transformers reads each tool's schema from its docstring
            raise EnvFailure(
                f"the tools of {type(env).__name__} cannot be offered to the model: {exc}"
            ) from exc
        text, prompt_ids = chat.first_prompt(messages)
        trajectory = Trajectory(prompt_ids, text)
        trajectory.transcript.extend(messages)
        end = await _turns(
            str(sample.index), env, trajectory, chat, tools, batcher, tokenizer, limits, env_calls
        )
    except EnvFailure as exc:
        failed = trajectory or Trajectory(fallback_prompt, "")
        episode = failed.finish("failed")
        episode.failure = failure_text(exc)
        return episode
    finally:
        batcher.leave()
        close = getattr(env, "close", None)
        if callable(close):
            with contextlib.suppress(EnvFailure):  # the episode is over; a failing close loses nothing of it
                await env_calls(f"{type(env).__name__}.close", close)
    return trajectory.finish(end)


async def _turns(
    session: str,
    env: Any,
    trajectory: Trajectory,
    chat: ChatRenderer,
    tools: ToolBox,
    batcher: TurnBatcher,
    tokenizer: Any,
    limits: EpisodeLimits,
    env_calls: EnvCalls,
) -> EndReason:
    """The model's turns until an end; each turn's tool results or the environment's answer as context."""
    for index in range(limits.max_turns):
        budget = limits.max_turn_tokens
        if limits.max_context is not None:
            budget = min(budget, limits.max_context - len(trajectory.context_ids))
        if limits.max_episode_tokens is not None:
            budget = min(budget, limits.max_episode_tokens - len(trajectory))
        if budget <= 0:
            return _budget_end(trajectory, limits)
        generation = await batcher.generate(trajectory.context_ids, budget, session)
        trajectory.add_model(generation)
        cut = generation.finish_reason == "length"
        text = tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        trajectory.transcript.append({"role": "assistant", "content": text})
        parsed = (
            parse_tool_calls(tokenizer.decode(generation.token_ids, skip_special_tokens=False))
            if tools
            else ParsedCalls([], [])
        )
        if parsed:
            messages = await tools.run(parsed, trajectory.counts)
            done = False
        else:
            turn = ModelTurn(text, list(generation.token_ids), index, truncated=cut)
            result = await env_calls(f"{type(env).__name__}.step", env.step, turn)
            messages, reward, done = checked_step(result, f"{type(env).__name__}.step")
            trajectory.add_reward(reward)
        trajectory.transcript.extend(messages)
        if done:
            return "done"
        if index + 1 == limits.max_turns:
            break
        last = generation.token_ids[-1] if generation.token_ids and not cut else None
        _, context = chat.after_turn(last, messages)
        if (
            limits.max_episode_tokens is not None
            and len(trajectory) + len(context) > limits.max_episode_tokens
        ):
            return "episode_tokens"
        if (
            limits.max_context is not None
            and len(trajectory.context_ids) + len(context) >= limits.max_context
        ):
            return "context"
        trajectory.add_context(context)
    return "max_turns"


def _budget_end(trajectory: Trajectory, limits: EpisodeLimits) -> EndReason:
    if limits.max_episode_tokens is not None and len(trajectory) >= limits.max_episode_tokens:
        return "episode_tokens"
    return "context"


async def play_episodes(
    run: Callable[[int, TurnBatcher, EnvCalls], Awaitable[Episode]],
    count: int,
    *,
    batcher: TurnBatcher,
    env_calls: EnvCalls,
) -> list[Episode]:
    """`count` episodes at once (`run(i, batcher, env_calls)` plays episode `i`), in order."""
    try:
        return list(await asyncio.gather(*(run(i, batcher, env_calls) for i in range(count))))
    finally:
        env_calls.close()
