"""Fused rotary position embedding (RoPE) for Megatron's local layer spec, without Transformer Engine.

Why: with Megatron's local (non-TE) spec every attention layer applies RoPE to
queries and keys with the unfused `rope_utils._apply_rotary_pos_emb_bshd`:
`t * cos + cat(-x2, x1) * sin`, then `cat((t, t_pass))`, which copies the whole
tensor even when `t_pass` is empty. On the 1.2 B probe model (hidden 2048,
24 layers, seq 2048, bf16, H200; `bench/train_profile.py`) that is about 12 bf16
multiply kernels, 6 cat kernels, negations and adds per layer and micro-batch,
~0.4 s of a `train()`'s 3.0 s of kernel time. Megatron's fused path
(`TransformerConfig.apply_rope_fusion`) calls Transformer Engine's kernels,
which we do not have. For packed micro-batches (THD) the unfused path also
loops over the samples in Python and waits for the GPU (`cu_seqlens.tolist()`).

How: the same arithmetic as small pure functions that `torch.compile` fuses.
`rope_cos_sin` turns the angles `freqs` (`(s, 1, 1, rot_dim)`) into a cos and sin
table in `t`'s dtype (one small kernel), and `rope_rotate` applies it (one
kernel forward, one backward, which needs only the table). The table is a kernel
of its own on purpose: fused into the rotation, cos and sin are recomputed for
every batch row and head, and the kernel waits on them instead of on memory
(slower on an H200, in a measurement the repository does not keep). `rotate_thd`
finds each packed token's position inside its sample (`searchsorted` over
`cu_seqlens`: no loop, no host sync) and gathers its table rows.

On CUDA the hooks run neither: one Triton kernel a call (`_rope_kernels`, `KERNELS`), with the
same numerics and without a compiled call's host cost, faster than both Megatron's eager RoPE and
these compiled functions (docs/benchmarks.md, "The Triton RoPE kernel"). What follows describes the
compiled functions, which run elsewhere (CPU tests) or when `KERNELS = "compiled"`.

`install()` sets Megatron's `rope_utils.fused_apply_rotary_pos_emb` /
`fused_apply_rotary_pos_emb_thd` (the TE hooks, None without TE) to
`fused_apply_rotary_pos_emb` / `fused_apply_rotary_pos_emb_thd` here, so that a
model built with `apply_rope_fusion=True` (`models.build_model(..., fused_rope=True)`)
routes to them. What they do not cover (interleaved rotary, context parallelism)
runs Megatron's own unfused functions, so the result is never wrong.

Numerics are Megatron's: cos and sin are computed in `freqs`' dtype (fp32) and
rounded to `t`'s dtype before multiplying, and the compiled kernels round each
product as eager does (`_INDUCTOR_OPTIONS`), so bf16 outputs and gradients are
bit-identical to Megatron's unfused ones (tests/megatron/test_rope.py). In fp32,
compiled kernels may fuse multiply-adds and differ in the last bits.

On the probe, a `train()` takes 3.00 s instead of 3.33 s (kernel time 2.76 s
instead of 3.13 s). The compile is lazy (first call, never at import): ~5 s once
per process on an H200 (the probe's first `train()`), ~20 s for a first model pass
on a 2-core CPU (2 s with inductor's on-disk cache warm). It marks the token,
batch and head dimensions dynamic, so micro-batches of other lengths and the
query and key head counts reuse the same kernels. Each kind of call (dtype,
device, grad mode, size-1 dimensions) has kernels of its own, so a process that
meets many kinds never reaches dynamo's recompile limit, and a kind that still
does runs eagerly with one warning instead of failing (`_KeyedKernel`).
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable
from functools import cache
from typing import Any, Literal, cast

import torch
from torch import Tensor

__all__ = [
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_thd",
    "install",
    "installed",
    "rope_cos_sin",
    "rope_rotate",
    "rope_sbhd",
    "rope_thd",
    "rotate_thd",
]

logger = logging.getLogger(__name__)

_install_lock = threading.Lock()

_INDUCTOR_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {"emulate_precision_casts": True}
"""Round where eager rounds (each bf16 product, then the sum): bit-identical to Megatron's bf16,
measured on an H200, at no cost (the kernel waits on memory). Without it, inductor keeps the
products in fp32 and about a third of the outputs differ from Megatron's by a bf16 rounding."""


def rope_cos_sin(freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles `freqs`, computed in `freqs`' dtype and rounded to `dtype` as Megatron does.

    Shape: like `freqs`, e.g. `(s, 1, 1, rot_dim)`.
    """
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def rope_rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`t` rotated by (cos, sin) on its first `cos.shape[-1]` channels, rotate-half style (not interleaved).

    `t * cos + cat(-x2, x1) * sin` on those channels, the rest passed through: one
    element-wise kernel when compiled, forward and backward alike (the backward needs
    only cos and sin).

    Shape: `t` `(s, b, heads, d)`; `cos`, `sin` `(s, 1, 1, rot_dim)` in `t`'s dtype
    (broadcast against `t`; `rot_dim` even, at most `d`); output like `t`.
    """
    rot_dim = cos.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    x1, x2 = torch.chunk(t_rot, 2, dim=-1)
    rotated = t_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, t_pass), dim=-1)


def rope_sbhd(t: Tensor, freqs: Tensor) -> Tensor:
    """`t` with non-interleaved (rotate-half) RoPE of angles `freqs` on its first `freqs.shape[-1]` channels.

    Megatron's `_apply_rotary_pos_emb_bshd` (mscale 1, not interleaved): the same
    operations in the same order, so eager it computes exactly what Megatron does.

    Shape: `t` `(s, b, heads, d)`, `freqs` `(s, 1, 1, rot_dim)` (broadcast against `t`;
    `rot_dim` even and at most `d`; channels past `rot_dim` pass through), output like `t`.
    """
    return rope_rotate(t, *rope_cos_sin(freqs, t.dtype))


def rotate_thd(t: Tensor, cu_seqlens: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Packed samples rotated by the (cos, sin) rows of each token's position inside its sample.

    Token `i` of the row lies in sample `j` with `cu_seqlens[j] <= i < cu_seqlens[j + 1]`
    (found by `searchsorted`: no loop over samples, no host sync) and is at position
    `i - cu_seqlens[j]`.

    Shape: `t` `(tokens, heads, d)`, `cu_seqlens` `(samples + 1,)` int32 with
    `cu_seqlens[-1] == tokens`, `cos`, `sin` `(max_seqlen, 1, 1, rot_dim)`; output like `t`.
    """
    tokens = torch.arange(t.shape[0], device=t.device, dtype=cu_seqlens.dtype)
    sample = torch.searchsorted(cu_seqlens, tokens, right=True) - 1
    positions = (tokens - cu_seqlens[sample]).long()
    return rope_rotate(t.unsqueeze(1), cos[positions], sin[positions]).squeeze(1)


def rope_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor) -> Tensor:
    """RoPE on packed samples, each sample's positions starting at 0 (`rotate_thd`).

    Megatron's `_apply_rotary_pos_emb_thd` with one context-parallel rank when `freqs`
    has fewer rows than `t` has tokens (its other case: `fused_apply_rotary_pos_emb_thd`).

    Shape: `t` `(tokens, heads, d)`, `cu_seqlens` `(samples + 1,)` int32,
    `freqs` `(max_seqlen, 1, 1, rot_dim)`; output like `t`.
    """
    return rotate_thd(t, cu_seqlens, *rope_cos_sin(freqs, t.dtype))


class _KeyedKernel:
    """`fn` compiled by inductor once per kind of call, and never a crash at the recompile limit.

    Dynamo keeps its compiled graphs, and counts them against `recompile_limit` (8), per
    code object; with `fullgraph=True` the call past the limit raises
    `FailOnRecompileLimitHit`. A process meets more than 8 kinds of call: dtypes (fp32, bf16),
    devices, grad mode (training, log-probs under `no_grad`), dimensions of size 1 (which stay
    specialised). So each kind (`_call_key`) gets a copy of `fn` with a code object of its own,
    hence its own graphs and its own budget, compiled on its first call (never at import). Within
    a kind the sizes are dynamic, so lengths, batch and head counts do not recompile. Should a
    kind still exhaust its budget, that kind runs `fn` eagerly from then on (the same
    arithmetic, one warning line), instead of failing the step.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.kernels: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.eager: set[tuple[Any, ...]] = set()
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        key = _call_key(args)
        if key in self.eager:
            return self.fn(*args)
        try:
            return self._kernel(key)(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            with self._lock:
                self.eager.add(key)
            logger.warning(
                "fused RoPE: %s reached torch._dynamo's recompile limit (%d) for its %s calls; they run "
                "eagerly from now on (the same results, slower)",
                self.fn.__name__,
                torch._dynamo.config.recompile_limit,
                _describe_kind(args),
            )
            return self.fn(*args)

    def _kernel(self, key: tuple[Any, ...]) -> Callable[..., Any]:
        kernel = self.kernels.get(key)
        if kernel is None:
            with self._lock:
                kernel = self.kernels.get(key)
                if kernel is None:
                    fn = self.fn
                    copy = types.FunctionType(
                        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
                    )
                    copy.__qualname__ = fn.__qualname__
                    kernel = torch.compile(copy, fullgraph=True, options=_INDUCTOR_OPTIONS)
                    self.kernels[key] = kernel
        return kernel


def _call_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What makes dynamo compile another graph, whatever the sizes: each tensor's device type, dtype,
    whether it needs a gradient and which of its dimensions have size 1; other arguments by value;
    grad mode."""
    parts: list[Any] = [torch.is_grad_enabled()]
    for a in args:
        if isinstance(a, Tensor):
            parts.append((a.device.type, a.dtype, a.requires_grad, tuple(n == 1 for n in a.shape)))
        else:
            parts.append(a)
    return tuple(parts)


def _describe_kind(args: tuple[Any, ...]) -> str:
    """The kind of a call in words: its first tensor's device and dtype, and grad mode."""
    first = next((a for a in args if isinstance(a, Tensor)), None)
    grad = "grad mode on" if torch.is_grad_enabled() else "no_grad"
    if first is None:
        return grad
    return f"{first.device.type} {str(first.dtype).removeprefix('torch.')}, {grad}"


@cache
def _compiled[F: Callable[..., Any]](fn: F) -> F:
    """`fn` compiled by inductor per kind of call (`_KeyedKernel`), once per process, on first use."""
    return cast(F, _KeyedKernel(fn))


def _dynamic(tensor: Tensor, dims: int) -> Tensor:
    """`tensor` with its first `dims` dimensions marked dynamic for the compiler.

    Sequence lengths, micro-batch sizes and head counts (queries vs keys) vary from
    call to call: compiled once with symbolic sizes, not once per shape. `maybe_`: a
    dimension of size 1 stays specialised instead of raising.
    """
    for dim in range(dims):
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return tensor


def fused_apply_rotary_pos_emb(
    t: Tensor, freqs: Tensor, transpose_output_memory: bool = False, interleaved: bool = False
) -> Tensor:
    """Megatron's `rope_utils.fused_apply_rotary_pos_emb` hook (sbhd): `rope_sbhd`, compiled.

    The signature of Megatron's Transformer Engine wrapper; `transpose_output_memory`
    is ignored as TE ignores it. Interleaved rotary runs Megatron's unfused function.

    Shape: `t` `(s, b, heads, d)`, `freqs` `(s, 1, 1, rot_dim)` fp32; output like `t`.
    """
    if interleaved:
        from megatron.core.models.common.embeddings import rope_utils

        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True)
    if _on_triton(t, freqs):
        from tandem.megatron.models import _rope_kernels

        return _rope_kernels.rotate(t, *_rope_kernels.rope_table(freqs, t.dtype))
    cos, sin = _compiled(rope_cos_sin)(_dynamic(freqs, 1), t.dtype)
    return _compiled(rope_rotate)(_dynamic(t, 3), _dynamic(cos, 1), _dynamic(sin, 1))


def fused_apply_rotary_pos_emb_thd(
    t: Tensor,
    cu_seqlens: Tensor,
    freqs: Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
    interleaved: bool = False,
) -> Tensor:
    """Megatron's `rope_utils.fused_apply_rotary_pos_emb_thd` hook (packed samples): `rope_thd`, compiled.

    The signature of Megatron's Transformer Engine wrapper. Like Megatron's unfused
    function, `freqs` with one row per token of the packed row (`freqs.shape[0] ==
    tokens`) is indexed by the token's place in the row, not in its sample. Interleaved
    rotary and context parallelism (`cp_size > 1`) run Megatron's unfused function.

    Shape: `t` `(tokens, heads, d)`, `cu_seqlens` `(samples + 1,)` int32,
    `freqs` `(max_seqlen, 1, 1, rot_dim)` fp32; output like `t`.
    """
    if interleaved or cp_size != 1:
        from megatron.core.models.common.embeddings import rope_utils

        return rope_utils._apply_rotary_pos_emb_thd(
            t,
            cu_seqlens,
            freqs,
            rotary_interleaved=interleaved,
            cp_group=_ContextParallelRank(cp_size, cp_rank),
        )
    if freqs.shape[0] == t.shape[0]:
        # Megatron's "packed freqs" case: positions run on over the whole row.
        return fused_apply_rotary_pos_emb(t.unsqueeze(1), freqs).squeeze(1)
    if _on_triton(t, freqs):
        from tandem.megatron.models import _rope_kernels

        positions = _rope_kernels.packed_positions(cu_seqlens, t.shape[0])
        cos, sin = _rope_kernels.rope_table(freqs, t.dtype)
        return _rope_kernels.rotate(t.unsqueeze(1), cos, sin, positions).squeeze(1)
    cos, sin = _compiled(rope_cos_sin)(_dynamic(freqs, 1), t.dtype)
    return _compiled(rotate_thd)(_dynamic(t, 2), _dynamic(cu_seqlens, 1), _dynamic(cos, 1), _dynamic(sin, 1))


KERNELS: Literal["auto", "triton", "compiled"] = "auto"
"""Which kernels the hooks run: "auto", the Triton kernel (`_rope_kernels`) on CUDA and the
compiled functions elsewhere; "triton" everywhere (on CPU tensors only under Triton's
interpreter, `TRITON_INTERPRET=1`: the tests); "compiled" everywhere (the A/B of
`bench/train_profile.py --rope-kernels compiled`, and the tests of the compiled path)."""


def _on_triton(t: Tensor, freqs: Tensor) -> bool:
    """Whether the hooks rotate `t` with the Triton kernel (`KERNELS`), which takes angles of one
    row a position (`(s, 1, 1, rot_dim)`) with `rot_dim` even and at most `t`'s channels, in
    fp32, bf16 or fp16; else the compiled functions."""
    if KERNELS == "compiled" or (KERNELS == "auto" and not t.is_cuda):
        return False
    rot_dim = freqs.shape[-1]
    return (
        freqs.dim() == 4
        and freqs.shape[1] == freqs.shape[2] == 1
        and rot_dim % 2 == 0
        and rot_dim <= t.shape[-1]
        and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


class _ContextParallelRank:
    """The two methods of a process group that Megatron's unfused THD RoPE calls (`size`, `rank`)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        """Context-parallel size."""
        return self._size

    def rank(self) -> int:
        """This rank in the context-parallel group."""
        return self._rank


def installed() -> bool:
    """Whether Megatron's fused-RoPE hooks are ours (`install()` ran in this process)."""
    from megatron.core.models.common.embeddings import rope_utils

    hooks: tuple[Any, Any] = (
        rope_utils.fused_apply_rotary_pos_emb,
        rope_utils.fused_apply_rotary_pos_emb_thd,
    )
    return hooks == (fused_apply_rotary_pos_emb, fused_apply_rotary_pos_emb_thd)


def install() -> None:
    """Make Megatron's `apply_rope_fusion=True` path run the functions of this module; idempotent.

    Sets `rope_utils.fused_apply_rotary_pos_emb` and `fused_apply_rotary_pos_emb_thd`,
    which `TransformerConfig.__post_init__` checks and `rope_utils.apply_rotary_pos_emb`
    calls (both read the module attributes at call time). Call it before building a
    `TransformerConfig` with `apply_rope_fusion=True`. Replaces Transformer Engine's
    kernels where TE is installed (our spec never uses TE).
    """
    from megatron.core.models.common.embeddings import rope_utils

    with _install_lock:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
        rope_utils.fused_apply_rotary_pos_emb_thd = fused_apply_rotary_pos_emb_thd
