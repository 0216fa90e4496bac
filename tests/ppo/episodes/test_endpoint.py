"""The OpenAI-compatible chat endpoint over a scripted engine, driven by the real `openai` client: each
call's prompt and completion tokens and log-probs are the episode's, nothing is re-tokenized, tool calls
come back as `tool_calls`, and every request needs the key."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from tandem.ppo.engines import SamplingParams
from tandem.ppo.rollout.data import PromptDataset, PromptRecord
from tandem.ppo.rollout.episodes.chat import ChatRenderer
from tandem.ppo.rollout.episodes.endpoint import EndpointOptions
from tandem.ppo.rollout.episodes.failures import EnvFailures
from tandem.ppo.rollout.episodes.generation import EpisodeSetup, generate_episodes
from tandem.ppo.rollout.episodes.runner import EpisodeLimits

from ._stub import LOG_PROB, ScriptedEngine, tiny_tokenizer

KEY = "test-key-123"
TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.eos_token_id
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
TOKENIZER.add_tokens([CALL])  # the tiny vocabulary lacks characters of a call: one added token
CALL_ID = TOKENIZER.convert_tokens_to_ids(CALL)


def encode(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def reply(prompt: list[int]) -> list[int]:
    """`ok` to the first user turn, a tool call to `add`, `5` after a tool result."""
    text = TOKENIZER.decode(prompt)
    if text.endswith("tool: 5</s>\n<s>assistant: "):
        return [*encode("5"), EOS]
    if "add" in text.rsplit("user:", 1)[-1]:
        return [CALL_ID, EOS]
    return [*encode("ok"), EOS]


def play(agent: Any, tmp_path: Any = None) -> Any:
    engine = ScriptedEngine(reply, EOS)
    samples = PromptDataset([PromptRecord(0, "go", None, None)], TOKENIZER, max_prompt_len=64, seed=0).samples
    setup = EpisodeSetup(
        "agent",
        EpisodeLimits(max_turns=4, max_turn_tokens=8, max_context=4096),
        EnvFailures(environment="agent", limit=1, log_dir=None, flag="--custom-generate-function-path"),
        custom=agent,
        endpoint=EndpointOptions("127.0.0.1", 0, KEY),
    )
    rollout = generate_episodes(
        engine,
        samples,
        n_samples_per_prompt=1,
        params=SamplingParams(seed=3),
        tokenizer=TOKENIZER,
        setup=setup,
        label="t",
    )
    return rollout, engine


SEEN: dict[str, Any] = {}


async def two_turns(ctx: Any) -> Any:
    session = ctx.endpoint_session()
    client = session.async_client(max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    first = await client.chat.completions.create(
        model="policy", messages=messages, logprobs=True, max_tokens=4
    )
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "add"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    call = second.choices[0].message.tool_calls[0]
    messages += [
        second.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    third = await client.chat.completions.create(model="policy", messages=messages)
    SEEN.update(first=first, second=second, third=third, calls=session.calls, key=session.api_key)
    session.add_reward(1.0)
    await client.close()
    return session.episode()


def test_an_agent_on_the_openai_client_makes_the_episode_without_retokenizing() -> None:
    rollout, engine = play(two_turns)
    (episode,) = rollout.episodes
    first, second, third = SEEN["first"], SEEN["second"], SEEN["third"]
    assert first.choices[0].message.content == "ok" and first.choices[0].finish_reason == "stop"
    assert [t.logprob for t in first.choices[0].logprobs.content] == [LOG_PROB] * 3
    assert first.usage.completion_tokens == 3
    (call,) = second.choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert second.choices[0].finish_reason == "tool_calls"
    assert third.choices[0].message.content == "5"
    # Each call's prompt is the previous call's prompt and completion, then the new messages as context.
    calls = SEEN["calls"]
    chat = ChatRenderer(TOKENIZER)
    _, prompt = chat.first_prompt([{"role": "user", "content": "go"}])
    assert calls[0].prompt_ids == prompt
    _, context = chat.after_turn(EOS, [{"role": "user", "content": "add"}])
    assert calls[1].prompt_ids == prompt + calls[0].completion_ids + context
    assert calls[2].prompt_ids[: len(calls[1].prompt_ids) + 2] == [*calls[1].prompt_ids, CALL_ID, EOS]
    # The episode is the last prompt and its completion; only the completions train, with their log-probs.
    assert episode.prompt_ids + episode.token_ids == calls[2].prompt_ids + calls[2].completion_ids
    trained = [t for t, m in zip(episode.token_ids, episode.loss_mask, strict=True) if m]
    assert trained == [c for call in calls for c in call.completion_ids]
    assert [p for p, m in zip(episode.log_probs, episode.loss_mask, strict=True) if m] == [LOG_PROB] * len(
        trained
    )
    assert episode.reward == 1.0 and episode.counts == {"endpoint/calls": 3.0}
    assert [len(p) for p, _ in engine.calls] == [1, 1, 1]


def plain(ctx: Any) -> Any:
    session = ctx.endpoint_session()
    SEEN["base_url"] = session.base_url
    # Each client and the refused response closed here: a socket left to the collector warns in a later test.
    with session.client(max_retries=0) as client:
        answer = client.chat.completions.create(model="p", messages=[{"role": "user", "content": "go"}])
        with (
            openai.OpenAI(base_url=session.base_url, api_key="wrong", max_retries=0) as wrong,
            pytest.raises(openai.AuthenticationError),
        ):
            wrong.chat.completions.create(model="p", messages=[{"role": "user", "content": "go"}])
        request = urllib.request.Request(session.base_url + "/models")  # no key at all
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=10)
        SEEN["no_key_status"] = raised.value.code
        raised.value.close()
        # Rewriting the history starts the trajectory again.
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "other"}])
    session.add_reward(float(answer.choices[0].message.content == "ok"))
    return session.episode()


def test_a_plain_function_with_the_sync_client_and_the_key_on_every_request() -> None:
    rollout, _ = play(plain)
    (episode,) = rollout.episodes
    assert episode.reward == 1.0 and SEEN["no_key_status"] == 401
    assert episode.counts == {"endpoint/calls": 2.0, "endpoint/restarts": 1.0}
    assert SEEN["base_url"].startswith("http://127.0.0.1:")
    assert KEY not in repr(EndpointOptions("127.0.0.1", 0, KEY))


def test_an_agent_that_raises_fails_its_episode() -> None:
    async def broken(ctx: Any) -> Any:
        raise ValueError("agent bug")

    rollout, _ = play(broken)
    (episode,) = rollout.episodes
    assert episode.failed and "agent bug" in (episode.failure or "")
