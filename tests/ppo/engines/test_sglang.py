"""The SGLang adapter's requests and answers, against a fake server speaking SGLang's documented HTTP API.

The fake server (127.0.0.1, a free port, a daemon thread that shuts itself down
after 60 s at the latest) records each request and answers the way SGLang's
`http_server.py` does: `/generate` a list of `{output_ids, meta_info}` with
`output_token_logprobs` as `[logprob, token_id, text]` and `finish_reason.type`.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch

from tandem.ppo.engines import (
    INSTALL_HINT,
    EngineOptions,
    SamplingParams,
    SGLangEngine,
    SGLangUnavailableError,
    create_engine_group,
)
from tandem.ppo.engines._sglang import generate_payload, parse_generation


class FakeSGLang(BaseHTTPRequestHandler):
    requests: list[tuple[str, str, Any]]

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _reply(self, status: int, body: Any) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.server.requests.append(("GET", self.path, None))  # type: ignore[attr-defined]
        if self.path == "/health":
            self._reply(200, None)
        elif self.path == "/get_server_info":
            self._reply(200, {"context_length": 64, "version": "fake"})
        else:
            self._reply(404, {"message": "not found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        self.server.requests.append(("POST", self.path, body))  # type: ignore[attr-defined]
        if self.path == "/generate":
            answers = []
            for i, prompt in enumerate(body["input_ids"]):
                tokens = [prompt[0] + 1, prompt[0] + 2]
                finish = (
                    {"type": "length", "length": 2} if i % 2 == 0 else {"type": "stop", "matched": tokens[-1]}
                )
                answers.append(
                    {
                        "output_ids": tokens,
                        "meta_info": {
                            "id": f"r{i}",
                            "finish_reason": finish,
                            "output_token_logprobs": [[-0.5, tokens[0], None], [-0.25, tokens[1], None]],
                            "completion_tokens": 2,
                        },
                    }
                )
            self._reply(200, answers)
        elif self.path == "/update_weights_from_tensor":
            self._reply(200, {"success": True, "message": "Succeeded to update model weights."})
        elif self.path in ("/release_memory_occupation", "/resume_memory_occupation", "/flush_cache"):
            self._reply(200, None)
        else:
            self._reply(404, {"message": "not found"})


@pytest.fixture()
def fake_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSGLang)
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    watchdog = threading.Timer(60.0, server.shutdown)  # never outlives a stuck test
    watchdog.daemon = True
    watchdog.start()
    try:
        yield server
    finally:
        watchdog.cancel()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _attach(server: ThreadingHTTPServer) -> SGLangEngine:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    return SGLangEngine(
        "unused", EngineOptions(sglang_urls=(url,), request_timeout_s=10, startup_timeout_s=10)
    )


def test_generate_sends_token_ids_with_return_logprob_and_parses_the_answers(fake_server: Any) -> None:
    engine = _attach(fake_server)
    assert engine.max_context_len() == 64 and engine.health()
    params = SamplingParams(
        max_new_tokens=2, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=(9,), seed=3
    )
    gens = engine.generate([[10, 11], [20]], params)
    method, path, body = fake_server.requests[-1]
    assert (method, path) == ("POST", "/generate")
    assert body == {
        "input_ids": [[10, 11], [20]],
        "sampling_params": {
            "max_new_tokens": 2,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "ignore_eos": False,
            "stop_token_ids": [9],
            "sampling_seed": 3,
        },
        "return_logprob": True,
        "stream": False,
    }
    assert [(g.token_ids, g.log_probs, g.finish_reason) for g in gens] == [
        ([11, 12], [-0.5, -0.25], "length"),
        ([21, 22], [-0.5, -0.25], "stop"),
    ]


def test_memory_tags_weights_and_cache_use_the_documented_endpoints(fake_server: Any) -> None:
    engine = _attach(fake_server)
    engine.release_memory(["weights", "kv_cache"])
    engine.release_memory(["kv_cache"])  # already released: no request
    engine.resume_memory(["weights"])
    tensors = [
        ("model.norm.weight", torch.arange(4, dtype=torch.float32)),
        ("lm_head.weight", torch.ones(2, 3)),
    ]
    engine.update_weights_from_tensors(tensors)
    engine.resume_memory(["weights", "kv_cache"])
    engine.flush_cache()
    posts = [(path, body) for method, path, body in fake_server.requests if method == "POST"]
    assert [p for p, _ in posts] == [
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/update_weights_from_tensor",
        "/resume_memory_occupation",
        "/flush_cache",
    ]
    assert posts[0][1] == {"tags": ["weights", "kv_cache"]}
    assert posts[1][1] == {"tags": ["weights"]}
    assert posts[3][1] == {"tags": ["kv_cache"]}
    update = posts[2][1]
    assert set(update) == {"serialized_named_tensors", "flush_cache"}
    # One entry per tensor-parallel rank: base64 of a ForkingPickler dump (SGLang's MultiprocessingSerializer).
    (encoded,) = update["serialized_named_tensors"]
    decoded = ForkingPickler.loads(base64.b64decode(encoded))
    assert [n for n, _ in decoded] == ["model.norm.weight", "lm_head.weight"]
    for (_, got), (_, sent) in zip(decoded, tensors, strict=True):
        assert torch.equal(got, sent)


def test_parse_generation_rejects_answers_without_log_probs() -> None:
    with pytest.raises(ValueError, match="return_logprob"):
        parse_generation({"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length"}}})
    aborted = parse_generation(
        {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}
    )
    assert aborted.finish_reason == "abort" and aborted.token_ids == []
    greedy = generate_payload([[1]], SamplingParams(temperature=0.0))["sampling_params"]
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == -1


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_without_sglang_launching_refuses_with_the_install_command() -> None:
    with pytest.raises(SGLangUnavailableError, match=r"pip install 'tandem-ppo-driver\[sglang\]'"):
        SGLangEngine("some/model", EngineOptions())
    with pytest.raises(SGLangUnavailableError, match="tandem-ppo-driver"):
        create_engine_group("some/model", None, [0], num_gpus_per_engine=0.2, engine="sglang")
    assert "tandem-ppo-driver[sglang]" in INSTALL_HINT
