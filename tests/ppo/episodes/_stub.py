"""A scripted engine and the tiny tokenizer, for the episode tests (no model, no Ray)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.ppo._tiny import build_tiny_tokenizer
from tandem.ppo.engines import Generation, SamplingParams

LOG_PROB = -0.25
"""The log-prob the stub reports for every token it samples."""


@dataclass
class ScriptedEngine:
    """`generate` answers each prompt with `reply(prompt_ids)` (token ids), cut at the budget; it records
    each call's prompts and parameters."""

    reply: Callable[[list[int]], list[int]]
    eos: int
    calls: list[tuple[list[list[int]], SamplingParams]] = field(default_factory=list)
    max_context_len: int = 4096

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        self.calls.append(([list(p) for p in prompts], params))
        out = []
        for prompt in prompts:
            tokens = self.reply(list(prompt))[: params.max_new_tokens]
            stopped = bool(tokens) and tokens[-1] == self.eos
            out.append(Generation(tokens, [LOG_PROB] * len(tokens), "stop" if stopped else "length"))
        return out


def tiny_tokenizer() -> Any:
    return build_tiny_tokenizer()


def text_reply(tokenizer: Any, text: str, *, eos: bool = True) -> Callable[[list[int]], list[int]]:
    """A reply of `text` (then EOS) whatever the prompt."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return lambda prompt: [*ids, *([tokenizer.eos_token_id] if eos else [])]
