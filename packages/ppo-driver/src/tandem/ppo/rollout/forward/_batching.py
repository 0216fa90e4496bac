"""How a forward-only role's samples are cut into forward passes by a token budget (pure)."""

from __future__ import annotations

from collections.abc import Sequence


def token_budget_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of `lengths`, longest first, cut into batches of at most `max_tokens` padded tokens.

    A batch's padded size is its rows times its longest sample (its first); a sample
    longer than `max_tokens` makes a batch of its own. Every index appears exactly once.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: the token budget must be at least 1")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
