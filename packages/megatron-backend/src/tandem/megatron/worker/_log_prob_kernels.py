"""Triton kernels of `fused_log_probs`: one program a row of logits, the vocabulary in blocks.

`row_stats` reads a row once and keeps, in fp32, with `x = logit / T` over this
slice's real columns (those below `vocab_limit`; the padding rows of Megatron's
padded vocabulary are left out):

    m = max x,   S = Σ e^{x − m},   A = Σ e^{x − m} (x − m),   x_t (0 when the target is elsewhere),

as an online softmax (each block rescales what came before to the new maximum).
`row_grads` writes a row's gradient in the logits' dtype from the row's softmax figures
(see `fused_log_probs` for the formula). Imported only where Triton is (CUDA hosts, or
the interpreter, `TRITON_INTERPRET=1`, which the CPU tests use).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096
"""Columns a program reads at a time (a power of two)."""


def _block(columns: int) -> int:
    return min(_BLOCK, triton.next_power_of_2(max(columns, 1)))


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    row_stride,
    targets_ptr,
    start,
    vocab_limit,
    temperature,
    max_ptr,
    sum_ptr,
    expected_ptr,
    picked_ptr,
    WITH_ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * row_stride
    target = tl.load(targets_ptr + row) - start
    # The running maximum starts finite, so that (m - m') * S stays 0 instead of NaN.
    m = tl.full([], -1.0e30, tl.float32)
    s = tl.zeros([], tl.float32)
    a = tl.zeros([], tl.float32)
    picked = tl.zeros([], tl.float32)
    for offset in range(0, vocab_limit, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        real = cols < vocab_limit
        x = tl.load(base + cols, mask=real, other=float("-inf")).to(tl.float32) / temperature
        new_m = tl.maximum(m, tl.max(x, 0))
        scale = tl.exp(m - new_m)
        e = tl.exp(x - new_m)
        if WITH_ENTROPY:
            a = scale * (a + (m - new_m) * s) + tl.sum(tl.where(real, e * (x - new_m), 0.0), 0)
        s = s * scale + tl.sum(e, 0)
        m = new_m
        picked += tl.sum(tl.where((cols == target) & real, x, 0.0), 0)
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)
    if WITH_ENTROPY:
        tl.store(expected_ptr + row, a)
    tl.store(picked_ptr + row, picked)


@triton.jit
def _row_grads_kernel(
    logits_ptr,
    row_stride,
    targets_ptr,
    start,
    vocab_limit,
    columns,
    temperature,
    shift_ptr,
    log_z_ptr,
    expected_ptr,
    grad_log_probs_ptr,
    grad_entropy_ptr,
    grad_ptr,
    grad_stride,
    HAS_LOG_PROBS: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * row_stride
    out = grad_ptr + row.to(tl.int64) * grad_stride
    target = tl.load(targets_ptr + row) - start
    shift = tl.load(shift_ptr + row)
    log_z = tl.load(log_z_ptr + row)
    g_lp = tl.zeros([], tl.float32)
    if HAS_LOG_PROBS:
        g_lp = tl.load(grad_log_probs_ptr + row)
    for offset in range(0, columns, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        real = cols < vocab_limit
        x = tl.load(base + cols, mask=real, other=0.0).to(tl.float32) / temperature
        shifted = x - shift
        # -p * (g_lp + g_H (s - E[s])), plus g_lp at the target.
        weight = tl.zeros((BLOCK,), tl.float32) + g_lp
        if HAS_ENTROPY:
            weight += tl.load(grad_entropy_ptr + row) * (shifted - tl.load(expected_ptr + row))
        grad = -tl.exp(shifted - log_z) * weight + tl.where(cols == target, g_lp, 0.0)
        grad = tl.where(real, grad, 0.0) / temperature
        tl.store(out + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < columns)


def row_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    start: int,
    vocab_limit: int,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of `logits` `(n, columns)`: `m`, `S`, `A` (zeros unless `with_entropy`) and `x_t`, fp32 `(n,)`."""
    n = logits.shape[0]
    stats = torch.zeros(4, n, dtype=torch.float32, device=logits.device)
    if n:
        _row_stats_kernel[(n,)](
            logits,
            logits.stride(0),
            targets,
            start,
            vocab_limit,
            temperature,
            stats[0],
            stats[1],
            stats[2],
            stats[3],
            WITH_ENTROPY=with_entropy,
            BLOCK=_block(vocab_limit),
            num_warps=8,
        )
    return stats[0], stats[1], stats[2], stats[3]


def row_grads(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    start: int,
    vocab_limit: int,
    temperature: float,
    shift: torch.Tensor,
    log_z: torch.Tensor,
    expected: torch.Tensor,
    grad_log_probs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient of the rows' log-probs and entropies with respect to `logits`, in its dtype."""
    n, columns = logits.shape
    grad = torch.empty_like(logits)
    if n:
        dummy = shift  # any fp32 row tensor where an upstream gradient is absent (never read)
        _row_grads_kernel[(n,)](
            logits,
            logits.stride(0),
            targets,
            start,
            vocab_limit,
            columns,
            temperature,
            shift,
            log_z,
            expected,
            grad_log_probs if grad_log_probs is not None else dummy,
            grad_entropy if grad_entropy is not None else dummy,
            grad,
            grad.stride(0),
            HAS_LOG_PROBS=grad_log_probs is not None,
            HAS_ENTROPY=grad_entropy is not None,
            BLOCK=_block(columns),
            num_warps=8,
        )
    return grad
