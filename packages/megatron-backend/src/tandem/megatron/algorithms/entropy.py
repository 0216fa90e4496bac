"""Entropy of the policy's next-token distribution, for the entropy bonus and its diagnostic.

One form serves both the full vocabulary (`entropy_from_logits`) and the
training path, where each tensor-parallel rank holds a slice of it
(`response_outputs.vocab_parallel_log_probs` passes its cross-rank sum): with the
logits shifted by their maximum, `s = l − max l ≤ 0`,

    H = log Σ_v e^{s_v} − Σ_v p_v s_v,

two non-negative terms (`log Σ e^s ≥ 0` since one `s` is 0; `−Σ p s ≥ 0`), so
nothing cancels, however large or peaked the logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["entropy_from_logits", "entropy_of_shifted"]


def entropy_of_shifted(
    shifted: torch.Tensor,
    exp_shifted: torch.Tensor,
    sum_exp: torch.Tensor,
    vocab_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """`H = log Σ e^s − Σ p s` from max-shifted logits and their exponentials (see the module docstring).

    Args:
        shifted: `logits − max` over the whole vocabulary (this rank's slice of it). Shape `(..., vocab)`.
        exp_shifted: `shifted.exp()`, passed in because the caller has it already. Same shape.
        sum_exp: `Σ e^s` over the whole vocabulary. Shape `(...)`.
        vocab_sum: completes a sum over this slice of the vocabulary into the
            sum over all of it (an all-reduce over tensor-parallel ranks); None
            when the slice is the whole vocabulary.

    Returns:
        Entropy in nats, differentiable. Shape `(...)`.
    """
    partial_sum = (exp_shifted * shifted).sum(dim=-1)
    expected_shifted = (partial_sum if vocab_sum is None else vocab_sum(partial_sum)) / sum_exp
    return sum_exp.log() - expected_shifted


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy `H = −Σ_v p_v log p_v` of `softmax(logits)` over the last dimension.

    Computed in the shifted form of the module docstring, which loses no
    precision for large or peaked logits. Differentiable. Computed in the
    logits' dtype: pass float32 logits for an accurate value.

    Logits must be finite: a `−inf` logit gives `0 · −inf = NaN`. To exclude
    vocabulary entries, fill them with `torch.finfo(dtype).min` instead.

    The whole vocabulary must be in `logits`; for vocabulary-parallel (TP)
    logits use `entropy_of_shifted` with a `vocab_sum` over the ranks.

    Args:
        logits: unnormalised scores (already divided by the sampling temperature,
            if the entropy of the sampling distribution is wanted). Shape `(..., vocab)`.

    Returns:
        Entropy in nats. Shape `(...)`.
    """
    if logits.dim() == 0:
        raise ValueError("entropy_from_logits: `logits` must have a vocabulary dimension, got a scalar")
    # A shift for stability only: no gradient flows through it.
    shifted = logits - logits.detach().max(dim=-1, keepdim=True).values
    exp_shifted = shifted.exp()
    return entropy_of_shifted(shifted, exp_shifted, exp_shifted.sum(dim=-1))
