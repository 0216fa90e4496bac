"""The environment an episode talks to: our own small typed interface, sync or async.

An environment is made fresh for each episode by the factory that `--env-path` names
(`module:factory`, or `/path/to/file.py:factory`; the factory takes no argument). It has
two methods, each a plain function or an `async def`:

- `reset(sample) -> observation`: the episode's first observation, from the prompt data's
  sample (`EpisodeSample`);
- `step(turn) -> (observation, reward, done)`: the environment's answer to one model turn
  (`ModelTurn`) that called no tool: the next observation (None: nothing to add), the
  turn's reward (a finite number, 0 when the reward comes only at the end) and whether the
  episode is over.

An observation is a string (one user message) or a list of chat messages
(`{"role": ..., "content": ...}`; the first observation may open with a system message).
An environment may also offer `tools`: Python functions that the model calls in its chat
template's format (`tools`), each result going back as a tool message. docs/design.md,
"Episodes: multi-turn rollouts".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "EnvFactory",
    "EnvFailure",
    "Environment",
    "EpisodeSample",
    "Message",
    "ModelTurn",
    "Observation",
    "ToolCall",
    "checked_messages",
    "checked_step",
]

Message = dict[str, Any]
"""A chat message: `role` and `content` (strings), as transformers' chat templates take them."""

Observation = str | Sequence[Message]
"""What the environment shows the model: a string (one user message) or chat messages."""


@dataclass(frozen=True)
class EpisodeSample:
    """What `reset` is given: one line of the prompt data, and where the episode stands in the rollout."""

    prompt: str | None
    """The line's `prompt` string (None when it gives `messages`)."""
    messages: list[Message] | None
    """The line's chat `messages` (None when it gives a `prompt`)."""
    label: Any
    """The line's `label` (None when it has none)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Every other field of the line."""
    index: int = 0
    """The episode's index in the rollout (its sample index)."""
    seed: int = 0
    """A seed for the environment's own randomness: distinct per episode, the same on every run."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model wrote: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ModelTurn:
    """One turn of the model, as the environment's `step` sees it."""

    text: str
    """The turn decoded without special tokens (what a reward function sees of a response)."""
    token_ids: list[int]
    """The turn's tokens, as sampled (a stop token that ended it included)."""
    index: int
    """The turn's index in the episode (0 for the model's first turn; tool turns count)."""
    truncated: bool = False
    """Whether the turn was cut at `--rollout-max-response-len` (or the episode's token budget)."""


@runtime_checkable
class Environment(Protocol):
    """One episode's environment: `reset(sample)`, then `step(turn)` until done (each sync or async)."""

    def reset(self, sample: EpisodeSample) -> Observation | Awaitable[Observation]: ...

    def step(
        self, turn: ModelTurn
    ) -> tuple[Observation | None, float, bool] | Awaitable[tuple[Observation | None, float, bool]]: ...


EnvFactory = Callable[[], Environment]
"""What `--env-path` names: a callable of no argument that makes one episode's environment."""


class EnvFailure(RuntimeError):
    """An environment raised, returned the wrong types, or did not answer in time: its episode failed."""


def checked_messages(observation: Any, what: str, *, first: bool = False) -> list[Message]:
    """`observation` as chat messages; `EnvFailure` naming `what` when it is not an observation."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if not isinstance(observation, list | tuple) or (first and not observation):
        raise EnvFailure(
            f"{what} returned {_short(observation)}; an observation is a string or a non-empty list of "
            'chat messages {"role": ..., "content": ...}'
        )
    for i, message in enumerate(observation):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise EnvFailure(
                f"{what} returned message {i} = {_short(message)}; a chat message is a dict with string "
                '"role" and "content"'
            )
    return [dict(m) for m in observation]


def checked_step(result: Any, what: str) -> tuple[list[Message], float, bool]:
    """A `step` result as (messages, reward, done); `EnvFailure` naming `what` when it is not one."""
    if not isinstance(result, tuple | list) or len(result) != 3:
        raise EnvFailure(
            f"{what} returned {_short(result)}; step must return a tuple (observation, reward, done)"
        )
    observation, reward, done = result
    messages = [] if observation is None else checked_messages(observation, what)
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EnvFailure(f"{what} returned the reward {_short(reward)}; it must be a finite number")
    if not isinstance(done, bool):
        raise EnvFailure(f"{what} returned done = {_short(done)}; it must be True or False")
    return messages, float(reward), done


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
