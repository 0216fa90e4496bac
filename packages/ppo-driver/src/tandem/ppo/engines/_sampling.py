"""Batched sampling on the engine's device: temperature, top-k, top-p, a seeded generator, no host sync."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


@dataclass
class Draws:
    """One generate's random source: the generator of `sample` and the fused sampler's per-step seeds.

    The fused sampler (`DecodeOps.sample`) draws with Philox keyed by a device tensor; the
    decode loop sets it to `next_seed()` before each step, so a step's draw depends only
    on the generate's seed and the step's index.
    """

    generator: torch.Generator
    base_seed: int
    steps: int = 0

    @classmethod
    def from_seed(cls, seed: int, device: torch.device) -> Draws:
        """The draws of a generate with `seed`: the generator seeded with it, Philox keys from its hash."""
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        return cls(generator, _splitmix62(seed))

    def next_seed(self) -> int:
        """The Philox seed of the next sampling step (consecutive: rows are spread 2**40 apart)."""
        self.steps += 1
        return self.base_seed + self.steps


def restricts_draw(*, temperature: float, top_k: int, top_p: float, vocab: int) -> bool:
    """True when top-k or top-p restricts the draw (the fused sampler draws from the whole vocabulary)."""
    return temperature > 0.0 and (0 < top_k < vocab or top_p < 1.0)


def _splitmix62(seed: int) -> int:
    """SplitMix64's output for `seed`, in [0, 2**62): neighbouring seeds get unrelated Philox keys."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 2


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
    host syncs that `torch.multinomial` may need. The fused decode's sampler
    (`DecodeOps.sample`) keeps this contract without top-k / top-p, with Gumbel noise
    from Philox instead; with them, the engine calls this function on its logits.
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
