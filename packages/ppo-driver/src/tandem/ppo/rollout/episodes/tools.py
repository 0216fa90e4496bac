"""Tools: Python functions the model calls in its chat template's format, their results as tool messages.

A call is the Hermes / Qwen format that transformers' chat templates describe when given
`tools=`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the model's turn
(several calls in one turn run in order). Each call's result, or its error, goes back as
a tool message (`{"role": "tool", "name": ..., "content": ...}`), which the chat template
renders as its model family expects. A malformed call (no JSON object, no name, arguments
that are not an object, an unclosed tag), an unknown tool, a tool that raises and one that
runs past `--tool-timeout` each become an error message to the model, as agent frameworks
do, and are counted (`tools/calls`, `tools/errors_<kind>`); none stops the run.

A tool is a plain function or an `async def` with type hints and a docstring whose `Args:`
describe its parameters (transformers builds its JSON schema from them). A plain function
runs on a daemon thread of its own (`threads`), so that a timeout can leave it behind: neither
the episode nor the rollout waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tandem.ppo.rollout.episodes.environment import Message, ToolCall
from tandem.ppo.rollout.episodes.threads import in_daemon_thread

__all__ = ["TOOL_ERRORS", "ParsedCalls", "ToolBox", "parse_tool_calls"]

ToolError = Literal["malformed", "unknown", "raised", "timeout"]
TOOL_ERRORS: tuple[ToolError, ...] = ("malformed", "unknown", "raised", "timeout")

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ParsedCalls:
    """The tool calls of one model turn: the well-formed ones and an error message per malformed one."""

    calls: list[ToolCall]
    malformed: list[str]

    def __bool__(self) -> bool:
        return bool(self.calls or self.malformed)


def parse_tool_calls(text: str) -> ParsedCalls:
    """The `<tool_call>` blocks of `text` (special tokens kept), in order."""
    calls: list[ToolCall] = []
    malformed: list[str] = []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            malformed.append(f"the tool call {_short(body)} is not JSON ({exc.msg})")
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            malformed.append(f'the tool call {_short(body)} is not an object with a "name" string')
            continue
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            malformed.append(f'the tool call {_short(body)} has "arguments" that are not a JSON object')
            continue
        calls.append(ToolCall(payload["name"], arguments))
    rest = _CALL.sub("", text)
    if "<tool_call>" in rest:
        malformed.append("a <tool_call> tag is not closed with </tool_call>")
    return ParsedCalls(calls, malformed)


class ToolBox:
    """The tools of an episode by name, run with a timeout; each result or error as a tool message."""

    def __init__(self, tools: Sequence[Callable[..., Any]], *, timeout_s: float) -> None:
        self.functions: dict[str, Callable[..., Any]] = {}
        for tool in tools:
            if not callable(tool):
                raise TypeError(f"a tool must be a Python function, got {tool!r}")
            name = getattr(tool, "__name__", None)
            if not isinstance(name, str):
                raise TypeError(f"the tool {tool!r} has no __name__")
            self.functions[name] = tool
        self.timeout_s = timeout_s

    def __bool__(self) -> bool:
        return bool(self.functions)

    @property
    def schemas(self) -> list[Callable[..., Any]]:
        """What the chat template is given as `tools=` (transformers reads each function's schema)."""
        return list(self.functions.values())

    async def run(self, parsed: ParsedCalls, counts: dict[str, float]) -> list[Message]:
        """Run each well-formed call; one tool message per call and per malformed call. `counts` gets
        `tools/calls` and `tools/errors_<kind>` added."""
        messages: list[Message] = []
        for problem in parsed.malformed:
            _add(counts, "tools/calls")
            _add(counts, "tools/errors_malformed")
            messages.append(_error_message("tool_call", f"malformed tool call: {problem}"))
        for call in parsed.calls:
            _add(counts, "tools/calls")
            result, error = await self._call(call)
            if error is not None:
                _add(counts, f"tools/errors_{error}")
            messages.append({"role": "tool", "name": call.name, "content": result})
        return messages

    async def _call(self, call: ToolCall) -> tuple[str, ToolError | None]:
        tool = self.functions.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.functions)) or "none"
            return _error_text(f"unknown tool {call.name!r}; the tools are: {known}"), "unknown"
        try:
            if inspect.iscoroutinefunction(tool):
                value = await asyncio.wait_for(tool(**call.arguments), self.timeout_s)
            else:
                call_it = functools.partial(tool, **call.arguments)
                value = await asyncio.wait_for(in_daemon_thread(call_it, name="tandem-tool"), self.timeout_s)
        except TimeoutError:
            return _error_text(f"the tool {call.name} took longer than {self.timeout_s:g} s"), "timeout"
        except Exception as exc:
            return _error_text(f"the tool {call.name} raised {type(exc).__name__}: {exc}"), "raised"
        return value if isinstance(value, str) else json.dumps(value, default=str), None


def _add(counts: dict[str, float], name: str) -> None:
    counts[name] = counts.get(name, 0.0) + 1.0


def _error_text(message: str) -> str:
    return json.dumps({"error": message})


def _error_message(name: str, message: str) -> Message:
    return {"role": "tool", "name": name, "content": _error_text(message)}


def _short(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:57] + "...")
