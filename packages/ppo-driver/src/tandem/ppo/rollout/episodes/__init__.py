"""Episodes: multi-turn rollouts with an environment, tools and an OpenAI-compatible endpoint.

`environment` (the interface an environment offers: `reset`, `step`), `trajectory` (an
episode's tokens, loss mask and rewards), `chat` (the chat template turn by turn), `tools`
(tool calls in the model's format, run with a timeout), `batcher` (many episodes in flight
on the engines), `runner` (the episode loop), `custom` (a custom generate function),
`endpoint` (chat completions over the engines), `textarena_env` (TextArena's games),
`failures` (failed episodes logged and counted), `loading` (the flags loaded and checked) and
`generation` (a rollout of episodes). Part of the rollout layer: it may import the engines,
torch and transformers, never the config, the run folder or the loop. docs/design.md, "Episodes".

Names are imported on first use: `from tandem.ppo.rollout.episodes import Trajectory`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "EnvFactory": "environment",
    "Environment": "environment",
    "EpisodeSample": "environment",
    "ModelTurn": "environment",
    "Observation": "environment",
    "ToolCall": "environment",
    "Episode": "trajectory",
    "Trajectory": "trajectory",
    "ChatRenderer": "chat",
    "EpisodeContext": "custom",
    "ChatSession": "endpoint",
    "EpisodeLimits": "runner",
    "TextArenaGame": "textarena_env",
}

if TYPE_CHECKING:
    from .chat import ChatRenderer
    from .custom import EpisodeContext
    from .endpoint import ChatSession
    from .environment import EnvFactory, Environment, EpisodeSample, ModelTurn, Observation, ToolCall
    from .runner import EpisodeLimits
    from .textarena_env import TextArenaGame
    from .trajectory import Episode, Trajectory


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ChatRenderer",
    "ChatSession",
    "EnvFactory",
    "Environment",
    "Episode",
    "EpisodeContext",
    "EpisodeLimits",
    "EpisodeSample",
    "ModelTurn",
    "Observation",
    "TextArenaGame",
    "ToolCall",
    "Trajectory",
]
