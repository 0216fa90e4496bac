"""TextArena's single-player games through the adapter (`--env-path textarena:GameId`), on the real
library, without a model: a scripted player wins GuessTheNumber by bisection, inside the episode loop too."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from tandem.ppo.engines import SamplingParams
from tandem.ppo.rollout.data import PromptDataset, PromptRecord
from tandem.ppo.rollout.episodes.environment import EpisodeSample, ModelTurn
from tandem.ppo.rollout.episodes.failures import EnvFailures
from tandem.ppo.rollout.episodes.generation import EpisodeSetup, generate_episodes
from tandem.ppo.rollout.episodes.loading import load_env_factory
from tandem.ppo.rollout.episodes.runner import EpisodeLimits

from ._stub import ScriptedEngine, tiny_tokenizer


def turn(text: str, index: int = 0) -> ModelTurn:
    return ModelTurn(text, [], index)


def bisect(game: Any, low: int = 1, high: int = 20) -> tuple[int, float]:
    """Play GuessTheNumber by bisection; (guesses, final reward)."""
    for guesses in range(1, 11):
        guess = (low + high) // 2
        observation, reward, done = game.step(turn(f"[{guess}]"))
        if done:
            return guesses, reward
        if "higher" in (observation or ""):
            low = guess + 1
        else:
            high = guess - 1
    raise AssertionError("bisection needs at most 5 guesses over 1..20")


def test_guess_the_number_is_won_by_bisection_and_the_global_random_is_left_alone() -> None:
    factory = load_env_factory("textarena:GuessTheNumber-v0")
    random.seed(123)
    before = random.getstate()
    game = factory()
    first = game.reset(EpisodeSample(None, None, None, seed=7))
    assert "Guess The Number" in first and "between 1 and 20" in first
    guesses, reward = bisect(game)
    assert reward == 1.0 and guesses <= 5
    assert random.getstate() == before  # TextArena seeds the global random; the adapter restores it
    # The same seed draws the same number: the bisection takes the same path.
    again = factory()
    again.reset(EpisodeSample(None, None, None, seed=7))
    assert bisect(again) == (guesses, reward)


def test_a_bad_move_is_the_games_message_and_the_seed_comes_from_the_data() -> None:
    game = load_env_factory("textarena:GuessTheNumber-v0")()
    game.reset(EpisodeSample(None, None, None, metadata={"seed": 3}, seed=99))
    observation, reward, done = game.step(turn("no brackets"))
    assert "invalid move" in (observation or "").lower() and reward == 0.0 and not done


@pytest.mark.parametrize(
    ("game_id", "opening"), [("Mastermind-v0", "Mastermind"), ("TowerOfHanoi-v0", "Tower of Hanoi")]
)
def test_other_offline_games_start(game_id: str, opening: str) -> None:
    game = load_env_factory(f"textarena:{game_id}")()
    assert opening in game.reset(EpisodeSample(None, None, None, seed=1))


def test_an_episode_of_the_game_in_the_loop() -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["[", "]"])
    eos = tokenizer.eos_token_id
    low_high = {"low": 1, "high": 20, "guess": 0}

    def reply(prompt: list[int]) -> list[int]:
        text = tokenizer.decode(prompt)
        last = text.rsplit("assistant:", 2)[-2] if text.count("assistant:") > 1 else ""
        if re.search(r"higher", last):
            low_high["low"] = low_high["guess"] + 1
        elif re.search(r"lower", last):
            low_high["high"] = low_high["guess"] - 1
        low_high["guess"] = (low_high["low"] + low_high["high"]) // 2
        return [*tokenizer(f"[{low_high['guess']}]", add_special_tokens=False)["input_ids"], eos]

    samples = PromptDataset(
        [PromptRecord(0, "play", None, None, {"seed": 7})], tokenizer, max_prompt_len=64, seed=0
    )
    setup = EpisodeSetup(
        "textarena:GuessTheNumber-v0",
        EpisodeLimits(max_turns=10, max_turn_tokens=8, max_context=100_000),
        EnvFailures(environment="textarena:GuessTheNumber-v0", limit=0, log_dir=None),
        factory=load_env_factory("textarena:GuessTheNumber-v0"),
    )
    rollout = generate_episodes(
        ScriptedEngine(reply, eos),
        samples.samples,
        n_samples_per_prompt=1,
        params=SamplingParams(seed=1),
        tokenizer=tokenizer,
        setup=setup,
        label="t",
    )
    (episode,) = rollout.episodes
    assert episode.end == "done" and episode.reward == 1.0 and 1 < episode.turns <= 5
    # The game's hints are context ("higher"/"lower" have no capitals: the tiny vocabulary keeps them).
    decoded = tokenizer.decode(
        [t for t, m in zip(episode.token_ids, episode.loss_mask, strict=True) if not m]
    )
    assert "higher" in decoded or "lower" in decoded
