"""DAPO's soft overlong punishment: a reward penalty that grows over the last tokens a response may use.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale" (arXiv:2503.14476), eq. 13, with `L_max` the most tokens a response may
have and `L_cache` the buffer before it:

    R_length(y) = 0                                   if |y| ≤ L_max − L_cache
                = ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| ≤ L_max
                = −1                                  if L_max < |y|

added to the task reward, times a penalty factor (1 in the paper; verl's
`overlong_penalty_factor`). A response cut at `L_max` pays the full factor; one
that ends inside the buffer pays in proportion to how far into it it ran.
"""

from __future__ import annotations

import math

import torch

__all__ = ["overlong_penalty"]


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """`penalty_factor · R_length(|y|)` per response: 0 before the buffer, down to `−penalty_factor` at `L_max`.

    Args:
        response_lengths: tokens of each response, `|y|`. Shape `(batch,)`, integers.
        max_response_len: `L_max`, the engine's cap on a response (`rollout_max_response_len`).
        buffer_len: `L_cache` in `[1, max_response_len]`.
        penalty_factor: finite, >= 0; the penalty at and beyond `L_max`.

    Returns:
        Shape `(batch,)`, float32, each in `[−penalty_factor, 0]`.
    """
    if isinstance(max_response_len, bool) or not isinstance(max_response_len, int) or max_response_len < 1:
        raise ValueError(
            f"overlong_penalty: `max_response_len` must be a positive integer, got {max_response_len!r}"
        )
    if (
        isinstance(buffer_len, bool)
        or not isinstance(buffer_len, int)
        or not 1 <= buffer_len <= max_response_len
    ):
        raise ValueError(
            f"overlong_penalty: `buffer_len` must be an integer in [1, max_response_len = {max_response_len}], "
            f"got {buffer_len!r}"
        )
    if not (math.isfinite(penalty_factor) and penalty_factor >= 0):
        raise ValueError(
            f"overlong_penalty: `penalty_factor` must be a finite number >= 0, got {penalty_factor}"
        )
    lengths = response_lengths.detach().to(torch.float64)
    expected = max_response_len - buffer_len
    into_buffer = ((lengths - expected) / buffer_len).clamp(min=0.0, max=1.0)
    return (-penalty_factor * into_buffer).to(torch.float32)
