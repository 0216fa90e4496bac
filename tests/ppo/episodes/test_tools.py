"""Tool calls in the model's format: parsed, run, their results and every kind of error as tool messages,
counted; an episode that calls tools, through the chat template."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from tandem.ppo.engines import SamplingParams
from tandem.ppo.rollout.data import PromptDataset, PromptRecord
from tandem.ppo.rollout.episodes.failures import EnvFailures
from tandem.ppo.rollout.episodes.generation import EpisodeSetup, generate_episodes
from tandem.ppo.rollout.episodes.runner import EpisodeLimits
from tandem.ppo.rollout.episodes.tools import ParsedCalls, ToolBox, parse_tool_calls

from ._stub import ScriptedEngine, tiny_tokenizer


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise ZeroDivisionError("no")


def slow(x: int) -> int:
    """Sleeps.

    Args:
        x: anything
    """
    time.sleep(0.4)
    return x


async def lookup(key: str) -> dict[str, str]:
    """Looks a key up.

    Args:
        key: the key
    """
    return {"key": key, "value": key.upper()}


def test_well_formed_calls_are_parsed_in_order() -> None:
    text = (
        'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"k\\"}"}</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("add", {"a": 1, "b": 2}),
        ("lookup", {"key": "k"}),
    ]
    assert parsed.malformed == [] and parsed
    assert not parse_tool_calls("no tools here")


def test_malformed_calls_are_named() -> None:
    parsed = parse_tool_calls(
        '<tool_call>{"name": add}</tool_call><tool_call>[1, 2]</tool_call>'
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call><tool_call>{"name": "add"'
    )
    assert parsed.calls == []
    assert [m.split(" (")[0].split(" is ")[-1][:12] for m in parsed.malformed][:1] == ["not JSON"]
    assert 'not an object with a "name"' in parsed.malformed[1]
    assert "not a JSON object" in parsed.malformed[2]
    assert "not closed" in parsed.malformed[3]


def test_every_error_is_a_tool_message_and_counted() -> None:
    box = ToolBox([add, broken, slow, lookup], timeout_s=0.2)
    parsed = parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "slow", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        "<tool_call>{oops}</tool_call>"
    )
    counts: dict[str, float] = {}
    messages = asyncio.run(box.run(parsed, counts))
    assert all(m["role"] == "tool" for m in messages)
    contents = [m["content"] for m in messages]
    assert "malformed tool call" in contents[0]
    assert contents[1] == "5" and json.loads(contents[2]) == {"key": "k", "value": "K"}
    assert "unknown tool 'nope'" in contents[3] and "add, broken, lookup, slow" in contents[3]
    assert "ZeroDivisionError" in contents[4]
    assert "longer than 0.2 s" in contents[5]
    assert "raised TypeError" in contents[6]  # a missing argument: the tool raised
    assert counts == {
        "tools/calls": 7.0,
        "tools/errors_malformed": 1.0,
        "tools/errors_unknown": 1.0,
        "tools/errors_raised": 2.0,
        "tools/errors_timeout": 1.0,
    }


class Calculator:
    """The model must call `add`; the environment rewards the final answer 5."""

    tools = (add,)

    def reset(self, sample: Any) -> str:
        return "what is 2 and 3"

    def step(self, turn: Any) -> tuple[None, float, bool]:
        return None, float(turn.text.strip() == "5"), True


def test_an_episode_with_tools_runs_them_and_the_results_are_context() -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (  # a template that lists the tools and renders tool messages
        "{% if tools %}<s>system: tools {% for t in tools %}{{ t['function']['name'] }} {% endfor %}</s>\n{% endif %}"
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    eos = tokenizer.eos_token_id
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    # The tiny vocabulary lacks some characters of a call, so the stub answers with token ids of
    # added tokens for the call, and "5" after a tool message.
    tokenizer.add_tokens([call])
    call_id = tokenizer.convert_tokens_to_ids(call)
    five = tokenizer("5", add_special_tokens=False)["input_ids"]

    def reply(prompt: list[int]) -> list[int]:
        return [*five, eos] if "tool: 5" in tokenizer.decode(prompt) else [call_id, eos]

    engine = ScriptedEngine(reply, eos)
    samples = PromptDataset([PromptRecord(0, "x", None, None)], tokenizer, max_prompt_len=64, seed=0).samples
    setup = EpisodeSetup(
        "calc",
        EpisodeLimits(max_turns=3, max_turn_tokens=8, max_context=4096),
        EnvFailures(environment="calc", limit=0, log_dir=None),
        factory=Calculator,
    )
    rollout = generate_episodes(
        engine,
        samples,
        n_samples_per_prompt=1,
        params=SamplingParams(seed=1),
        tokenizer=tokenizer,
        setup=setup,
        label="t",
    )
    (episode,) = rollout.episodes
    assert episode.reward == 1.0 and episode.turns == 2 and episode.end == "done"
    assert episode.prompt_text.startswith("<s>system: tools add </s>")
    text = tokenizer.decode(episode.token_ids)
    assert "<s>tool: 5</s>" in text and episode.counts == {"tools/calls": 1.0}
    # The tool result is context: only the two turns' tokens train.
    assert sum(episode.loss_mask) == 2 + len(five) + 1
    assert rollout.metrics(accuracy_threshold=1.0)["tools/calls"] == 1.0
    assert not ParsedCalls([], [])
