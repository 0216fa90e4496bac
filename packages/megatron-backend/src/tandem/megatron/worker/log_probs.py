"""Log-probs and entropies over a vocabulary-parallel slice of logits, a chunk of rows at a time.

`response_outputs.vocab_parallel_log_probs` computes the same values through plain autograd,
which keeps several fp32 tensors the size of the response logits alive for the
backward pass (the scaled logits, their shifted form, its exponentials): on a
151,936-token vocabulary and a micro-batch of 35k response tokens each is ~20 GB.
`chunked_log_probs` is one `torch.autograd.Function` that walks the rows in chunks
of `chunk_tokens`, casting each chunk to fp32 only while it works on it, and saves
for the backward pass the logits as they came (in the model's dtype), the targets
and three fp32 numbers per row (the shift, `log Z` and `E[s]`, the entropy's second
term). The backward pass recomputes each chunk's probabilities from them and writes
the chunk's rows of the gradient, so the only tensors of the whole micro-batch's size
are the logits and their gradient, both in the logits' dtype.

With `x = z / T` the scaled logits of a row, `s = x − max x` (the max over the whole
vocabulary, all-reduced MAX over the tensor-parallel ranks), `Z = Σ e^s` (all-reduced
SUM) and `p = e^s / Z`:

    log p_t = s_t − log Z,   H = log Z − Σ_j p_j s_j   (`algorithms.entropy`),
    ∂/∂x_j:  g_lp · (1[j = t] − p_j) + g_H · (−p_j (log p_j + H)),

and `∂/∂z = ∂/∂x / T`. Each rank returns the gradient of its own slice only, as
Megatron's `reduce_from_tensor_model_parallel_region` (identity backward) does for
`vocab_parallel_log_probs`: the outputs, and so their upstream gradients, are the
same on every rank. The forward pass runs the reference's operations in its order,
row by row, so its values are the reference's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["chunked_log_probs"]


def _scaled(chunk: torch.Tensor, temperature: float, padding: torch.Tensor | None) -> torch.Tensor:
    """`chunk` in fp32 divided by `temperature`, padding columns at fp32's finite floor (as the reference)."""
    scaled = chunk.float() / temperature
    if padding is not None:
        # The finite floor, not -inf: exp gives exactly 0, and 0 * floor stays 0 in the entropy.
        scaled = scaled.masked_fill(padding, torch.finfo(scaled.dtype).min)
    return scaled


class _ChunkedLogProbs(torch.autograd.Function):
    """Log-probs (and entropies) of one TP rank's logits slice, chunk by chunk; see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        vocab_size: int | None,
        with_entropy: bool,
        chunk_tokens: int,
        start: int,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, vocab_local = logits.shape
        padding = None
        if vocab_size is not None and start + vocab_local > vocab_size:
            padding = torch.arange(start, start + vocab_local, device=logits.device) >= vocab_size
        in_slice = (targets >= start) & (targets < start + vocab_local)
        local_target = (targets - start).clamp(0, vocab_local - 1)
        shift = torch.empty(n, dtype=torch.float32, device=logits.device)
        log_z = torch.empty_like(shift)
        log_probs = torch.empty_like(shift)
        entropy = torch.empty_like(shift) if with_entropy else shift.new_empty(0)
        expected = torch.empty_like(entropy)
        for begin in range(0, n, chunk_tokens):
            rows = slice(begin, min(begin + chunk_tokens, n))
            scaled = _scaled(logits[rows], temperature, padding)
            chunk_shift = scaled.max(dim=-1).values
            if group is not None:
                dist.all_reduce(chunk_shift, op=dist.ReduceOp.MAX, group=group)
            shifted = scaled - chunk_shift.unsqueeze(-1)
            del scaled
            exp = shifted.exp()
            picked = shifted.gather(-1, local_target[rows].unsqueeze(-1)).squeeze(-1) * in_slice[rows]
            sums = [exp.sum(dim=-1), picked]
            if with_entropy:
                sums.append((exp * shifted).sum(dim=-1))
            del exp, shifted
            # One all-reduce for the chunk's sums: elementwise, so each is the sum a reduce of its own gives.
            reduced = torch.stack(sums)
            if group is not None:
                dist.all_reduce(reduced, group=group)
            sum_exp = reduced[0]
            chunk_log_z = sum_exp.log()
            shift[rows] = chunk_shift
            log_z[rows] = chunk_log_z
            log_probs[rows] = reduced[1] - chunk_log_z
            if with_entropy:
                expected[rows] = reduced[2] / sum_exp
                entropy[rows] = chunk_log_z - expected[rows]
        ctx.save_for_backward(logits, local_target, in_slice, shift, log_z, expected)
        ctx.temperature, ctx.chunk_tokens, ctx.padding = temperature, chunk_tokens, padding
        ctx.with_entropy = with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        logits, local_target, in_slice, shift, log_z, expected = ctx.saved_tensors
        nothing = (None,) * 7
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_log_probs is None and grad_entropy is None:
            return (None, *nothing)
        n = logits.shape[0]
        grad = torch.empty_like(logits)
        for begin in range(0, n, ctx.chunk_tokens):
            rows = slice(begin, min(begin + ctx.chunk_tokens, n))
            shifted = _scaled(logits[rows], ctx.temperature, ctx.padding) - shift[rows].unsqueeze(-1)
            chunk_log_z = log_z[rows].unsqueeze(-1)
            # log p = s - log Z; the gradient is -p * (g_lp + g_H (log p + H)), plus g_lp at the target.
            if grad_entropy is None:
                assert grad_log_probs is not None
                weight = grad_log_probs[rows].unsqueeze(-1).expand_as(shifted)
            else:
                # log p + H = s - E[s], one subtraction: exact where s = 0, the likeliest token.
                weight = grad_entropy[rows].unsqueeze(-1) * (shifted - expected[rows].unsqueeze(-1))
                if grad_log_probs is not None:
                    weight = weight + grad_log_probs[rows].unsqueeze(-1)
            chunk_grad = -(shifted - chunk_log_z).exp() * weight
            del shifted, weight
            if grad_log_probs is not None:
                at_target = grad_log_probs[rows] * in_slice[rows]
                chunk_grad.scatter_add_(-1, local_target[rows].unsqueeze(-1), at_target.unsqueeze(-1))
            if ctx.padding is not None:
                # The reference's masked_fill passes no gradient to the padding columns.
                chunk_grad.masked_fill_(ctx.padding, 0.0)
            grad[rows] = chunk_grad / ctx.temperature
        return (grad, *nothing)


def chunked_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    vocab_size: int | None = None,
    chunk_tokens: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` (and entropies) under `softmax(logits / temperature)`, `chunk_tokens` rows at a time.

    The values of `response_outputs.vocab_parallel_log_probs(logits.float() / temperature, ...)`,
    without its fp32 copies of the whole `logits` (module docstring).

    Args:
        logits: this TP rank's vocabulary slice, `(n, padded_vocab / tp)`, in the model's
            dtype (bf16 or fp32): each chunk is cast to fp32 on its own.
        targets: `(n,)` global token ids.
        temperature: the sampling temperature (positive); logits are divided by it.
        with_entropy: also return each row's entropy; else None.
        vocab_size: the tokenizer's vocabulary; the padding columns past it are left out
            of the softmax. None: every column is a token.
        chunk_tokens: rows processed at once (at least 1).

    Returns:
        `(log_probs, entropy)`, fp32 `(n,)` tensors (entropy None unless asked),
        differentiable with respect to `logits`; the gradient comes back in its dtype.
    """
    from megatron.core import parallel_state as mpu

    if chunk_tokens < 1:
        raise ValueError(f"chunked_log_probs: chunk_tokens is {chunk_tokens}; it must be at least 1")
    if temperature <= 0:
        raise ValueError(f"chunked_log_probs: temperature is {temperature}; it must be positive")
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"chunked_log_probs: logits {tuple(logits.shape)} and targets {tuple(targets.shape)}; "
            "expected (n, vocab_local) and (n,)"
        )
    tp_size = mpu.get_tensor_model_parallel_world_size()
    group = mpu.get_tensor_model_parallel_group() if tp_size > 1 else None
    start = mpu.get_tensor_model_parallel_rank() * logits.shape[-1]
    log_probs, entropy = _ChunkedLogProbs.apply(
        logits, targets, temperature, vocab_size, with_entropy, chunk_tokens, start, group
    )
    return log_probs, entropy if with_entropy else None
