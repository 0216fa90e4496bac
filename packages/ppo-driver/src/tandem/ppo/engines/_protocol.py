"""The one protocol the driver talks to, whatever serves the rollout: the embedded engine or SGLang.

An engine serves one rollout bundle (data parallel: one engine per bundle, an
`EngineGroup` splits prompts across them and returns results in input order).
Memory is released and resumed by tag (`weights`, `kv_cache`), idempotently as
in tandem-lifecycle: a second release is a no-op, and `release_memory` returns
only once the memory is really free. Weights arrive HF-named, in buckets, from
the actor (`update_weights_from_tensors`); the driver's sync order is: resume
`weights` -> sync -> resume `kv_cache` (docs/design.md, "One PPO step", step 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

MemoryTag = Literal["weights", "kv_cache"]
MEMORY_TAGS: tuple[MemoryTag, ...] = ("weights", "kv_cache")

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled; the same for every prompt of one `generate` call."""

    max_new_tokens: int = 128
    """Most response tokens per sample."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax). Log-probs are reported under this temperature
    (under temperature 1 when greedy)."""

    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1: off."""

    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0: off."""

    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a response (included in it, finish reason `stop`); the tokenizer's EOS
    is added by the engine unless `ignore_eos`."""

    ignore_eos: bool = False
    """Generate exactly `max_new_tokens` tokens, EOS included as an ordinary token (benchmarks)."""

    seed: int | None = None
    """Seed of the sampling; the same seed and prompts give the same samples. None: unseeded."""


@dataclass
class Generation:
    """One sampled response.

    Attributes:
        token_ids: the response's token ids (a stop token that ended it included).
        log_probs: per response token, `log softmax(logits / temperature)[token]`, fp32.
        finish_reason: `stop` (a stop token or EOS), `length` (`max_new_tokens` reached) or `abort`.
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the driver needs of one engine (a Ray actor handle exposes the same methods via `.remote`)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        sessions: Sequence[str | None] | None = None,
    ) -> list[Generation]:
        """One response per prompt token-id list, in input order; `sessions`: an episode's id per prompt,
        whose KV the engine may keep for the session's next call (`end_sessions` forgets them)."""
        ...

    def end_sessions(self, sessions: Sequence[str] | None = None) -> None:
        """Forget the kept KV of `sessions` (None: all)."""
        ...

    def release_memory(self, tags: Sequence[MemoryTag] = MEMORY_TAGS) -> None:
        """Hand the GPU memory of `tags` back; returns only once it is free. Idempotent per tag."""
        ...

    def resume_memory(self, tags: Sequence[MemoryTag] = MEMORY_TAGS) -> None:
        """Bring the memory of `tags` back (weights as they were). Idempotent per tag."""
        ...

    def update_weights_from_tensors(self, named_tensors: Any) -> None:
        """Load one bucket of full, HF-named tensors into the model (list of `(name, tensor)`)."""
        ...

    def flush_cache(self) -> None:
        """Drop cached prefixes / KV state (after a weight update)."""
        ...

    def health(self) -> bool:
        """True when the engine can serve."""
        ...
