"""An episode's KV cache kept between its turns (`generate(..., sessions=...)`), so a turn prefills only what is new.

Each turn of a multi-turn episode asks the engine to continue the whole episode so far: the
previous turn's prompt, its sampled tokens, then the environment's reply. Without sessions
the engine prefills all of it again. With a session id per prompt, the engine keeps, after
each call, the keys and values of the session's tokens (the prompt and the response but its
last token, whose KV no step wrote), and at the next call of that session whose prompt starts
with those tokens copies them into the cache rows and prefills only the rest.

The kept KV lives on the engine's device beside its static cache, one tensor of
`(layers, kv_heads, tokens, head_dim)` for keys and one for values per session; it is freed
by `end_sessions` and with the KV cache (`release_memory("kv_cache")`, `flush_cache`).
`bench/multi_turn_bench.py` times a rollout of episodes with and without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._kv_cache import StaticKVCache

__all__ = ["SessionKV"]


@dataclass
class _Kept:
    tokens: list[int]
    keys: torch.Tensor
    values: torch.Tensor


class SessionKV:
    """The kept KV of each session, by session id."""

    def __init__(self) -> None:
        self._kept: dict[str, _Kept] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def nbytes(self) -> int:
        return sum(k.keys.numel() * k.keys.element_size() * 2 for k in self._kept.values())

    def reusable(self, session: str | None, prompt: Sequence[int]) -> int:
        """Tokens of `prompt` whose KV `session` keeps: its kept tokens, when they start `prompt` and leave
        at least one token of it to prefill (the last position's logits are needed); else 0."""
        kept = self._kept.get(session) if session is not None else None
        if kept is None or not 0 < len(kept.tokens) < len(prompt):
            return 0
        n = len(kept.tokens)
        return n if list(prompt[:n]) == kept.tokens else 0

    def load(self, session: str, cache: StaticKVCache, *, row: int, at: int, length: int) -> None:
        """Copy the session's first `length` positions into cache row `row` from position `at`."""
        kept = self._kept[session]
        for layer, (keys, values) in enumerate(zip(cache.keys, cache.values, strict=True)):
            keys[row, :, at : at + length].copy_(kept.keys[layer, :, :length])
            values[row, :, at : at + length].copy_(kept.values[layer, :, :length])

    def save(self, session: str, tokens: Sequence[int], cache: StaticKVCache, *, row: int, at: int) -> None:
        """Keep `tokens`' KV, the positions `at ..` of cache row `row`."""
        n = len(tokens)
        if n == 0:
            self._kept.pop(session, None)
            return
        keys = torch.stack([k[row, :, at : at + n] for k in cache.keys])
        values = torch.stack([v[row, :, at : at + n] for v in cache.values])
        self._kept[session] = _Kept(list(tokens), keys, values)

    def end(self, sessions: Sequence[str] | None = None) -> None:
        """Forget `sessions` (None: all)."""
        if sessions is None:
            self._kept.clear()
            return
        for session in sessions:
            self._kept.pop(session, None)
