"""Batched sampling on the engine's device: temperature, top-k, top-p, a seeded generator, no host sync."""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return the tokens and their log-probs under the temperature.

    Shape: logits `(rows, vocab)` fp32 -> tokens `(rows,)` int64, log-probs `(rows,)` fp32.
    Temperature 0 is greedy (argmax, log-probs under temperature 1). Top-k and top-p
    restrict the draw, not the reported log-prob (`log softmax(logits / T)[token]`,
    as the `Generation` contract says). The draw is the exponential race
    (`argmax p / E`, E ~ Exp(1)), equivalent to a categorical draw and free of the
    host syncs that `torch.multinomial` may need.
    """
    if temperature <= 0.0:
        tokens = logits.argmax(dim=-1)
        log_probs = torch.log_softmax(logits, dim=-1)
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    filtered = scaled
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(filtered, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first one always stays).
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(filtered, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=1e-20)
    tokens = (probs / race).argmax(dim=-1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)
