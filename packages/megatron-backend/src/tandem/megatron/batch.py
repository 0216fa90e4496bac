"""The rollout batch a train worker receives, and padding helpers for the PPO math.

One `RolloutBatch` holds the samples of one data-parallel rank. Per-token
tensors of the response (log-probs, values, loss mask) are kept as lists of
1-D tensors of each sample's response length; the PPO math works on padded
`(batch, max_response_len)` tensors with masked positions 0
(`pad_responses` / `unpad_responses`).

Alignment: position `t` of a response tensor belongs to response token `t`;
its log-prob is `log p(token_t | tokens before it)` and its value is the
critic's value of the state just before token `t` (the hidden state that
predicts token `t`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class RolloutBatch:
    """The samples of one data-parallel rank for one rollout.

    Attributes:
        tokens: prompt + response token ids of each sample, int64, shape `(prompt_len_i + response_len_i,)`.
        response_lengths: number of response tokens at the end of each sample's `tokens`.
        loss_masks: 1 for trainable response tokens, 0 for the rest, shape `(response_len_i,)`.
        rewards: one scalar reward per sample, float32, shape `(n,)`.
        sample_indices: each sample's index in the whole rollout (used to route values by sample).
        rollout_log_probs: log-probs the rollout engine reported, when it did (diagnostics only).
    """

    tokens: list[torch.Tensor]
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]
    rewards: torch.Tensor
    sample_indices: list[int] = field(default_factory=list)
    rollout_log_probs: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not self.sample_indices:
            self.sample_indices = list(range(n))
        sizes = {
            "response_lengths": len(self.response_lengths),
            "loss_masks": len(self.loss_masks),
            "rewards": int(self.rewards.numel()),
            "sample_indices": len(self.sample_indices),
        }
        bad = {k: v for k, v in sizes.items() if v != n}
        if bad:
            raise ValueError(
                f"RolloutBatch: {n} samples in `tokens` but {bad}; every field needs one entry per sample"
            )
        for i, (toks, rlen, mask) in enumerate(
            zip(self.tokens, self.response_lengths, self.loss_masks, strict=True)
        ):
            if not 0 < rlen < toks.numel():
                raise ValueError(
                    f"RolloutBatch: sample {i} has response_length {rlen} but {toks.numel()} tokens; "
                    "a sample needs at least one prompt token and one response token"
                )
            if mask.numel() != rlen:
                raise ValueError(
                    f"RolloutBatch: sample {i} has loss_mask of {mask.numel()} entries, expected {rlen}"
                )

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, indices: Sequence[int]) -> RolloutBatch:
        """A batch of the samples at `indices` (positions in this batch), in that order."""
        return RolloutBatch(
            tokens=[self.tokens[i] for i in indices],
            response_lengths=[self.response_lengths[i] for i in indices],
            loss_masks=[self.loss_masks[i] for i in indices],
            rewards=self.rewards[list(indices)],
            sample_indices=[self.sample_indices[i] for i in indices],
            rollout_log_probs=None
            if self.rollout_log_probs is None
            else [self.rollout_log_probs[i] for i in indices],
        )


def pad_responses(per_sample: Sequence[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
    """Stack 1-D per-sample tensors into `(batch, max_len)`, right-padded with `fill`."""
    return torch.nn.utils.rnn.pad_sequence(list(per_sample), batch_first=True, padding_value=fill)


def unpad_responses(padded: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of `pad_responses`: row `i` cut to `lengths[i]`."""
    return [padded[i, :n] for i, n in enumerate(lengths)]
