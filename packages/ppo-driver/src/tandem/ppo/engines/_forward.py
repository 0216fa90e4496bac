"""The embedded engine's forward passes over its static KV cache, and the cache and CUDA graphs they use.

`ForwardPasses` is a mixin of `EmbeddedEngine` (which sets the attributes it
declares): the prefill writes the prompts into a `StaticKVCache`; each decode step
reads the static inputs (`_ids`, `_start`, `_pos`, and `_arange` or the fused
sampler's `_seed` and `_temperature`) and is either transformers' forward pass
(eager, compiled, or on CUDA a graph per (rows, kv_len)) or the fused decode step
(`_fused_decode.FusedDecoder`, on CUDA one graph per rows), the graphs in one
memory pool. `_next_tokens` gives a step's tokens either way. The cache and the
static inputs grow together (`_ensure_cache`); dropping the cache drops the graphs
that read it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from tandem.megatron.runtime.gpu_memory import empty_device_cache

from ._fused_decode import FusedDecoder
from ._kv_cache import StaticKVCache, cache_keyword
from ._options import EngineOptions
from ._protocol import SamplingParams
from ._sampling import Draws, restricts_draw, sample

_FUSED = 0
"""The kv_len of the fused step's graph keys: it reads every position up to `_pos`, no bucket."""


class ForwardPasses:
    """Prefill, decode step and CUDA-graph replay over the engine's static KV cache; see the module docstring."""

    model: Any
    options: EngineOptions
    device: torch.device
    dtype: torch.dtype
    _num_layers: int
    _kv_heads: int
    _head_dim: int
    _cache: StaticKVCache | None
    _last_cache_shape: tuple[int, int] | None
    _graphs: dict[tuple[int, int], tuple[Any, Any]]
    _graph_pool: Any
    _side_stream: Any
    _decode_fn: Callable[[int, int], torch.Tensor]
    _fused: FusedDecoder | None
    _kv_saver: Any
    """torch_memory_saver's backend holding the KV cache (`EngineOptions.kv_cache_backend`), else None."""
    _vocab: int
    # Static inputs of the decode step (CUDA graphs read these very tensors).
    _ids: torch.Tensor
    _start: torch.Tensor
    _pos: torch.Tensor
    _arange: torch.Tensor
    _seed: torch.Tensor
    _temperature: torch.Tensor

    # -- a step's tokens -----------------------------------------------------------------------------

    def _next_tokens(
        self,
        t: int,
        rows: int,
        prompt_len: int,
        first_logits: torch.Tensor,
        params: SamplingParams,
        draws: Draws,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step t's tokens and log-probs for rows [:rows]: from the prefill's logits (t == 0) or a decode step.

        Decode step t writes cache position `prompt_len + t - 1` (`_pos`, set by the caller) and
        reads the keys up to it.
        """
        if self._fused is None:
            logits = first_logits
            if t > 0:
                assert self._cache is not None
                block = self.options.kv_block
                kv_len = min(self._cache.length, -(-(prompt_len + t) // block) * block)
                logits = self._decode(rows, kv_len)
            return sample(
                logits,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                generator=draws.generator,
            )
        self._seed.fill_(draws.next_seed())
        if t == 0:
            logits = first_logits
            tokens, log_probs = self._fused.ops.sample(logits, temperature=self._temperature, seed=self._seed)
        else:
            tokens, log_probs, logits = self._fused_decode(rows)
        if restricts_draw(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, vocab=self._vocab
        ):
            return sample(
                logits.float(),
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                generator=draws.generator,
            )
        return tokens, log_probs

    # -- forward passes ------------------------------------------------------------------------------

    def _prefill(
        self, ids: torch.Tensor, start: torch.Tensor, cache: StaticKVCache, window: int | None = None
    ) -> torch.Tensor:
        """The prompts' forward pass over their last `window` positions (None: all), writing those cache
        positions; the last position's logits. Positions before the window are read from the cache
        (a session's kept KV, `_sessions`)."""
        rows, prompt_len = ids.shape
        first = 0 if window is None else prompt_len - window
        pos = torch.arange(first, prompt_len, device=self.device)
        keys = torch.arange(prompt_len, device=self.device)
        position_ids = (pos[None, :] - start[:, None]).clamp(min=0)
        query, key = pos[:, None], keys[None, :]
        # A pad query attends to itself only (finite values, never read by a real query).
        allowed = ((key >= start[:, None, None]) & (key <= query)) | (key == query)
        mask = self._additive(allowed[:, None])
        cache.bind(rows=rows, kv_len=prompt_len, write_pos=pos)
        out = self.model(
            input_ids=ids[:, first:],
            attention_mask=mask,
            position_ids=position_ids,
            **{cache_keyword(self.model): cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    def _decode_forward(self, rows: int, kv_len: int) -> torch.Tensor:
        """One decode step over the static inputs: rows [:rows], keys [:kv_len]; returns fp32 logits."""
        assert self._cache is not None
        start = self._start[:rows]
        position_ids = (self._pos - start)[:, None]
        allowed = (self._arange[None, :kv_len] >= start[:, None]) & (self._arange[None, :kv_len] <= self._pos)
        mask = self._additive(allowed[:, None, None])
        self._cache.bind(rows=rows, kv_len=kv_len, write_pos=self._pos)
        out = self.model(
            input_ids=self._ids[:rows],
            attention_mask=mask,
            position_ids=position_ids,
            **{cache_keyword(self.model): self._cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    def _decode(self, rows: int, kv_len: int) -> torch.Tensor:
        """transformers' decode step over keys [:kv_len]; fp32 logits (a graph's static output on CUDA)."""
        if self.device.type != "cuda" or not self.options.cuda_graph:
            return self._decode_fn(rows, kv_len)
        logits: torch.Tensor = self._replay((rows, kv_len), lambda: self._decode_fn(rows, kv_len))
        return logits

    def _fused_decode(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused decode step of rows [:rows] (`FusedDecoder.step`): tokens, log-probs, logits."""
        fused, cache = self._fused, self._cache
        assert fused is not None and cache is not None

        def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return fused.step(
                cache,
                ids=self._ids[:rows, 0],
                start=self._start[:rows],
                pos=self._pos,
                temperature=self._temperature,
                seed=self._seed,
            )

        if self.device.type != "cuda" or not self.options.cuda_graph:
            return step()
        outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = self._replay((rows, _FUSED), step)
        return outputs

    def _replay(self, key: tuple[int, int], step: Callable[[], Any]) -> Any:
        """Replay the graph of `key` (captured from `step` the first time); its static outputs."""
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, step)
        graph, outputs = entry
        graph.replay()
        return outputs

    def _capture(self, key: tuple[int, int], step: Callable[[], Any]) -> tuple[Any, Any]:
        # Warm up on a side stream (lazy inits and Triton's compilations must not be captured). The
        # warm-up step computes exactly what the replay will (same inputs, same cache writes), so it
        # is harmless.
        if self._side_stream is None:
            # One side stream for every capture: cuBLAS keeps a workspace per stream it has seen.
            self._side_stream = torch.cuda.Stream(self.device)
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            outputs = step()
        self._graphs[key] = (graph, outputs)
        return graph, outputs

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    # -- cache and graphs ----------------------------------------------------------------------------

    def _ensure_cache(self, rows: int, length: int) -> StaticKVCache:
        cache = self._cache
        if cache is not None and cache.rows >= rows and cache.length >= length:
            return cache
        if cache is not None:
            rows, length = max(rows, cache.rows), max(length, cache.length)
            self._drop_cache()
        saver = self._kv_saver
        if saver is not None:
            # The old buffer's segment goes back to the driver, and the new one is a cudaMalloc of its own
            # inside the region (not a cached block from outside it, nor a region block other tensors get).
            self._empty_device_cache()
        with saver.region("kv_cache") if saver is not None else contextlib.nullcontext():
            self._cache = StaticKVCache(
                num_layers=self._num_layers,
                rows=rows,
                kv_heads=self._kv_heads,
                length=length,
                head_dim=self._head_dim,
                dtype=self.dtype,
                device=self.device,
                one_buffer=saver is not None,
            )
        self._last_cache_shape = (rows, length)
        self._ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self._start = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._arange = torch.arange(length, device=self.device)
        return self._cache

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._graph_pool = None

    def _empty_device_cache(self) -> None:
        empty_device_cache(self.device)

    def _drop_cache(self) -> None:
        self._drop_graphs()
        self._cache = None
        self._ids = self._ids[:0].clone()
        self._start = self._start[:0].clone()
        self._arange = self._arange[:0].clone()
