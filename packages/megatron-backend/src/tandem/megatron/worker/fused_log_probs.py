"""Log-probs and entropies over a vocabulary-parallel slice of logits with two Triton kernels, on CUDA.

The plain-autograd path (`response_outputs.vocab_parallel_log_probs` on `logits.float() / T`)
makes about eight passes over fp32 copies of the response logits forward and as
many backward: on the 0.5B PPO bench (8,192 response positions a micro-batch over a
151,936-token vocabulary) each copy is 5 GB. `fused_log_probs` reads the logits once
forward (`_log_prob_kernels.row_stats`: an online softmax per row, in fp32) and once
backward, writing the gradient in the logits' dtype (`row_grads`); between the two
it keeps three fp32 numbers a row.

With `x = z / T` this rank's scaled logits of a row, its statistics `m_r = max x`,
`S_r = Σ e^{x − m_r}`, `A_r = Σ e^{x − m_r}(x − m_r)` are combined over the
tensor-parallel ranks at the global maximum `M` (all-reduced MAX):

    Z = Σ_r S_r e^{m_r − M},   Σ_j e^{s_j} s_j = Σ_r e^{m_r − M} (A_r + (m_r − M) S_r),   s = x − M,
    log p_t = s_t − log Z,     H = log Z − E[s],   E[s] = Σ_j p_j s_j,

and the gradient is the one `log_probs.chunked_log_probs` documents:
`∂/∂x_j = −p_j (g_lp + g_H (s_j − E[s])) + g_lp 1[j = t]`, `∂/∂z = ∂/∂x / T`, this
rank's slice only (the outputs, and so their upstream gradients, are the same on
every rank). The values equal the reference's to fp32 rounding (an online softmax
sums in another order).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["fused_log_probs", "fused_log_probs_available"]


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_log_probs_available(device: torch.device) -> bool:
    """True where `fused_log_probs` runs: a CUDA device with Triton installed."""
    return device.type == "cuda" and _triton_importable()


class _FusedLogProbs(torch.autograd.Function):
    """Log-probs (and entropies) of one TP rank's logits slice through the Triton kernels."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        vocab_limit: int,
        with_entropy: bool,
        start: int,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from tandem.megatron.worker._log_prob_kernels import row_stats  # Triton: CUDA hosts only

        m, s, a, picked = row_stats(
            logits,
            targets,
            start=start,
            vocab_limit=vocab_limit,
            temperature=temperature,
            with_entropy=with_entropy,
        )
        shift = m.clone()
        if group is not None:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
        scale = (m - shift).exp()
        in_slice = (targets >= start) & (targets < start + vocab_limit)
        sums = [s * scale, (picked - shift) * in_slice]
        if with_entropy:
            sums.append(scale * (a + (m - shift) * s))
        reduced = torch.stack(sums)
        if group is not None:
            dist.all_reduce(reduced, group=group)
        log_z = reduced[0].log()
        log_probs = reduced[1] - log_z
        expected = reduced[2] / reduced[0] if with_entropy else log_z.new_empty(0)
        entropy = log_z - expected if with_entropy else log_z.new_empty(0)
        ctx.save_for_backward(logits, targets, shift, log_z, expected)
        ctx.temperature, ctx.vocab_limit, ctx.start = temperature, vocab_limit, start
        ctx.with_entropy = with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        from tandem.megatron.worker._log_prob_kernels import row_grads  # Triton: CUDA hosts only

        logits, targets, shift, log_z, expected = ctx.saved_tensors
        nothing = (None,) * 6
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_log_probs is None and grad_entropy is None:
            return (None, *nothing)
        grad = row_grads(
            logits,
            targets,
            start=ctx.start,
            vocab_limit=ctx.vocab_limit,
            temperature=ctx.temperature,
            shift=shift,
            log_z=log_z,
            expected=expected if ctx.with_entropy else shift,
            grad_log_probs=None if grad_log_probs is None else grad_log_probs.float().contiguous(),
            grad_entropy=None if grad_entropy is None else grad_entropy.float().contiguous(),
        )
        return (grad, *nothing)


def fused_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` (and entropies) under `softmax(logits / temperature)`, through Triton.

    The values of `response_outputs.vocab_parallel_log_probs(logits.float() / temperature, ...)`
    to fp32 rounding, with no fp32 copy of `logits` (module docstring).

    Args:
        logits: this TP rank's vocabulary slice, `(n, padded_vocab / tp)`, in the model's dtype.
        targets: `(n,)` global token ids.
        temperature: the sampling temperature (positive); logits are divided by it.
        with_entropy: also return each row's entropy; else None.
        vocab_size: the tokenizer's vocabulary; the padding columns past it are left out
            of the softmax. None: every column is a token.

    Returns:
        `(log_probs, entropy)`, fp32 `(n,)` tensors (entropy None unless asked),
        differentiable with respect to `logits`; the gradient comes back in its dtype.
    """
    from megatron.core import parallel_state as mpu

    if temperature <= 0:
        raise ValueError(f"fused_log_probs: temperature is {temperature}; it must be positive")
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"fused_log_probs: logits {tuple(logits.shape)} and targets {tuple(targets.shape)}; "
            "expected (n, vocab_local) and (n,)"
        )
    tp_size = mpu.get_tensor_model_parallel_world_size()
    group = mpu.get_tensor_model_parallel_group() if tp_size > 1 else None
    vocab_local = logits.shape[-1]
    start = mpu.get_tensor_model_parallel_rank() * vocab_local
    # Columns of real tokens in this slice (a slice of padding only has none: its statistics
    # then add nothing to the other ranks').
    vocab_limit = vocab_local if vocab_size is None else max(0, min(vocab_local, vocab_size - start))
    log_probs, entropy = _FusedLogProbs.apply(
        logits.contiguous(), targets.contiguous(), temperature, vocab_limit, with_entropy, start, group
    )
    return log_probs, entropy if with_entropy else None
