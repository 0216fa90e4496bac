"""The core attention of our layer spec (Megatron's local, non-Transformer-Engine spec), packed samples included.

`models.build_model` uses Megatron's local layer spec, which runs on every host
(CPU included). Its core attention, Megatron's `DotProductAttention`, refuses
packed sequences (`PackedSeqParams`): with Transformer Engine's spec,
`TEDotProductAttention` would take Megatron's THD layout natively (flash
attention over `cu_seqlens`), but that spec is not available here. Megatron's
attention *layer* does handle THD for any core attention: it squeezes the
batch dimension and applies RoPE block by block from `cu_seqlens` (so positions
restart at every sample). Only the core attention has to keep the blocks apart,
and the two classes here do, so that sequence packing runs through the very
same `PackedSeqParams` interface with either choice of `models.Attention`:

- "sdpa" (`sdpa_attention`): causal `scaled_dot_product_attention` one block at
  a time: the flash / memory-efficient kernel on GPU, the exact math kernel
  on CPU, and no `t x t` mask anywhere;
- "local" (`local_attention`): Megatron's unfused attention over one packed row
  with an explicit block-diagonal causal mask (`packing.block_causal_mask`).

With "sdpa", packed rows may instead take one varlen flash-attention call a layer
(`WorkerConfig.packed_attention="varlen"`, `varlen_packed_attention`): PyTorch's
`torch.nn.attention.varlen.varlen_attn` over the row's `cu_seqlens`, causal through
flash attention's window `(-1, 0)`, in place of a call (and its copies) per sample:
256 samples x 24 layers of calls a pass in the 0.5B bench's packed step
(docs/benchmarks.md, "Realistic lengths"). CUDA, bf16 or fp16 only: elsewhere the
model refuses to build with it (`check_varlen`).

The GPU kernels of "sdpa" (`sdpa_backends`): flash, then memory-efficient
attention, never cuDNN's. cuDNN builds an execution graph for every new shape
of its inputs (tens to hundreds of milliseconds on the host each), and PPO's
shapes are new all the time: every packed sample has its own length, every
padded micro-batch its own longest sample. On one H200 (torch 2.11, the 0.5B
PPO bench with EOS and packing) a shared step took 59.4 s with cuDNN's builds
and 17.8 s without (docs/benchmarks.md, "Realistic lengths"); flash and
memory-efficient attention have no per-shape set-up. At fixed lengths cuDNN's
kernel is about 5 % faster for a whole `train()`, which is what the default gives
up there. `allow_cudnn_attention(True)` lets PyTorch pick cuDNN again (the A/B
lever of `bench/train_profile.py --sdpa-cudnn`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any, cast

import torch

from tandem.megatron.choices import PackedAttention
from tandem.megatron.models.packing import PackedRow, block_causal_mask, segments_of

_ALLOW_CUDNN = False


def allow_cudnn_attention(allow: bool) -> None:
    """Let the "sdpa" attention's calls on the GPU use cuDNN's kernel (off by default; module docstring)."""
    global _ALLOW_CUDNN
    _ALLOW_CUDNN = allow


@contextlib.contextmanager
def sdpa_backends(device: torch.device) -> Iterator[None]:
    """Within: SDPA on CUDA picks flash, memory-efficient or (last) the math kernel, not cuDNN's.

    Elsewhere (CPU), and with `allow_cudnn_attention(True)`, PyTorch's own choice stands.
    """
    if device.type != "cuda" or _ALLOW_CUDNN:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield


VarlenFn = Callable[..., torch.Tensor]
"""`torch.nn.attention.varlen.varlen_attn`'s calling convention (or a stand-in of it in tests)."""


@cache
def varlen_function() -> VarlenFn | None:
    """PyTorch's `varlen_attn` where this torch has it (2.10 and later), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return cast(VarlenFn, varlen_attn)  # returns a tuple only when asked for `return_aux`


@cache
def _takes_gqa(fn: VarlenFn) -> bool:
    """Whether `fn` groups query heads over fewer key/value heads itself (`enable_gqa`: torch 2.12 on; the
    H200 host's 2.11 has no such argument, docs/benchmarks.md)."""
    try:
        return "enable_gqa" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


VARLEN_MAX_HEAD_DIM = 256
"""The widest head flash attention takes (FlashAttention-2's limit, which PyTorch's varlen kernel shares)."""


def varlen_unavailable(
    device: torch.device, dtype: torch.dtype, head_dim: int, *, available: bool | None = None
) -> str | None:
    """Why `packed_attention="varlen"` cannot run here (no CUDA, not half precision, a head too wide, a
    torch without `varlen_attn`), or None where it can. `available`: whether this torch has the
    function (None: ask `varlen_function`)."""
    if device.type != "cuda":
        return f"the model is on {device.type}; varlen flash attention runs on CUDA only"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"params_dtype is {dtype}; flash attention takes bfloat16 or float16"
    if head_dim > VARLEN_MAX_HEAD_DIM:
        return f"the model's heads are {head_dim} wide; flash attention takes at most {VARLEN_MAX_HEAD_DIM}"
    if available is None:
        available = varlen_function() is not None
    if not available:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10 and later do)"
    return None


def check_varlen(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """ValueError, naming the field, where `packed_attention="varlen"` cannot run (`varlen_unavailable`)."""
    why = varlen_unavailable(device, dtype, head_dim)
    if why is not None:
        raise ValueError(f"packed_attention='varlen': {why}; use packed_attention='blocks'")


def resolve_packed_attention(
    packed_attention: PackedAttention,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    *,
    available: bool | None = None,
) -> PackedAttention:
    """`packed_attention` as the model runs it: "auto" is "varlen" wherever that can run, else "blocks"
    (the realistic-length 0.5B step on one H200: 11.90 s with blocks, 8.24 s with varlen,
    docs/benchmarks.md); "blocks" and "varlen" as given (`check_varlen` refuses "varlen" where it cannot)."""
    if packed_attention != "auto":
        return packed_attention
    return "blocks" if varlen_unavailable(device, dtype, head_dim, available=available) else "varlen"


def varlen_packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None,
    fn: VarlenFn | None = None,
) -> torch.Tensor:
    """Causal attention of every block of one packed row in one call: `[t, heads, d]` query, `[t, kv_heads, d]`
    key and value, `cu_seqlens` the blocks' int32 boundaries (`[blocks + 1]`, on the device); `[t, heads, d]`.

    `fn`: `varlen_function()` unless given. Where it cannot group query heads over fewer key/value
    heads itself, the key and value heads are repeated to the query's first (grouped-query models).
    """
    fn = fn if fn is not None else varlen_function()
    if fn is None:
        raise ValueError(
            f"packed_attention='varlen': torch {torch.__version__} has no torch.nn.attention.varlen"
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"varlen attention: {heads} query heads over {kv_heads} key/value heads")
    extra: dict[str, Any] = {}
    if heads != kv_heads:
        if _takes_gqa(fn):
            extra["enable_gqa"] = True
        else:
            key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    cu = cu_seqlens.to(torch.int32)
    # window (-1, 0): every earlier key of the block, none after the query (flash attention's causal window).
    return fn(query, key, value, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0), **extra)


def _one_boundary_list(params: Any) -> bool:
    """Whether a THD `PackedSeqParams` has one unpadded boundary tensor for queries and keys, as
    `packing.packed_seq_params` builds it (checked without reading the tensors back from the GPU;
    anything else goes the blocks' way, which checks it)."""
    return (
        getattr(params, "qkv_format", None) == "thd"
        and params.cu_seqlens_kv is params.cu_seqlens_q
        and params.cu_seqlens_q_padded is None
    )


@cache
def sdpa_attention() -> type:
    """Megatron's local core attention with the causal case on `torch.nn.functional.scaled_dot_product_attention`.

    The local `DotProductAttention` materialises `[b, heads, s, s]` scores and
    keeps them for backward; SDPA picks a flash / memory-efficient kernel on GPU
    (and the exact math kernel on CPU). Packed samples (THD `PackedSeqParams`)
    run block by block, each causal. Anything else but plain causal attention
    without a mask falls back to Megatron's implementation.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SdpaDotProductAttention(DotProductAttention):
        varlen: bool = False
        """Packed rows through `varlen_packed_attention` (one call a layer) instead of a call per block;
        `networks.build_model` sets it per model (`packed_attention="varlen"`)."""

        def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            """Causal attention of `[b, heads, s, d]` tensors (within `forward`'s `sdpa_backends`)."""
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1]
            )

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: Any = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            plain_causal = (
                attention_mask is None
                and attention_bias is None
                and mask_type == AttnMaskType.causal
                and self.softmax_offset is None
                and query.shape[0] == key.shape[0]
                and (not self.training or self.attention_dropout.p == 0.0)
            )
            if packed_seq_params is not None:
                if not plain_causal:
                    raise ValueError(
                        "use_sequence_packing: packed samples need plain causal attention "
                        "(no mask or bias of the caller's, no attention dropout, no softmax offset)"
                    )
                if self.varlen and _one_boundary_list(packed_seq_params):
                    context = varlen_packed_attention(
                        query,
                        key,
                        value,
                        packed_seq_params.cu_seqlens_q,
                        int(packed_seq_params.max_seqlen_q),
                        scale=self.softmax_scale,
                    )
                    return context.reshape(query.shape[0], self.hidden_size_per_partition)
                # THD: query [t, heads, d]; each block is one sample, attending causally to itself.
                # The kernels are chosen once for all the blocks (`sdpa_backends`).
                blocks = []
                with sdpa_backends(query.device):
                    for q, k, v in zip(
                        *(t.split(segments_of(packed_seq_params)) for t in (query, key, value)), strict=True
                    ):
                        # [n, heads, d] -> [1, heads, n, d]
                        blocks.append(self._sdpa(*(t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v))))
                # [1, heads, n, d] -> [n, heads * d], blocks back in row order: [t, heads * d]
                return torch.cat([b[0].permute(1, 0, 2) for b in blocks]).reshape(
                    query.shape[0], self.hidden_size_per_partition
                )
            if not plain_causal:
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )
            # [s, b, heads, d] -> [b, heads, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            with sdpa_backends(query.device):
                context = self._sdpa(q, k, v)
            # [b, heads, s, d] -> [s, b, heads * d]
            return context.permute(2, 0, 1, 3).reshape(
                query.shape[0], query.shape[1], self.hidden_size_per_partition
            )

    return SdpaDotProductAttention


@cache
def local_attention() -> type:
    """Megatron's unfused `DotProductAttention`, also over packed samples (THD) through a block-diagonal mask.

    Unpacked input goes to Megatron's implementation unchanged. Packed input
    `[t, heads, d]` becomes one row `[t, 1, heads, d]` whose mask lets each token
    attend only to the earlier tokens of its own sample (RoPE was already
    applied per sample by the attention layer).
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: Any = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            if packed_seq_params is None:
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )
            if attention_mask is not None or self.config.masked_softmax_fusion:
                # The fused causal softmax kernel ignores any mask it is given.
                raise ValueError(
                    "use_sequence_packing: the local attention keeps packed samples apart with a mask, "
                    "which needs masked_softmax_fusion=False and no mask of the caller's"
                )
            mask = block_causal_mask(PackedRow(tuple(segments_of(packed_seq_params))), query.device)
            # [t, heads, d] -> [t, 1, heads, d]; mask [1, 1, t, t]
            q, k, v = (t.unsqueeze(1) for t in (query, key, value))
            context = super().forward(q, k, v, mask[None, None], attn_mask_type, attention_bias, None)
            # [t, 1, heads * d] -> [t, heads * d]
            return context.squeeze(1)

    return PackedDotProductAttention
