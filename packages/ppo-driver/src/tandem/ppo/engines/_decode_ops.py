"""The fused decode step's operations: their contract (`DecodeOps`) and a pure-torch reference of each.

`FusedDecoder` (`_fused_decode.py`) runs a decode step as torch GEMMs on
transformers' own weights with five operations between them. Each operation has
two implementations with one contract: the Triton kernels of `_decode_kernels.py`
(CUDA), and `ReferenceOps` here: plain torch at the rounding points of
transformers' Llama/Qwen2 code, which the CPU tests run end to end and compare
the kernels against. The sampler's noise is Triton's Philox (`tl.rand`),
reproduced bit for bit by `philox_uniform`, so both draw the same tokens.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

ROW_SEED_STRIDE = 1 << 40
"""Row r of a step with seed s draws with Philox key s + r * ROW_SEED_STRIDE: the decode loop adds 1 to s
a step, so no (step, row) pair shares a key with another within 2**40 steps."""

_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_MASK32 = 0xFFFFFFFF
_UNIFORM_SCALE = 4.6566127342e-10  # triton.language.random.uint_to_uniform_float's, for 32-bit draws
MIN_UNIFORM = 1e-30
"""Uniform draws are clamped to at least this before the Gumbel transform (a draw of exactly 0, one in
2**31, would give log(0)); both implementations clamp alike."""


class DecodeOps(Protocol):
    """The operations of one decode step between its GEMMs (shapes for `rows` sequences of one token).

    Tensors are in the model's dtype unless said otherwise; `start` `(rows,)` int64 is each
    row's left padding, `pos` `(1,)` int64 the cache position this step writes (the same for
    every row); both are device tensors, so that a CUDA graph of the step serves every position.
    """

    def rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """`residual += x` (in place, rounded to the dtype; skipped when x is None), then RMSNorm of it.

        Shape: x, residual `(rows, hidden)`, weight `(hidden,)` -> `(rows, hidden)`; transformers'
        rounding: `weight * (r.float() * rsqrt(mean(r.float()**2) + eps)).to(dtype)`.
        """
        ...

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
        """Rotate q and k (rotate_half RoPE at position `pos - start`), write k and v at cache position `pos`.

        Shape: qkv `(rows, (heads + 2 kv_heads) * head_dim)` (q, k, v back to back), cos/sin
        `(positions, head_dim)`, keys/values `(cache_rows, kv_heads, length, head_dim)` ->
        rotated q `(rows, heads, head_dim)`.
        """
        ...

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
        """Grouped-query attention of each row's query over its cache positions [start, pos].

        Shape: q `(rows, heads, head_dim)`, keys/values `(cache_rows, kv_heads, length, head_dim)`
        -> `(rows, heads * head_dim)`. Query head h reads KV head h // (heads // kv_heads), as
        transformers' `repeat_kv`; `splits` divides the keys among programs (kernels only).
        """
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up. Shape: `(rows, 2 * inter)` (gate then up) -> `(rows, inter)`."""
        ...

    def sample(
        self, logits: torch.Tensor, *, temperature: torch.Tensor, seed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row and its log-prob; see `ReferenceOps.sample`.

        Shape: logits `(rows, vocab)` (any float dtype), temperature `(1,)` fp32, seed `(1,)`
        int64 -> tokens `(rows,)` int64, log-probs `(rows,)` fp32.
        """
        ...

    def attention_splits(self, rows: int, kv_heads: int) -> int:
        """How many programs share one row's keys, for a step of `rows` rows (fixed per CUDA graph)."""
        ...


class ReferenceOps:
    """`DecodeOps` in plain torch, the rounding points of transformers' Llama/Qwen2 code (tests, CPU)."""

    def rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if x is not None:
            residual.add_(x)
        h = residual.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(residual.dtype)

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
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = q.reshape(rows, heads, head_dim)
        k = k.reshape(rows, kv_heads, head_dim)
        v = v.reshape(rows, kv_heads, head_dim)
        positions = (pos - start).clamp(min=0)
        c, s = cos[positions][:, None], sin[positions][:, None]
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        keys[:rows].index_copy_(2, pos, k[:, :, None])
        values[:rows].index_copy_(2, pos, v[:, :, None])
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
        kv_heads, length = keys.shape[1], keys.shape[2]
        grouped = q.float().reshape(rows, kv_heads, heads // kv_heads, head_dim)
        k, v = keys[:rows].float(), values[:rows].float()
        scores = torch.einsum("rkgd,rkld->rkgl", grouped, k) * scale
        t = torch.arange(length, device=q.device)
        allowed = (t[None, :] >= start[:, None]) & (t[None, :] <= pos)
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        out = torch.einsum("rkgl,rkld->rkgd", torch.softmax(scores, dim=-1), v)
        return out.reshape(rows, heads * head_dim).to(q.dtype)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def sample(
        self, logits: torch.Tensor, *, temperature: torch.Tensor, seed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gumbel-max: argmax over v of (logit_v / T + g_v), g = -log(-log(u)), u from Philox.

        That is a draw from softmax(logits / T) (the Gumbel-max trick), the distribution of
        `_sampling.sample`'s exponential race. The log-prob is `log_softmax(logits / T)[token]`;
        T <= 0 is greedy (argmax, log-prob under T = 1). Row r's noise u_v is
        `tl.rand(seed + r * ROW_SEED_STRIDE, v)`.
        """
        x = logits.float()
        greedy = temperature <= 0
        z = x / torch.where(greedy, torch.ones_like(temperature), temperature)
        rows, vocab = x.shape
        row_seeds = seed + torch.arange(rows, device=x.device) * ROW_SEED_STRIDE
        u = philox_uniform(row_seeds[:, None], torch.arange(vocab, device=x.device)[None, :])
        gumbel = -torch.log(-torch.log(u.clamp(min=MIN_UNIFORM)))
        tokens = torch.where(greedy, z, z + gumbel).argmax(dim=-1)
        log_probs = z.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
        return tokens, log_probs

    def attention_splits(self, rows: int, kv_heads: int) -> int:
        return 1


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def philox_uniform(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`tl.rand(seed, offset)` in torch, bit for bit: Philox 4x32 with 10 rounds, the first word as a float.

    Shape: seeds (int64) and offsets (int, in [0, 2**31)) broadcast together -> fp32 in [0, 1).
    The 32-bit products are split in 16-bit halves so that no int64 product overflows.
    """
    c0 = (offsets.to(torch.int64) & _MASK32) + torch.zeros_like(seeds)
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0 = (seeds & _MASK32) + torch.zeros_like(c0)
    k1 = ((seeds >> 32) & _MASK32) + torch.zeros_like(c0)
    for _ in range(10):
        prev_c0, prev_c2 = c0, c2
        c0 = _umulhi(_PHILOX_ROUND_B, prev_c2) ^ c1 ^ k0
        c2 = _umulhi(_PHILOX_ROUND_A, prev_c0) ^ c3 ^ k1
        c1 = _umullo(_PHILOX_ROUND_B, prev_c2)
        c3 = _umullo(_PHILOX_ROUND_A, prev_c0)
        k0 = (k0 + _PHILOX_KEY_A) & _MASK32
        k1 = (k1 + _PHILOX_KEY_B) & _MASK32
    # uint_to_uniform_float: the word as an int32, negative ones bit-flipped, times the scale.
    signed = torch.where(c0 >= 1 << 31, c0 - (1 << 32), c0)
    signed = torch.where(signed < 0, -signed - 1, signed)
    # A Python float scales an fp32 tensor in fp32, as Triton's constant (and no host-to-device copy,
    # which a CUDA graph capture would refuse).
    return signed.to(torch.float32) * _UNIFORM_SCALE


def _umulhi(a: int, b: torch.Tensor) -> torch.Tensor:
    """The high 32 bits of the 64-bit product of uint32 `a` and `b` (b held in int64)."""
    b_lo, b_hi = b & 0xFFFF, b >> 16
    return ((a * b_hi + ((a * b_lo) >> 16)) >> 16) & _MASK32


def _umullo(a: int, b: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of the product of uint32 `a` and `b` (b held in int64)."""
    b_lo, b_hi = b & 0xFFFF, b >> 16
    return (a * b_lo + ((a * b_hi) & 0xFFFF) * 65536) & _MASK32
