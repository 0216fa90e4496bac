"""Entropy of the policy's next-token distribution, for the entropy bonus and its diagnostic."""

from __future__ import annotations

import torch

__all__ = ["entropy_from_logits"]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy `H = −Σ_v p_v log p_v` of `softmax(logits)` over the last dimension.

    Computed from `log_softmax`, which subtracts the row maximum first, so large
    or peaked logits lose no precision (the form `logsumexp(l) − Σ p l` would
    cancel two numbers of the size of the logits). Differentiable. Computed in
    the logits' dtype: pass float32 logits for an accurate value.

    Logits must be finite: a `−inf` logit gives `0 · −inf = NaN`. To exclude
    vocabulary entries, fill them with `torch.finfo(dtype).min` instead.

    The whole vocabulary must be in `logits`: with vocabulary-parallel (TP)
    logits, each shard holds only part of the sum and this is not the entropy.

    Args:
        logits: unnormalised scores (already divided by the sampling temperature,
            if the entropy of the sampling distribution is wanted). Shape `(..., vocab)`.

    Returns:
        Entropy in nats. Shape `(...)`.
    """
    if logits.dim() == 0:
        raise ValueError("entropy_from_logits: `logits` must have a vocabulary dimension, got a scalar")
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)
