"""The embedded engine's forward passes over its static KV cache, and the cache and CUDA graphs they use.

`ForwardPasses` is a mixin of `EmbeddedEngine` (which sets the attributes it
declares): the prefill writes the prompts into a `StaticKVCache`; each decode step
is one forward pass of the static inputs (`_ids`, `_start`, `_pos`, `_arange`),
eager, compiled, or on CUDA replayed from a graph captured per (rows, kv_len) in
one memory pool. The cache and the static inputs grow together (`_ensure_cache`);
dropping the cache drops the graphs that read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._kv_cache import StaticKVCache, cache_keyword
from ._options import EngineOptions


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
    _graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]]
    _graph_pool: Any
    _side_stream: Any
    _decode_fn: Callable[[int, int], torch.Tensor]
    # Static inputs of the decode step (CUDA graphs read these very tensors).
    _ids: torch.Tensor
    _start: torch.Tensor
    _pos: torch.Tensor
    _arange: torch.Tensor

    # -- forward passes ------------------------------------------------------------------------------

    def _prefill(self, ids: torch.Tensor, start: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """The prompts' forward pass, writing cache positions [0, prompt_len); the last position's logits."""
        rows, prompt_len = ids.shape
        pos = torch.arange(prompt_len, device=self.device)
        position_ids = (pos[None, :] - start[:, None]).clamp(min=0)
        query, key = pos[:, None], pos[None, :]
        # A pad query attends to itself only (finite values, never read by a real query).
        allowed = ((key >= start[:, None, None]) & (key <= query)) | (key == query)
        mask = self._additive(allowed[:, None])
        cache.bind(rows=rows, kv_len=prompt_len, write_pos=pos)
        out = self.model(
            input_ids=ids,
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
        if self.device.type != "cuda" or not self.options.cuda_graph:
            return self._decode_fn(rows, kv_len)
        entry = self._graphs.get((rows, kv_len))
        if entry is None:
            entry = self._capture(rows, kv_len)
        graph, logits = entry
        graph.replay()
        return logits

    def _capture(self, rows: int, kv_len: int) -> tuple[Any, torch.Tensor]:
        # Warm up on a side stream (lazy inits must not be captured). The warm-up step computes
        # exactly what the replay will (same inputs, same cache writes), so it is harmless.
        if self._side_stream is None:
            # One side stream for every capture: cuBLAS keeps a workspace per stream it has seen.
            self._side_stream = torch.cuda.Stream(self.device)
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._decode_fn(rows, kv_len)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits = self._decode_fn(rows, kv_len)
        self._graphs[(rows, kv_len)] = (graph, logits)
        return graph, logits

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
        self._cache = StaticKVCache(
            num_layers=self._num_layers,
            rows=rows,
            kv_heads=self._kv_heads,
            length=length,
            head_dim=self._head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self._last_cache_shape = (rows, length)
        self._ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self._start = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._arange = torch.arange(length, device=self.device)
        return self._cache

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._graph_pool = None

    def _drop_cache(self) -> None:
        self._drop_graphs()
        self._cache = None
        self._ids = self._ids[:0].clone()
        self._start = self._start[:0].clone()
        self._arange = self._arange[:0].clone()
