"""TextArena's single-player games as environments: `--env-path textarena:GameId` (extra `textarena`).

TextArena (PyPI `textarena`) holds text games for language models; its single-player ones
(GuessTheNumber-v0, Mastermind-v0, TowerOfHanoi-v0, ...) run offline. Wordle asks nltk to
download a word list and fails offline. Each episode makes the game's raw environment
(`GameId-raw`: no wrapper re-sends the whole history, since the chat keeps it), resets it
with the episode's seed, and shows the model the game's new messages at each turn, its own
action left out. The game's reward comes when it ends (TextArena's games score at the end:
1 for a win, a share of the way to it, -1 or less for a losing invalid move), at the last
model token.

TextArena seeds Python's global `random` in `reset` and draws from it during the game, so
each episode keeps its own random state, swapped in around each of its calls and the driver's
restored after (the environment's calls run one at a time: `runner.EnvCalls`).
"""

from __future__ import annotations

import functools
import random
from typing import Any

from tandem.ppo.rollout.episodes.environment import EpisodeSample, ModelTurn

__all__ = ["INSTALL_HINT", "TextArenaGame", "textarena_factory"]

INSTALL_HINT = "pip install 'tandem-ppo-driver[textarena]' (or textarena)"

_PLAYER = 0


def _textarena() -> Any:
    try:
        import textarena
    except ImportError as exc:
        raise ValueError(f"--env-path textarena:...: TextArena is not installed; {INSTALL_HINT}") from exc
    return textarena


class TextArenaGame:
    """One episode of a TextArena single-player game (see the module docstring)."""

    def __init__(self, game_id: str) -> None:
        self.game_id = game_id
        self._env: Any = None
        self._random: Any = None

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn` with this episode's random state in Python's global `random`, the caller's restored after."""
        outer = random.getstate()
        if self._random is not None:
            random.setstate(self._random)
        try:
            return fn(*args, **kwargs)
        finally:
            self._random = random.getstate()
            random.setstate(outer)

    def reset(self, sample: EpisodeSample) -> str:
        textarena = _textarena()
        seed = int(sample.metadata.get("seed", sample.seed))
        self._env = textarena.make(f"{self.game_id}-raw")
        self._call(self._env.reset, num_players=1, seed=seed)
        return self._observation()

    def step(self, turn: ModelTurn) -> tuple[str | None, float, bool]:
        if self._env is None:
            raise RuntimeError("step before reset")
        done, _ = self._call(self._env.step, action=turn.text)
        observation = self._observation()
        if not done:
            return observation or None, 0.0, False
        rewards, _ = self._call(self._env.close)
        reward = (rewards or {}).get(_PLAYER, 0.0)
        return observation or None, float(reward), True

    def _observation(self) -> str:
        _, messages = self._call(self._env.get_observation)
        return "\n".join(str(text) for sender, text, *_ in messages if sender != _PLAYER).strip()


def textarena_factory(game_id: str) -> functools.partial[TextArenaGame]:
    """A factory of `game_id`'s episodes, checked: TextArena installed, the game registered and single-player."""
    textarena = _textarena()
    registry = textarena.envs.registration.ENV_REGISTRY
    if f"{game_id}-raw" not in registry:
        known = sorted(k for k in registry if k.endswith("-v0"))
        raise ValueError(
            f"--env-path textarena:{game_id}: TextArena has no game {game_id!r}; single-player games include "
            f"GuessTheNumber-v0, Mastermind-v0, TowerOfHanoi-v0 (all: {', '.join(known[:40])}, ...)"
        )
    probe = TextArenaGame(game_id)
    try:
        probe.reset(EpisodeSample(prompt=None, messages=None, label=None, seed=0))
    except Exception as exc:
        problem = " ".join(str(exc).replace("*", " ").split())[:200]
        raise ValueError(
            f"--env-path textarena:{game_id}: the game does not start as a single-player game offline "
            f"({type(exc).__name__}: {problem}); pick a single-player game that runs offline (GuessTheNumber-v0, "
            "Mastermind-v0, TowerOfHanoi-v0)"
        ) from exc
    return functools.partial(TextArenaGame, game_id)
