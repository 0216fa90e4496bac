"""The episode loop in-process: the chat through the template, loss masks, log-probs, rewards at their
tokens, budgets and how episodes end, failed environments, episodes leaving the batch."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest
import torch

from tandem.ppo._recall import RecallEnv
from tandem.ppo.engines import SamplingParams
from tandem.ppo.rollout.data import PromptDataset, PromptRecord
from tandem.ppo.rollout.episodes.chat import ChatRenderer
from tandem.ppo.rollout.episodes.environment import EnvFailure, checked_messages, checked_step
from tandem.ppo.rollout.episodes.failures import EnvFailures, TooManyEnvFailures
from tandem.ppo.rollout.episodes.generation import EpisodeSetup, generate_episodes
from tandem.ppo.rollout.episodes.runner import EpisodeLimits
from tandem.ppo.rollout.train_batches import to_train_batches, training_rewards

from ._stub import LOG_PROB, ScriptedEngine, text_reply, tiny_tokenizer

TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.eos_token_id


def prompts(labels: list[str], prompt: str = "go") -> list[Any]:
    records = [PromptRecord(i, prompt, None, label) for i, label in enumerate(labels)]
    return PromptDataset(records, TOKENIZER, max_prompt_len=64, seed=0).samples


def setup(factory: Any, tmp_path: Any = None, **limits: Any) -> EpisodeSetup:
    values: dict[str, Any] = {"max_turns": 4, "max_turn_tokens": 8, "max_context": 4096, **limits}
    log_dir = None if tmp_path is None else tmp_path / "episodes"
    return EpisodeSetup(
        "test:env",
        EpisodeLimits(**values),
        EnvFailures(environment="test:env", limit=100, log_dir=log_dir),
        factory=factory,
    )


def play(engine: ScriptedEngine, samples: list[Any], the_setup: EpisodeSetup, n: int = 1) -> Any:
    params = SamplingParams(max_new_tokens=8, seed=5)
    return generate_episodes(
        engine,
        samples,
        n_samples_per_prompt=n,
        params=params,
        tokenizer=TOKENIZER,
        setup=the_setup,
        label="t",
    )


def encode(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def test_the_chat_grows_as_the_template_renders_the_whole_conversation() -> None:
    # The first prompt, the model's tokens (ending with EOS) and the context after each turn, joined, are
    # the template's own rendering of the whole conversation: nothing is re-tokenized or lost between turns.
    chat = ChatRenderer(TOKENIZER)
    _, ids = chat.first_prompt([{"role": "user", "content": "go"}])
    ids = ids + encode("ok") + [EOS]
    _, context = chat.after_turn(EOS, [{"role": "user", "content": "7"}])
    ids = ids + context + encode("7") + [EOS]
    expected = TOKENIZER.apply_chat_template(
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "7"},
            {"role": "assistant", "content": "7"},
        ],
        tokenize=False,
    )
    assert TOKENIZER.decode(ids) == expected.rstrip("\n")


def test_a_cut_turn_is_closed_by_the_template() -> None:
    # No stop token: the template's whole end-of-turn text ("</s>\n") comes as context.
    chat = ChatRenderer(TOKENIZER)
    text, _ = chat.after_turn(None, [{"role": "tool", "content": "x"}])
    assert text == "</s>\n<s>tool: x</s>\n<s>assistant: "
    assert chat.after_turn(EOS, [{"role": "tool", "content": "x"}])[0] == "\n<s>tool: x</s>\n<s>assistant: "


def test_a_recall_episode_trains_the_model_tokens_and_rewards_the_second_answer() -> None:
    # The model answers "7" each turn; the hidden digit is 7: the second answer earns 1.
    engine = ScriptedEngine(text_reply(TOKENIZER, "7"), EOS)
    rollout = play(engine, prompts(["7", "3"]), setup(RecallEnv))
    first, second = rollout.episodes
    chat = ChatRenderer(TOKENIZER)
    _, prompt_ids = chat.first_prompt([{"role": "user", "content": "go"}])
    _, context = chat.after_turn(EOS, [{"role": "user", "content": "7"}])
    turn = [*encode("7"), EOS]
    assert first.prompt_ids == prompt_ids
    assert first.token_ids == turn + context + turn
    assert first.loss_mask == [1] * len(turn) + [0] * len(context) + [1] * len(turn)
    assert first.log_probs == [LOG_PROB] * len(turn) + [0.0] * len(context) + [LOG_PROB] * len(turn)
    # The reward lands on the last model token of the second turn: its EOS, the episode's last token.
    assert first.rewards == [(len(first.token_ids) - 1, 1.0)] and first.end == "done" and first.turns == 2
    assert second.reward == pytest.approx(0.1)  # a digit, not the one shown
    assert rollout.rewards == [1.0, pytest.approx(0.1)]
    metrics = rollout.metrics(accuracy_threshold=1.0)
    assert (
        metrics["episodes/turns"] == 2
        and metrics["episodes/end_done"] == 1
        and metrics["episodes/failed"] == 0
    )
    # Both episodes' turns went out together: two engine calls of two sequences each.
    assert [len(p) for p, _ in engine.calls] == [2, 2]


def test_the_training_batch_masks_the_context_and_carries_the_rewards_at_their_tokens() -> None:
    engine = ScriptedEngine(text_reply(TOKENIZER, "7"), EOS)
    rollout = play(engine, prompts(["7"]), setup(RecallEnv))
    (episode,) = rollout.episodes
    (batch,) = to_train_batches(rollout, 1)
    assert batch.tokens[0].tolist() == episode.prompt_ids + episode.token_ids
    assert batch.loss_masks[0].tolist() == episode.loss_mask
    assert batch.rollout_log_probs is not None and batch.rollout_log_probs[0].tolist() == episode.log_probs
    assert batch.step_rewards is not None
    expected = torch.zeros(len(episode.token_ids))
    expected[-1] = 1.0
    assert torch.equal(batch.step_rewards[0], expected) and batch.rewards.tolist() == [1.0]


def test_shaping_adds_its_difference_at_the_last_trainable_token() -> None:
    class Shaping:
        overlong_buffer_len = 1
        overlong_penalty_factor = 0.5
        rollout_max_response_len = 1  # every episode runs past it: the full penalty

    engine = ScriptedEngine(text_reply(TOKENIZER, "7"), EOS)
    rollout = play(engine, prompts(["7"]), setup(RecallEnv))
    rewards, _ = training_rewards(rollout, Shaping())
    (batch,) = to_train_batches(rollout, 1, rewards=rewards)
    assert batch.step_rewards is not None and float(batch.step_rewards[0][-1]) == pytest.approx(0.5)
    assert float(batch.rewards[0]) == pytest.approx(0.5)


class Endless:
    """Never done; rewards 0.25 per turn."""

    def reset(self, sample: Any) -> str:
        return "go"

    def step(self, turn: Any) -> tuple[str, float, bool]:
        return "more", 0.25, False


def test_max_turns_truncates_and_each_turn_reward_lands_on_its_turn() -> None:
    engine = ScriptedEngine(text_reply(TOKENIZER, "a"), EOS)
    rollout = play(engine, prompts(["x"]), setup(Endless, max_turns=3))
    (episode,) = rollout.episodes
    assert episode.end == "max_turns" and episode.truncated and episode.turns == 3
    trained = [i for i, m in enumerate(episode.loss_mask) if m]
    # Each turn is "a" + EOS; each reward sits on its turn's EOS (the odd trained positions).
    assert [p for p, _ in episode.rewards] == trained[1::2] and episode.reward == pytest.approx(0.75)
    assert rollout.generations[0].finish_reason == "length"
    (masked,) = to_train_batches(rollout, 1, filter_truncated=True)
    assert masked.loss_masks[0].sum() == 0


def test_the_episode_token_budget_and_the_context_end_episodes() -> None:
    engine = ScriptedEngine(text_reply(TOKENIZER, "abc"), EOS)
    (by_tokens,) = play(engine, prompts(["x"]), setup(Endless, max_turns=9, max_episode_tokens=10)).episodes
    assert by_tokens.end == "episode_tokens" and len(by_tokens.token_ids) <= 10
    (by_context,) = play(engine, prompts(["x"]), setup(Endless, max_turns=9, max_context=60)).episodes
    assert by_context.end == "context" and len(by_context.prompt_ids) + len(by_context.token_ids) <= 60


def test_a_turn_cut_at_its_budget_goes_on_and_is_counted() -> None:
    engine = ScriptedEngine(text_reply(TOKENIZER, "abcdefghij"), EOS)
    rollout = play(engine, prompts(["x"]), setup(Endless, max_turns=2, max_turn_tokens=4))
    (episode,) = rollout.episodes
    assert episode.turns == 2 and episode.cut_turns == 2
    assert rollout.metrics(accuracy_threshold=1.0)["episodes/cut_turns"] == 2


class Raises:
    def __init__(self, where: str) -> None:
        self.where = where

    def reset(self, sample: Any) -> str:
        if self.where == "reset":
            raise RuntimeError("reset broke")
        return "go"

    def step(self, turn: Any) -> Any:
        if self.where == "step":
            raise KeyError("step broke")
        if self.where == "types":
            return "obs", "high", False
        if self.where == "hang":
            time.sleep(2)
        return None, 1.0, True


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("reset", "reset raised RuntimeError: reset broke"),
        ("step", "step raised KeyError"),
        ("types", "returned the reward 'high'; it must be a finite number"),
        ("hang", "did not return within --env-timeout 0.2 s"),
    ],
)
def test_an_environment_that_fails_fails_its_episode_and_the_rollout_goes_on(
    where: str, message: str, tmp_path: Any
) -> None:
    kinds = iter([where, "fine"])
    engine = ScriptedEngine(text_reply(TOKENIZER, "7"), EOS)
    rollout = play(
        engine, prompts(["7", "7"]), setup(lambda: Raises(next(kinds)), tmp_path, env_timeout_s=0.2)
    )
    failed, fine = rollout.episodes
    assert failed.failed and message in (failed.failure or "")
    assert sum(failed.loss_mask) == 0 and failed.reward == 0.0
    assert fine.end == "done" and fine.reward == 1.0
    assert rollout.metrics(accuracy_threshold=1.0)["episodes/failed"] == 1
    (log,) = (tmp_path / "episodes").iterdir()
    assert "test:env" in log.read_text() and message in log.read_text()
    to_train_batches(rollout, 1)  # a failed episode still makes a valid (untrained) sample


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ("done", "step must return a tuple (observation, reward, done)"),
        (("obs", 1.0), "step must return a tuple (observation, reward, done)"),
        ((3, 1.0, True), "an observation is a string or a non-empty list of chat messages"),
        (([{"role": "user"}], 1.0, True), "message 0 = {'role': 'user'}; a chat message is a dict"),
        (("obs", float("nan"), True), "the reward nan; it must be a finite number"),
        (("obs", True, True), "the reward True; it must be a finite number"),
        (("obs", 1.0, "yes"), "done = 'yes'; it must be True or False"),
    ],
)
def test_each_wrong_type_from_step_is_named(result: Any, message: str) -> None:
    with pytest.raises(EnvFailure, match=re.escape(message)):
        checked_step(result, "Env.step")


def test_a_step_result_of_the_right_types_is_taken() -> None:
    assert checked_step(("obs", 1, False), "Env.step") == ([{"role": "user", "content": "obs"}], 1.0, False)
    assert checked_step([None, 0.5, True], "Env.step") == ([], 0.5, True)
    with pytest.raises(EnvFailure, match="non-empty list"):
        checked_messages([], "Env.reset", first=True)


def test_past_max_env_failures_the_run_stops_naming_the_environment_the_sample_and_its_log(
    tmp_path: Any,
) -> None:
    the_setup = setup(lambda: Raises("step"), tmp_path)
    the_setup.failures.limit = 2
    engine = ScriptedEngine(text_reply(TOKENIZER, "7"), EOS)
    play(engine, prompts(["1", "2"]), the_setup)  # 2 failures: at the limit, not past it
    with pytest.raises(
        TooManyEnvFailures, match=r"test:env.*3 episodes failed.*sample 0 \(prompt 'go', label '5'\).*\.log"
    ):
        play(engine, prompts(["5"]), the_setup)


def test_an_engine_error_is_the_runs_own() -> None:
    class Broken(ScriptedEngine):
        def generate(self, prompts: Any, params: Any) -> Any:
            raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        play(Broken(text_reply(TOKENIZER, "7"), EOS), prompts(["7"]), setup(RecallEnv))


def test_finished_episodes_leave_the_batch() -> None:
    class Stops:
        """Ends after `turns` model turns (the sample's label)."""

        def reset(self, sample: Any) -> str:
            self.turns = int(sample.label)
            return "go"

        def step(self, turn: Any) -> tuple[str, float, bool]:
            return "on", 0.0, turn.index + 1 == self.turns

    engine = ScriptedEngine(text_reply(TOKENIZER, "a"), EOS)
    play(engine, prompts(["1", "3", "2", "3"]), setup(Stops))
    assert [len(p) for p, _ in engine.calls] == [4, 3, 2]
    # Each call samples with its own seed, from the rollout's.
    assert len({params.seed for _, params in engine.calls}) == 3


def test_async_environments_run_concurrently() -> None:
    class Slow:
        async def reset(self, sample: Any) -> str:
            await asyncio.sleep(0.3)
            return "go"

        async def step(self, turn: Any) -> tuple[None, float, bool]:
            return None, 1.0, True

    engine = ScriptedEngine(text_reply(TOKENIZER, "7"), EOS)
    rollout = play(engine, prompts(["7"] * 4), setup(Slow))
    # Four resets of 0.3 s overlap: one batch of all four episodes' first turns.
    assert [len(p) for p, _ in engine.calls] == [4] and rollout.rewards == [1.0] * 4
