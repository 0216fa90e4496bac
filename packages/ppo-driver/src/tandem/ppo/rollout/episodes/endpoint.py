"""An OpenAI-compatible chat-completions endpoint over the rollout engines, for agent code.

During a rollout with a custom generate function, each episode may open a session
(`EpisodeContext.endpoint_session()`) and hand its `base_url` and `api_key` to any OpenAI
client (`session.async_client()`, `session.client()`; extra `tandem-ppo-driver[openai]`).
`POST {base_url}/chat/completions` renders the request's messages with the policy's chat
template, samples the reply on the engines (batched with every other episode's turns) and
answers as the OpenAI API does, tool calls (`<tool_call>` in the model's format) as
`tool_calls`, log-probs when asked.

Nothing is re-tokenized: the session keeps the episode's tokens. A request that repeats the
previous request's messages and the reply it got, then adds messages (tool results, the
next user turn), adds only those as context tokens (`chat.ChatRenderer.after_turn`); the
reply's tokens are the model's, as sampled, with their log-probs (`session.calls` records
each call's prompt and completion ids and log-probs). A request that rewrites the history
starts the episode's trajectory again from its messages (`endpoint/restarts`; what came
before it does not train). The sampling is the run's (`--temperature`, top-p, top-k): the
trained log-probs must be the sampler's, so a request's own `temperature` or `top_p` is
ignored; `max_tokens` is capped at `--rollout-max-response-len`.

It listens on 127.0.0.1 by default; any other address needs an API key in the environment
variable TANDEM_ENDPOINT_API_KEY (checked before Ray starts). Every request must carry the
key (`Authorization: Bearer ...`) whatever the address: without one set, each rollout's
endpoint makes a random one. The key is never written to config.yaml or the logs.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tandem.ppo.rollout.episodes.batcher import TurnBatcher
from tandem.ppo.rollout.episodes.chat import ChatRenderer
from tandem.ppo.rollout.episodes.environment import Message
from tandem.ppo.rollout.episodes.runner import EpisodeLimits
from tandem.ppo.rollout.episodes.tools import parse_tool_calls
from tandem.ppo.rollout.episodes.trajectory import EndReason, Episode, Trajectory

__all__ = ["INSTALL_HINT", "ChatEndpoint", "ChatSession", "EndpointOptions", "endpoint_options"]

INSTALL_HINT = "pip install 'tandem-ppo-driver[openai]' (or openai)"
KEY_VARIABLE = "TANDEM_ENDPOINT_API_KEY"
_PATH = re.compile(r"^/sessions/([A-Za-z0-9_-]+)/v1/(chat/completions|models)/?$")
_REQUEST_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class EndpointOptions:
    """Where the endpoint listens and the key every request must carry (never logged: `repr` hides it)."""

    host: str = "127.0.0.1"
    port: int = 0
    api_key: str = field(default="", repr=False)


def endpoint_options(host: str, port: int) -> EndpointOptions:
    """The options of a run: its address, and the key from TANDEM_ENDPOINT_API_KEY or a random one."""
    return EndpointOptions(host, port, os.environ.get(KEY_VARIABLE) or secrets.token_urlsafe(24))


@dataclass
class _Call:
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]


class ChatSession:
    """One episode's conversation on the endpoint: its tokens so far and each call it served."""

    def __init__(self, endpoint: ChatEndpoint, session_id: str) -> None:
        self._endpoint = endpoint
        self.session_id = session_id
        self.trajectory: Trajectory | None = None
        self.calls: list[_Call] = []
        """Each call's prompt ids (as the engines saw them), completion ids and log-probs."""
        self._chat: ChatRenderer | None = None
        self._history: list[Message] = []
        self._last_token: int | None = None
        self._counts: dict[str, float] = {}

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as `base_url`."""
        return f"{self._endpoint.url}/sessions/{self.session_id}/v1"

    @property
    def api_key(self) -> str:
        return self._endpoint.options.api_key

    def async_client(self, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` client of this session (extra `tandem-ppo-driver[openai]`)."""
        return _openai().AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def client(self, **kwargs: Any) -> Any:
        """An `openai.OpenAI` client of this session, for a plain (not async) generate function."""
        return _openai().OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def add_reward(self, reward: float) -> None:
        """`reward` for the replies so far: it lands on the last reply's last token."""
        if self.trajectory is None:
            raise RuntimeError("ChatSession.add_reward: the session served no call yet")
        self.trajectory.add_reward(reward)

    def episode(self, end: EndReason = "done") -> Episode:
        """The episode the session's calls produced (what trains: the replies since the last restart)."""
        if self.trajectory is None:
            raise RuntimeError("ChatSession.episode: the session served no call, so there is no episode")
        for name, value in self._counts.items():
            self.trajectory.count(name, value)
        self._counts = {}
        return self.trajectory.finish(end)

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """One chat completion (OpenAI's request and response objects, as dicts)."""
        messages = _checked_messages(body.get("messages"))
        limits = self._endpoint.limits
        tools = body.get("tools") or ()
        self._counts["endpoint/calls"] = self._counts.get("endpoint/calls", 0.0) + 1
        if self.trajectory is not None and self._continues(messages):
            assert self._chat is not None
            _, context = self._chat.after_turn(self._last_token, messages[len(self._history) :])
            self.trajectory.add_context(context)
        else:
            if self.trajectory is not None:
                self._counts["endpoint/restarts"] = self._counts.get("endpoint/restarts", 0.0) + 1
            self._chat = ChatRenderer(self._endpoint.tokenizer, list(tools))
            text, prompt_ids = self._chat.first_prompt(messages)
            self.trajectory = Trajectory(prompt_ids, text)
        trajectory = self.trajectory
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or limits.max_turn_tokens
        budget = min(int(asked), limits.max_turn_tokens)
        if limits.max_context is not None:
            budget = min(budget, limits.max_context - len(trajectory.context_ids))
        if limits.max_episode_tokens is not None:
            budget = min(budget, limits.max_episode_tokens - len(trajectory))
        if budget <= 0:
            raise _HttpError(400, "the episode's token budget is spent (--max-episode-tokens or the context)")
        prompt_ids = trajectory.context_ids
        generation = await self._endpoint.batcher.generate(prompt_ids, budget, self.session_id)
        trajectory.add_model(generation)
        self.calls.append(_Call(prompt_ids, list(generation.token_ids), list(generation.log_probs)))
        tokenizer = self._endpoint.tokenizer
        text = tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        parsed = parse_tool_calls(tokenizer.decode(generation.token_ids, skip_special_tokens=False))
        tool_calls = [
            {
                "id": f"call_{self.session_id}_{len(self.calls)}_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for i, c in enumerate(parsed.calls)
        ]
        content = (
            re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL).strip() if tool_calls else text
        )
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if tool_calls else "")}
        if tool_calls:
            message["tool_calls"] = tool_calls
        cut = generation.finish_reason == "length"
        self._history = [*messages, message]
        self._last_token = generation.token_ids[-1] if generation.token_ids and not cut else None
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": "length" if cut else "tool_calls" if tool_calls else "stop",
            "logprobs": None,
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": tokenizer.decode([t]),
                        "logprob": p,
                        "bytes": list(tokenizer.decode([t]).encode()),
                        "top_logprobs": [],
                    }
                    for t, p in zip(generation.token_ids, generation.log_probs, strict=True)
                ]
            }
        return {
            "id": f"chatcmpl-{self.session_id}-{len(self.calls)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model") or "tandem-policy"),
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(generation.token_ids),
                "total_tokens": len(prompt_ids) + len(generation.token_ids),
            },
        }

    def _continues(self, messages: list[Message]) -> bool:
        """Whether `messages` repeat the last request's and its reply, and add at least one."""
        history = self._history
        if not history or len(messages) <= len(history):
            return False
        same = all(
            (m.get("role"), m.get("content") or "") == (h.get("role"), h.get("content") or "")
            for m, h in zip(messages[: len(history) - 1], history[:-1], strict=True)
        )
        return same and messages[len(history) - 1].get("role") == "assistant"


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _checked_messages(messages: Any) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise _HttpError(400, "`messages` must be a non-empty list of chat messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _HttpError(400, f"`messages[{i}]` is not a chat message with a string `role`")
        content = message.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append({**message, "content": content or ""})
    return out


def _openai() -> Any:
    try:
        import openai
    except ImportError as exc:
        raise ImportError(f"the OpenAI client is not installed; {INSTALL_HINT}") from exc
    return openai


class ChatEndpoint:
    """The HTTP server of one rollout's sessions (see the module docstring); `start`, then `stop`."""

    def __init__(
        self, options: EndpointOptions, *, tokenizer: Any, batcher: TurnBatcher, limits: EpisodeLimits
    ) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self.batcher = batcher
        self.limits = limits
        self.sessions: dict[str, ChatSession] = {}
        self._loop = asyncio.get_running_loop()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        address = self._server.server_address
        host, port = str(address[0]), int(address[1])
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}"

    def session(self, index: int) -> ChatSession:
        """A new session for episode `index`."""
        session_id = f"e{index}-{secrets.token_hex(4)}"
        session = ChatSession(self, session_id)
        self.sessions[session_id] = session
        return session

    def start(self) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # requests are not logged (the key)
                pass

            def do_GET(self) -> None:
                session, kind = endpoint._route(self)
                if session is None:
                    return
                if kind != "models":
                    return _send(
                        self, 405, {"error": {"message": "use POST", "type": "invalid_request_error"}}
                    )
                _send(self, 200, {"object": "list", "data": [{"id": "tandem-policy", "object": "model"}]})

            def do_POST(self) -> None:
                session, kind = endpoint._route(self)
                if session is None:
                    return
                if kind != "chat/completions":
                    return _send(
                        self, 405, {"error": {"message": "use GET", "type": "invalid_request_error"}}
                    )
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(length) or b"{}")
                    if not isinstance(body, dict):
                        raise _HttpError(400, "the request body must be a JSON object")
                    if int(body.get("n") or 1) != 1:
                        raise _HttpError(400, "`n` must be 1 (one reply per call)")
                    future = asyncio.run_coroutine_threadsafe(session.complete(body), endpoint._loop)
                    _send(self, 200, future.result(_REQUEST_TIMEOUT_S))
                except _HttpError as exc:
                    _send(self, exc.status, {"error": {"message": str(exc), "type": "invalid_request_error"}})
                except json.JSONDecodeError as exc:
                    _send(
                        self,
                        400,
                        {"error": {"message": f"not JSON: {exc.msg}", "type": "invalid_request_error"}},
                    )
                except Exception as exc:
                    _send(
                        self,
                        500,
                        {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error"}},
                    )

        self._server = ThreadingHTTPServer((self.options.host, self.options.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="tandem-endpoint", daemon=True
        )
        self._thread.start()

    def _route(self, request: BaseHTTPRequestHandler) -> tuple[ChatSession | None, str]:
        """The session a request is for, after its key is checked; None (answered) otherwise."""
        header = request.headers.get("Authorization") or ""
        given = header.removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.options.api_key.encode()):
            _send(request, 401, {"error": {"message": "invalid API key", "type": "authentication_error"}})
            return None, ""
        match = _PATH.match(request.path.split("?", 1)[0])
        session = self.sessions.get(match.group(1)) if match else None
        if match is None or session is None:
            _send(
                request,
                404,
                {"error": {"message": "no such session or route", "type": "invalid_request_error"}},
            )
            return None, ""
        return session, match.group(2)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _send(request: BaseHTTPRequestHandler, status: int, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    request.send_response(status)
    request.send_header("Content-Type", "application/json")
    request.send_header("Content-Length", str(len(data)))
    request.end_headers()
    request.wfile.write(data)
