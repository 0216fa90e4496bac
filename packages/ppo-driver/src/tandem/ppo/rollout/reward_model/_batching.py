"""Where a sample's score is read (pure); the forward passes' token budget is the forward-only roles' own."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.ppo.rollout.forward._batching import token_budget_batches

__all__ = ["score_position", "token_budget_batches"]


def score_position(ids: Sequence[int], pad_token_id: int | None) -> int:
    """The position whose head output is the sample's score, by transformers' rule.

    `AutoModelForSequenceClassification` reads the rightmost token that is not
    `pad_token_id` (so a trailing EOS is skipped when pad = EOS, whichever side the
    batch is padded on), position 0 when every token is the pad id, and the last
    token when the model has no pad id.
    """
    if pad_token_id is not None:
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] != pad_token_id:
                return i
        return 0
    return len(ids) - 1
