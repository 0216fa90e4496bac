"""The embedded engine's generation of one batch: waves that fit the KV cache, prefill, the decode loop.

`DecodeLoop._generate_wave` runs one wave of prompts: left-padded into one batch, a
prefill into the static KV cache (a session's kept KV reused, its new tokens alone
prefilled), then decode steps that sample on the device (`_forward.ForwardPasses`); the
host looks every `sync_every` steps, to stop when all sequences are done and to pack the
unfinished ones into a smaller batch bucket (a power of two, `_bucket`). A mixin of
`_embedded.EmbeddedEngine`, which holds the model, the cache and the sessions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._forward import ForwardPasses
from ._kv_cache import StaticKVCache
from ._protocol import FinishReason, Generation, SamplingParams
from ._sampling import Draws
from ._sessions import SessionKV

_MIN_BUCKET = 8


class DecodeLoop(ForwardPasses):
    """Waves of a batch through prefill and the decode loop; see the module docstring."""

    _max_context_len: int
    _eos_ids: list[int]
    _sessions: SessionKV

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        token_lists = []
        for i, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if len(ids) > self._max_context_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens, longer than the engine's context of "
                    f"{self._max_context_len} tokens (EngineOptions.max_context_len)"
                )
            bad = [t for t in ids if not 0 <= t < self._vocab]
            if bad:
                raise ValueError(
                    f"prompt {i} has token ids outside the vocabulary [0, {self._vocab}): {bad[:5]}"
                )
            token_lists.append(ids)
        return token_lists

    def _waves(self, prompts: list[list[int]], params: SamplingParams) -> list[tuple[int, int]]:
        """Contiguous slices of the batch whose KV cache fits the memory budget (CUDA), else one slice."""
        n = len(prompts)
        if self.device.type != "cuda":
            return [(0, n)]
        length = self._cache_length(max(len(p) for p in prompts), params.max_new_tokens)
        per_row = StaticKVCache.bytes_per_row(
            num_layers=self._num_layers,
            kv_heads=self._kv_heads,
            length=length,
            head_dim=self._head_dim,
            dtype=self.dtype,
        )
        total = torch.cuda.get_device_properties(self.device).total_memory
        rows = max(1, int(self.options.kv_cache_memory_fraction * total) // per_row)
        return [(lo, min(lo + rows, n)) for lo in range(0, n, rows)]

    def _cache_length(self, prompt_len: int, max_new_tokens: int) -> int:
        block = self.options.kv_block
        return -(-(prompt_len + max_new_tokens) // block) * block

    def _generate_wave(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        draws: Draws,
        sessions: list[str | None] | None = None,
    ) -> list[Generation]:
        dev = self.device
        rows = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        prompt_len = int(lens.max())
        # A response ends at max_new_tokens or at the context limit, whichever comes first.
        budget_host = torch.clamp(self._max_context_len - lens, max=params.max_new_tokens)
        steps = int(budget_host.max())
        if steps <= 0:
            return [Generation([], [], "length") for _ in prompts]
        length = self._cache_length(prompt_len, steps)
        cache = self._ensure_cache(rows, length)

        ids = torch.zeros(rows, prompt_len, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, prompt_len - len(p) :] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(dev, non_blocking=True)
        start = (prompt_len - lens).to(dev)
        budget = budget_host.to(dev)

        # A session's kept KV goes into its row; the prefill then covers the longest new part only.
        reused = [
            self._sessions.reusable(s, p) for s, p in zip(sessions or [None] * rows, prompts, strict=True)
        ]
        for i, n in enumerate(reused):
            if n:
                assert sessions is not None
                self._sessions.load(
                    sessions[i] or "", cache, row=i, at=prompt_len - len(prompts[i]), length=n
                )
        window = max(len(p) - n for p, n in zip(prompts, reused, strict=True))
        logits = self._prefill(ids, start, cache, window=window if window < prompt_len else None)
        stop_ids = self._stop_ids(params)

        out_tokens = torch.zeros(rows, steps, dtype=torch.long, device=dev)
        out_logps = torch.zeros(rows, steps, dtype=torch.float32, device=dev)
        out_len = budget.clone()
        stopped = torch.zeros(rows, dtype=torch.bool, device=dev)
        # Cache row c holds the sequence of original row `orig[c]`; rows past the active ones are fillers.
        orig = torch.arange(rows, device=dev)
        done = budget <= 0
        active = rows
        self._ids[:rows].zero_()
        self._start[:rows].copy_(start)

        for t in range(steps):
            if t > 0:
                self._pos.fill_(prompt_len + t - 1)
            tokens, logps = self._next_tokens(t, active, prompt_len, logits, params, draws)
            out_tokens[orig, t] = tokens
            out_logps[orig, t] = logps
            is_stop = ~done & torch.isin(tokens, stop_ids) if stop_ids.numel() else torch.zeros_like(done)
            out_len[orig] = torch.where(is_stop, t + 1, out_len[orig])
            stopped[orig] = stopped[orig] | is_stop
            done = done | is_stop | (t + 1 >= budget)
            self._ids[:active, 0] = tokens
            if t + 1 == steps:
                break
            if (t + 1) % self.options.sync_every == 0:
                alive = int((~done).sum())
                if alive == 0:
                    break
                bucket = _bucket(alive, active)
                if bucket < active:
                    # Drop finished sequences: pack the unfinished ones (stable order) into the first rows.
                    if sessions is not None:
                        self._keep_sessions(
                            sessions, prompts, cache, orig, done, out_tokens, out_len, prompt_len
                        )
                    order = torch.argsort(done.to(torch.int8), stable=True)[:bucket]
                    cache.reorder_rows(order)
                    self._ids[:bucket].copy_(self._ids[:active].index_select(0, order))
                    self._start[:bucket].copy_(self._start[:active].index_select(0, order))
                    orig, done, budget = orig[order], done[order], budget[order]
                    active = bucket

        if sessions is not None:
            self._keep_sessions(
                sessions, prompts, cache, orig, torch.ones_like(done), out_tokens, out_len, prompt_len
            )
        tokens_host = out_tokens.cpu()
        logps_host = out_logps.cpu()
        len_host = out_len.cpu().tolist()
        stopped_host = stopped.cpu().tolist()
        results = []
        for i in range(rows):
            n = int(len_host[i])
            reason: FinishReason = "stop" if stopped_host[i] else "length"
            results.append(Generation(tokens_host[i, :n].tolist(), logps_host[i, :n].tolist(), reason))
        return results

    def _keep_sessions(
        self,
        sessions: list[str | None],
        prompts: list[list[int]],
        cache: StaticKVCache,
        orig: torch.Tensor,
        done: torch.Tensor,
        out_tokens: torch.Tensor,
        out_len: torch.Tensor,
        prompt_len: int,
    ) -> None:
        """Keep the KV of the sessions among the cache rows `done` marks (row c holds `orig[c]`): the prompt
        and the response but its last token, as the steps so far wrote them."""
        rows = torch.nonzero(done).flatten().tolist()
        originals = orig[rows].tolist()
        lengths = out_len[orig[rows]].tolist()
        for row, i, n in zip(rows, originals, lengths, strict=True):
            session = sessions[i]
            if session is None:
                continue
            response = out_tokens[i, : max(int(n) - 1, 0)].tolist()
            tokens = prompts[i] + response
            self._sessions.save(session, tokens, cache, row=row, at=prompt_len - len(prompts[i]))

    def _stop_ids(self, params: SamplingParams) -> torch.Tensor:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids |= set(self._eos_ids)
        return torch.tensor(sorted(ids), dtype=torch.long, device=self.device)


def _bucket(alive: int, current: int) -> int:
    """The batch bucket for `alive` sequences: the next power of two (at least 8), never above `current`."""
    bucket = _MIN_BUCKET
    while bucket < alive:
        bucket *= 2
    return min(bucket, current)


def check_params(params: SamplingParams) -> None:
    if params.max_new_tokens < 0:
        raise ValueError(f"SamplingParams.max_new_tokens={params.max_new_tokens}: must be >= 0")
    if params.temperature < 0:
        raise ValueError(f"SamplingParams.temperature={params.temperature}: must be >= 0 (0 is greedy)")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"SamplingParams.top_p={params.top_p}: must be in (0, 1]")
