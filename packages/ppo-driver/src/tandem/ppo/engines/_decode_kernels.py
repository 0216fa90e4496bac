"""Triton kernels of the fused decode step: `TritonOps`, the CUDA implementation of `DecodeOps`.

Each kernel computes what `_decode_ops.ReferenceOps` computes, at the same rounding
points (tests/ppo/engines/test_decode_kernels.py compares them, on the CPU under
`TRITON_INTERPRET=1`). Only long-stable Triton is used (loads/stores with masks,
reductions, `tl.dot`, `tl.rand`, constexpr block sizes): the GPU hosts run older
Triton than the development machine. No kernel takes a position or a seed as a
Python number: they read `pos`, `start`, the temperature and the seed from device
tensors, so one CUDA graph of a decode step serves every step.

Imported only where the fused decode runs with Triton (torch's CUDA wheels bring triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._sample_kernels import sample_combine_kernel, sample_row_kernel, sample_split_kernel

_MAX_SPLITS = 16
_ATTENTION_BLOCK_N = {2: 64, 4: 32}
"""Keys per attention block by element size: fp32 blocks of 64 keys of 128 dims would overfill shared memory."""
_SAMPLE_BLOCK = 1024
_MAX_SAMPLE_SPLITS = 64
_ELEMENTWISE_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, hidden, eps, HAS_X: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    offsets = row * hidden + cols
    dtype = residual_ptr.dtype.element_ty
    h = tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_X:
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        # transformers adds in the model's dtype: round the sum before the norm reads it.
        h = (h + x).to(dtype)
        tl.store(residual_ptr + offsets, h, mask=mask)
        h = h.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / hidden
    normed = (h * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (weight * normed).to(dtype), mask=mask)


@triton.jit
def _rope_cache_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    start_ptr,
    pos_ptr,
    q_out_ptr,
    keys_ptr,
    values_ptr,
    qkv_stride,
    cache_stride_row,
    cache_stride_head,
    cache_stride_pos,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)  # [0, HEADS): a query head; [HEADS, HEADS + KV_HEADS): a key head
    dtype = qkv_ptr.dtype.element_ty
    pos = tl.load(pos_ptr)
    position = tl.maximum(pos - tl.load(start_ptr + row), 0)
    half = tl.arange(0, BLOCK_HALF)
    mask = half < HALF
    table = position * (2 * HALF)
    cos1 = tl.load(cos_ptr + table + half, mask=mask).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + HALF + half, mask=mask).to(tl.float32)
    sin1 = tl.load(sin_ptr + table + half, mask=mask).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + HALF + half, mask=mask).to(tl.float32)
    src = qkv_ptr + row.to(tl.int64) * qkv_stride + head * (2 * HALF)
    x1 = tl.load(src + half, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF + half, mask=mask).to(tl.float32)
    # transformers: q * cos + rotate_half(q) * sin, each product and the sum rounded to the dtype.
    out1 = ((x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    if head < HEADS:
        dst = q_out_ptr + (row.to(tl.int64) * HEADS + head) * (2 * HALF)
        tl.store(dst + half, out1, mask=mask)
        tl.store(dst + HALF + half, out2, mask=mask)
    else:
        at = row.to(tl.int64) * cache_stride_row + (head - HEADS) * cache_stride_head + pos * cache_stride_pos
        tl.store(keys_ptr + at + half, out1, mask=mask)
        tl.store(keys_ptr + at + HALF + half, out2, mask=mask)
        v_src = src + KV_HEADS * (2 * HALF)
        tl.store(values_ptr + at + half, tl.load(v_src + half, mask=mask), mask=mask)
        tl.store(values_ptr + at + HALF + half, tl.load(v_src + HALF + half, mask=mask), mask=mask)


@triton.jit
def _attention_kernel(
    q_ptr,
    keys_ptr,
    values_ptr,
    start_ptr,
    pos_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    scale,
    cache_stride_row,
    cache_stride_head,
    cache_stride_pos,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Keys [start, end): left pads and future positions are never read.
    start = tl.load(start_ptr + row).to(tl.int32)
    end = tl.load(pos_ptr).to(tl.int32) + 1
    # Each split takes a whole number of blocks of the row's keys; trailing splits may be empty.
    chunk = (((end - start) + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, end)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    in_dim = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & in_dim[None, :]
    q_at = ((row.to(tl.int64) * HEADS + heads) * HEAD_DIM)[:, None] + d[None, :]
    q = tl.load(q_ptr + q_at, mask=q_mask, other=0.0)
    base = row.to(tl.int64) * cache_stride_row + kv_head * cache_stride_head
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for block in range(lo, hi, BLOCK_N):
        t = block + tl.arange(0, BLOCK_N)
        valid = t < hi  # t[0] always is: no block is fully masked
        at = base + t.to(tl.int64) * cache_stride_pos
        k_t = tl.load(keys_ptr + at[None, :] + d[:, None], mask=valid[None, :] & in_dim[:, None], other=0.0)
        scores = tl.dot(q, k_t, input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(values_ptr + at[:, None] + d[None, :], mask=valid[:, None] & in_dim[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if SPLITS == 1:
        tl.store(out_ptr + q_at, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # This split's part: its normalized output and log-sum-exp (-inf: no keys).
        slot = (row.to(tl.int64) * HEADS + heads) * SPLITS + split
        safe = tl.where(denom > 0, denom, 1.0)
        tl.store(part_ptr + (slot * HEAD_DIM)[:, None] + d[None, :], acc / safe[:, None], mask=q_mask)
        lse = tl.where(denom > 0, m + tl.log(safe), float("-inf"))
        tl.store(lse_ptr + slot, lse, mask=g < GROUP)


@triton.jit
def _combine_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64)  # row * heads + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + slot * SPLITS + s, mask=s < SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)  # finite: the split holding `start` has keys
    weight = tl.exp(lse - top)
    mask = (s < SPLITS)[:, None] & (d < HEAD_DIM)[None, :]
    parts = tl.load(part_ptr + (slot * SPLITS + s[:, None]) * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + slot * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, total, inter, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    row = i // inter
    gate_at = row * (2 * inter) + i % inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + gate_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + gate_at + inter, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + i, (act * up).to(dtype), mask=mask)


SAMPLE_PROGRAMS_PER_PROCESSOR = 8
"""The sampler's default split: each row's vocabulary over programs until about this many run a
multiprocessor. On one H200 (`bench/engine_bench.py --ab-sampler`, docs/benchmarks.md) it drew the
same tokens as one program a row in 0.23 instead of 0.30 ms at 256 rows of a 152k vocabulary, and
0.11 instead of 0.22 ms at 64 rows."""


class TritonOps:
    """`DecodeOps` as Triton kernels (CUDA; or any device under `TRITON_INTERPRET=1`).

    Args:
        device: where the tensors live; its multiprocessor count sizes the attention's and the
            sampler's splits.
        sample_programs_per_processor: N (default `SAMPLE_PROGRAMS_PER_PROCESSOR`): the sampler
            splits each row's vocabulary over programs until there are about N a multiprocessor;
            None: one program a row (the same tokens; `bench/engine_bench.py --ab-sampler` times
            the two).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        sample_programs_per_processor: int | None = SAMPLE_PROGRAMS_PER_PROCESSOR,
    ) -> None:
        self.sample_programs_per_processor = sample_programs_per_processor
        self._processors = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        )

    def rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        rows, hidden = residual.shape
        assert residual.is_contiguous() and (x is None or (x.is_contiguous() and x.shape == residual.shape))
        out = torch.empty_like(residual)
        _rms_norm_kernel[(rows,)](
            residual if x is None else x,
            residual,
            weight,
            out,
            hidden,
            eps,
            HAS_X=x is not None,
            BLOCK=triton.next_power_of_2(hidden),
            num_warps=4 if hidden <= 4096 else 8,
        )
        return out

    def rope_cache_write(
        self,
        qkv: torch.Tensor,
        *,
        heads: int,
        kv_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start: torch.Tensor,
        pos: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        rows, head_dim = qkv.shape[0], cos.shape[-1]
        assert qkv.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
        assert keys.is_contiguous() and values.is_contiguous() and keys.shape == values.shape
        q = torch.empty(rows, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        _rope_cache_kernel[(rows, heads + kv_heads)](
            qkv,
            cos,
            sin,
            start,
            pos,
            q,
            keys,
            values,
            qkv.stride(0),
            keys.stride(0),
            keys.stride(1),
            keys.stride(2),
            HEADS=heads,
            KV_HEADS=kv_heads,
            HALF=head_dim // 2,
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            num_warps=1,
        )
        return q

    def attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        start: torch.Tensor,
        pos: torch.Tensor,
        scale: float,
        splits: int,
    ) -> torch.Tensor:
        rows, heads, head_dim = q.shape
        kv_heads = keys.shape[1]
        group = heads // kv_heads
        assert q.is_contiguous() and keys.is_contiguous() and values.is_contiguous()
        out = torch.empty(rows, heads * head_dim, dtype=q.dtype, device=q.device)
        if splits > 1:
            part = torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=q.device)
            lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
        else:
            part = lse = out  # not read by the one-split kernel
        _attention_kernel[(rows, kv_heads, splits)](
            q,
            keys,
            values,
            start,
            pos,
            out,
            part,
            lse,
            scale,
            keys.stride(0),
            keys.stride(1),
            keys.stride(2),
            HEADS=heads,
            GROUP=group,
            BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs 16 rows
            HEAD_DIM=head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_N=_ATTENTION_BLOCK_N[q.element_size()],
            SPLITS=splits,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=4,
        )
        if splits > 1:
            _combine_kernel[(rows * heads,)](
                part,
                lse,
                out,
                SPLITS=splits,
                BLOCK_S=triton.next_power_of_2(splits),
                HEAD_DIM=head_dim,
                BLOCK_D=triton.next_power_of_2(head_dim),
            )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        assert gate_up.is_contiguous() and width % 2 == 0
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)
        total = out.numel()
        _silu_mul_kernel[(triton.cdiv(total, _ELEMENTWISE_BLOCK),)](
            gate_up, out, total, width // 2, BLOCK=_ELEMENTWISE_BLOCK
        )
        return out

    def sample(
        self, logits: torch.Tensor, *, temperature: torch.Tensor, seed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, vocab = logits.shape
        assert logits.stride(-1) == 1
        tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
        log_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
        if self.sample_programs_per_processor is None:
            sample_row_kernel[(rows,)](
                logits, temperature, seed, tokens, log_probs, vocab, logits.stride(0), BLOCK=_SAMPLE_BLOCK
            )
            return tokens, log_probs
        splits, span = self.sample_splits(rows, vocab)
        part = torch.empty(rows, splits, 3, dtype=torch.float32, device=logits.device)
        part_idx = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
        sample_split_kernel[(rows, splits)](
            logits,
            temperature,
            seed,
            part,
            part_idx,
            vocab,
            logits.stride(0),
            span,
            SPLITS=splits,
            BLOCK=_SAMPLE_BLOCK,
        )
        sample_combine_kernel[(rows,)](
            logits,
            temperature,
            part,
            part_idx,
            tokens,
            log_probs,
            vocab,
            logits.stride(0),
            SPLITS=splits,
            BLOCK_S=max(2, triton.next_power_of_2(splits)),
        )
        return tokens, log_probs

    def sample_splits(self, rows: int, vocab: int) -> tuple[int, int]:
        """(programs a row, vocabulary entries each) of the split sampler: enough programs for
        `sample_programs_per_processor` a multiprocessor, each at least one block. One program a row
        (256 at the 0.5B bench's batch) took 0.30 ms of a 2.0 ms decode step on the H200 to read
        78 MB of logits (engine_profile_fused_dfaa394.json)."""
        blocks = triton.cdiv(vocab, _SAMPLE_BLOCK)
        wanted = triton.cdiv((self.sample_programs_per_processor or 1) * self._processors, rows)
        splits = max(1, min(_MAX_SAMPLE_SPLITS, blocks, wanted))
        span = triton.cdiv(blocks, splits) * _SAMPLE_BLOCK
        return triton.cdiv(vocab, span), span

    def attention_splits(self, rows: int, kv_heads: int) -> int:
        # Enough programs for two per multiprocessor; at large batches one split (no combine kernel).
        return max(1, min(_MAX_SPLITS, -(-2 * self._processors // (rows * kv_heads))))
