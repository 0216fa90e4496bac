"""The SGLang adapter: one `sglang.launch_server` per rollout bundle (or given URLs), driven over its HTTP API.

Endpoints used, as SGLang's `http_server.py` and `io_struct.py` define them:

- `POST /generate` with `input_ids` (a batch), one `sampling_params` dict and
  `return_logprob: true`; each answer's `output_ids`, `meta_info.output_token_logprobs`
  (`[logprob, token_id, text]` per token) and `meta_info.finish_reason.type`
  (`stop` / `length` / `abort`).
- `POST /release_memory_occupation` and `/resume_memory_occupation` with `{"tags": [...]}`
  (`weights`, `kv_cache`); the release is followed by a wait until the server's
  GPU memory use has actually dropped (SGLang's call returns before that).
- `POST /update_weights_from_tensor` with `serialized_named_tensors` (one entry per
  tensor-parallel rank: a base64 `ForkingPickler` dump of `[(name, tensor), ...]`,
  SGLang's `MultiprocessingSerializer`), `flush_cache`.
- `POST /flush_cache`, `GET /health`, `GET /get_server_info` (context length).

sglang itself is an optional extra; without it, launching refuses with the install
command, while attaching to running servers needs only `requests`.
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from ._options import EngineOptions
from ._protocol import MEMORY_TAGS, FinishReason, Generation, MemoryTag, SamplingParams
from ._weights import as_named_tensors

INSTALL_HINT = "pip install 'tandem-ppo-driver[sglang]'"


class SGLangUnavailableError(RuntimeError):
    """sglang is not installed, so no server can be launched."""


def require_sglang() -> str:
    """sglang's version; `SGLangUnavailableError` with the install command when it cannot be imported."""
    try:
        import sglang  # the extra `tandem-ppo-driver[sglang]`; the server itself runs as `-m sglang.launch_server`
    except ImportError as exc:
        raise SGLangUnavailableError(
            "engine='sglang' launches `python -m sglang.launch_server`, but sglang is not installed; "
            f"install the extra with `{INSTALL_HINT}` (GPU hosts only), or pass "
            "EngineOptions.sglang_urls to attach to running servers, or use engine='embedded'"
        ) from exc
    return str(getattr(sglang, "__version__", "unknown"))


def sampling_payload(params: SamplingParams) -> dict[str, Any]:
    """SGLang's `sampling_params` for ours (SGLang's own names; temperature 0 is greedy there too)."""
    payload: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "ignore_eos": params.ignore_eos,
    }
    if params.stop_token_ids:
        payload["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        payload["sampling_seed"] = params.seed
    return payload


def generate_payload(prompts: Sequence[Sequence[int]], params: SamplingParams) -> dict[str, Any]:
    """The JSON body of `POST /generate` for a batch of token-id prompts."""
    return {
        "input_ids": [[int(t) for t in p] for p in prompts],
        "sampling_params": sampling_payload(params),
        "return_logprob": True,
        "stream": False,
    }


def parse_generation(item: dict[str, Any]) -> Generation:
    """One `/generate` answer as a `Generation` (token ids and log-probs from `output_token_logprobs`)."""
    meta = item.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs") or []
    log_probs = [float(entry[0]) for entry in pairs]
    token_ids = [int(entry[1]) for entry in pairs]
    if not token_ids and item.get("output_ids"):
        token_ids = [int(t) for t in item["output_ids"]]
    if len(log_probs) != len(token_ids):
        raise ValueError(
            f"SGLang answered {len(token_ids)} tokens but {len(log_probs)} log-probs; "
            "was return_logprob dropped?"
        )
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    reason: FinishReason = kind if kind in ("stop", "length", "abort") else "abort"
    return Generation(token_ids, log_probs, reason, meta={"sglang_finish_reason": finish})


def serialize_named_tensors(named_tensors: list[tuple[str, Any]], tp_size: int = 1) -> list[str]:
    """SGLang's `serialized_named_tensors`: per TP rank, base64 of a `ForkingPickler` dump of the list.

    CUDA tensors travel as IPC handles (the server must share the GPU); the caller keeps
    them alive until the request has returned.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named_tensors)
    encoded = base64.b64encode(buf.getvalue()).decode("ascii")
    return [encoded] * tp_size


class SGLangEngine:
    """A rollout engine backed by one SGLang server: launched here, or attached by URL.

    Args:
        hf_dir: the model folder the server loads (ignored when attaching).
        options: `sglang_urls[rank]` to attach to, else `sglang_launch_args` and
            `sglang_base_port + rank` to launch; `request_timeout_s`, `startup_timeout_s`.
        rank: this engine's rank in its group.
    """

    def __init__(self, hf_dir: str, options: EngineOptions | None = None, *, rank: int = 0) -> None:
        self.options = options = options or EngineOptions()
        self.rank = rank
        self._proc: subprocess.Popen[bytes] | None = None
        self._released: set[str] = set()
        if options.sglang_urls:
            if rank >= len(options.sglang_urls):
                raise ValueError(
                    f"SGLangEngine rank {rank}: EngineOptions.sglang_urls has only {len(options.sglang_urls)} URLs"
                )
            self.url = options.sglang_urls[rank].rstrip("/")
        else:
            require_sglang()
            port = options.sglang_base_port + rank
            self.url = f"http://127.0.0.1:{port}"
            cmd = [
                sys.executable,
                "-m",
                "sglang.launch_server",
                "--model-path",
                hf_dir,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--skip-tokenizer-init",
                "--enable-memory-saver",
                *options.sglang_launch_args,
            ]
            self._proc = subprocess.Popen(cmd, env=dict(os.environ))
        self._wait_healthy(options.startup_timeout_s)
        self._context_len = self._read_context_len()

    # -- HTTP --------------------------------------------------------------------------------------

    def _post(self, path: str, payload: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        import requests

        resp = requests.post(
            self.url + path, json=payload or {}, timeout=timeout or self.options.request_timeout_s
        )
        if resp.status_code != 200:
            raise RuntimeError(f"SGLang {path} answered {resp.status_code}: {resp.text[:500]}")
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    def _get(self, path: str, timeout: float | None = None) -> Any:
        import requests

        resp = requests.get(self.url + path, timeout=timeout or self.options.request_timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"SGLang {path} answered {resp.status_code}: {resp.text[:500]}")
        return resp.json() if resp.content else None

    def _wait_healthy(self, timeout_s: float) -> None:
        import requests

        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"SGLang server of rank {self.rank} exited with {self._proc.returncode}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException as err:
                last = err
            time.sleep(0.2)
        raise TimeoutError(
            f"SGLang server at {self.url} not healthy within {timeout_s:g} s (last error: {last!r})"
        )

    def _read_context_len(self) -> int:
        if self.options.max_context_len is not None:
            return self.options.max_context_len
        info = self._get("/get_server_info")
        for key in ("context_length", "max_context_length"):
            if isinstance(info, dict) and info.get(key):
                return int(info[key])
        raise ValueError(
            f"SGLang server at {self.url}: /get_server_info has no context_length; set EngineOptions.max_context_len"
        )

    # -- the protocol ------------------------------------------------------------------------------

    def max_context_len(self) -> int:
        """Longest prompt + response in tokens."""
        return self._context_len

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        sessions: Sequence[str | None] | None = None,
    ) -> list[Generation]:
        """One request for the whole batch; answers come back in input order. `sessions` are not needed:
        SGLang's radix cache reuses the prefixes that a session's turns share."""
        if not prompts:
            return []
        answer = self._post("/generate", generate_payload(prompts, params))
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != len(prompts):
            raise RuntimeError(f"SGLang answered {len(items)} generations for {len(prompts)} prompts")
        return [parse_generation(item) for item in items]

    def release_memory(self, tags: Sequence[MemoryTag] = MEMORY_TAGS) -> None:
        """Release the tags not yet released, then wait until the server's memory use dropped."""
        todo = [t for t in tags if t not in self._released]
        if not todo:
            return
        self._post("/release_memory_occupation", {"tags": todo})
        self._released.update(todo)
        self._wait_memory_released()

    def resume_memory(self, tags: Sequence[MemoryTag] = MEMORY_TAGS) -> None:
        """Resume the tags that are released (in the order given)."""
        todo = [t for t in tags if t in self._released]
        if not todo:
            return
        self._post("/resume_memory_occupation", {"tags": todo})
        self._released.difference_update(todo)

    def update_weights_from_tensors(self, named_tensors: Any) -> None:
        """Send HF-named tensors through `/update_weights_from_tensor` (as CUDA IPC handles on a GPU)."""

        named, _opened = as_named_tensors(named_tensors, _local_device())
        named = _to_local_device(named)
        payload = {
            "serialized_named_tensors": serialize_named_tensors(named),
            "flush_cache": False,
        }
        answer = self._post("/update_weights_from_tensor", payload)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise RuntimeError(f"SGLang update_weights_from_tensor failed: {answer.get('message')}")

    def end_sessions(self, sessions: Sequence[str] | None = None) -> None:
        """Nothing to forget: SGLang's radix cache evicts prefixes itself."""

    def flush_cache(self) -> None:
        """Drop SGLang's radix (prefix) cache."""
        self._post("/flush_cache")

    def health(self) -> bool:
        """True when `/health` answers 200."""
        import requests

        try:
            return bool(
                requests.get(self.url + "/health", timeout=self.options.request_timeout_s).status_code == 200
            )
        except requests.RequestException:
            return False

    def released_tags(self) -> list[str]:
        """The memory tags released right now, as this adapter asked."""
        return [t for t in MEMORY_TAGS if t in self._released]

    def shutdown(self) -> None:
        """Stop a server this engine launched (attached servers are left running)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=30)
        self._proc = None

    def _wait_memory_released(self) -> None:
        """Wait until the GPU's used memory stops falling (SGLang's release returns before it is free)."""
        try:
            import torch
        except ImportError:  # pragma: no cover - torch is a dependency
            return
        if not torch.cuda.is_available():
            return
        deadline = time.monotonic() + self.options.request_timeout_s
        previous = None
        while time.monotonic() < deadline:
            free, _total = torch.cuda.mem_get_info()
            if previous is not None and free <= previous:
                return
            previous = free
            time.sleep(0.2)


def _local_device() -> Any:
    import torch

    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _to_local_device(named: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """CPU tensors onto this process's GPU (the server's GPU), so that they travel as IPC handles."""
    import torch

    if not torch.cuda.is_available():
        return named
    device = _local_device()
    # Tensors opened from IPC handles cannot be shared again: every tensor gets a copy of its own.
    local = [(n, t.to(device, non_blocking=True) if t.device != device else t.clone()) for n, t in named]
    torch.cuda.synchronize(device)  # the server reads them from another process
    return local
