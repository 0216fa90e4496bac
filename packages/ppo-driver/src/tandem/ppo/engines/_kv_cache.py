"""The embedded engine's static KV cache and its grouped-query decode attention, plugged into transformers.

The model code stays transformers' own: the engine passes this cache as
`past_key_values` (`cache` from transformers 5.2x, `cache_keyword`; the model calls only
`update(key, value, layer_idx, ...)` when it
gets explicit `position_ids` and a ready 4D mask), and registers one attention
function through transformers' `AttentionInterface`. That function differs from
transformers' SDPA path only for a one-token decode step of a grouped-query
model: with a mask, transformers repeats every KV head `groups` times before
SDPA (7x the KV bytes for Qwen2.5-0.5B); here the query heads of a group become
SDPA's query rows against their one KV head, so the cache is read once.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_NAME = "tandem_gqa_decode"

ONE_BUFFER_ALIGN = 2 * 1024**2
"""torch's CUDA allocator rounds a large segment up to 2 MiB (`kRoundLarge`)."""

ONE_BUFFER_MIN_BYTES = 10 * 1024**2
"""Below this (`kMinLargeAlloc`) torch's CUDA allocator takes a 20 MiB segment and splits the rest off."""


class StaticKVCache:
    """Preallocated keys and values of every layer, `(rows, kv_heads, length, head_dim)` per layer.

    `bind` says which rows and key positions the next forward pass sees and where it
    writes: a CUDA graph captured after `bind` keeps reading the same views, so the
    buffers must never be re-allocated while graphs over them live.

    `one_buffer`: every layer's keys and values are views of one buffer of at least
    `ONE_BUFFER_MIN_BYTES`, a whole number of `ONE_BUFFER_ALIGN` bytes, so that torch's
    allocator gives it a segment of its own with no free remainder that another tensor
    could take (what a torch_memory_saver region unmaps must hold this cache alone).
    """

    is_compileable = True

    def __init__(
        self,
        *,
        num_layers: int,
        rows: int,
        kv_heads: int,
        length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        one_buffer: bool = False,
    ) -> None:
        shape = (rows, kv_heads, length, head_dim)
        self.buffer: torch.Tensor | None = None
        if one_buffer:
            count = 2 * num_layers * rows * kv_heads * length * head_dim
            size = torch.empty(0, dtype=dtype).element_size()
            nbytes = max(count * size, ONE_BUFFER_MIN_BYTES)
            padded = -(-nbytes // ONE_BUFFER_ALIGN) * ONE_BUFFER_ALIGN
            self.buffer = torch.zeros(padded // size, dtype=dtype, device=device)
            views = self.buffer[:count].view(2 * num_layers, *shape).unbind(0)
            self.keys, self.values = list(views[:num_layers]), list(views[num_layers:])
        else:
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.rows = rows
        self.length = length
        self._view_rows = rows
        self._view_len = length
        self._write_pos: torch.Tensor | None = None

    @staticmethod
    def bytes_per_row(
        *, num_layers: int, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one row (one sequence) of `length` positions takes, keys and values of every layer."""
        return 2 * num_layers * kv_heads * length * head_dim * torch.empty(0, dtype=dtype).element_size()

    def nbytes(self) -> int:
        """Bytes the cache holds (its one buffer's whole size where it has one)."""
        if self.buffer is not None:
            return self.buffer.numel() * self.buffer.element_size()
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def zero(self) -> None:
        """Set every key and value to 0 (memory mapped afresh holds anything, NaN included, which a masked
        position's score would still carry through the softmax)."""
        for buf in (self.buffer,) if self.buffer is not None else (*self.keys, *self.values):
            buf.zero_()

    def bind(self, *, rows: int, kv_len: int, write_pos: torch.Tensor) -> None:
        """Let the next forward pass read rows `[:rows]`, positions `[:kv_len]`, and write at `write_pos` (1D)."""
        assert rows <= self.rows and kv_len <= self.length, (rows, kv_len, self.rows, self.length)
        self._view_rows, self._view_len, self._write_pos = rows, kv_len, write_pos

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys and values at the bound positions; return the bound views (transformers' API).

        Whatever else the model passes (`cache_kwargs` up to transformers 5.19, `kwargs=` from
        5.2x) is not needed: the positions come from `bind`.
        """
        assert self._write_pos is not None, "bind() before a forward pass"
        keys = self.keys[layer_idx][: self._view_rows]
        values = self.values[layer_idx][: self._view_rows]
        keys.index_copy_(2, self._write_pos, key_states.to(keys.dtype))
        values.index_copy_(2, self._write_pos, value_states.to(values.dtype))
        return keys[:, :, : self._view_len], values[:, :, : self._view_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Not used: the engine always passes `position_ids` (transformers asks only without them)."""
        return 0

    def reorder_rows(self, order: torch.Tensor) -> None:
        """Move rows `order` to the front (`rows[:len(order)] = rows[order]`), for dropping finished sequences."""
        n = order.numel()
        for buf in (*self.keys, *self.values):
            buf[:n].copy_(buf.index_select(0, order))


def cache_keyword(model: Any) -> str:
    """The keyword under which `model.forward` takes the KV cache.

    transformers renamed `past_key_values` to `cache` (5.2x; the old name warns until
    5.40); the engine passes its cache under the name the installed version reads.
    """
    model_class: Any = type(model)
    return _cache_keyword_of(model_class)


@functools.cache
def _cache_keyword_of(model_class: Any) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def gqa_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except a one-token step of a grouped-query model reads each KV head once.

    Shapes: query `(b, heads, q, d)`, key/value `(b, kv_heads, kv_len, d)`, mask
    `(b, 1, q, kv_len)` additive; returns `(b, q, heads, d)`.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, heads, q_len, d = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads == kv_heads:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # Head h uses KV head h // groups (transformers' repeat_kv), so the groups are contiguous.
    grouped = query.reshape(b, kv_heads, heads // kv_heads, d)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register `gqa_decode_attention` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, gqa_decode_attention)
    return ATTENTION_NAME
