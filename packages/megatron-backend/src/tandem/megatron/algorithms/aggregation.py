"""How a per-token loss (or metric) becomes one scalar of the optimizer step: four modes, one per-token form.

Every mode is written as a numerator and a count (`loss_sum_and_count`), the form
Megatron's `calculate_per_token_loss` takes from a loss function: the schedule and
the gradient finalisation add the numerators and the counts of every micro-batch of
an optimizer step and of every data-parallel rank, and divide the gradients by the
total count once. The ratio of the totals is then the exact aggregate of the whole
step, however it is cut into micro-batches and ranks.

With `ℓ_{i,t}` the loss of trainable token `t` of sample `i`, `|y_i|` its trainable
tokens, and `B` the samples with at least one trainable token:

| mode | aggregate | verl's `loss_agg_mode` |
|---|---|---|
| `sample_mean` | `(1/B) Σ_i (1/|y_i|) Σ_t ℓ_{i,t}` | `seq-mean-token-mean` |
| `token_mean` | `Σ_i Σ_t ℓ_{i,t} / Σ_i |y_i|` | `token-mean` |
| `seq_mean_token_sum` | `(1/B) Σ_i Σ_t ℓ_{i,t}` | `seq-mean-token-sum` |
| `seq_mean_token_sum_norm` | `(1/B) Σ_i Σ_t ℓ_{i,t} / L`, `L` a constant | `seq-mean-token-sum-norm` |

The last is Dr.GRPO's aggregation (Liu et al. 2025, "Understanding R1-Zero-Like
Training", §3.1 and its code's `constant_normalizer`, the generation budget): no
`1/|y_i|`, so a long response's tokens are not weighed down, and a constant divisor
so that the scale does not change with the batch's lengths. Without it Dr.GRPO is
only its advantage half (`grpo_std_normalization=False`).

Against verl (volcengine/verl b178a3c, `verl/trainer/ppo/core_algos.py` `agg_loss`,
`verl/workers/actor/dp_actor.py`): its `seq-mean-token-sum-norm` divides each
micro-batch's `Σ_i Σ_t ℓ` by `loss_scale_factor` (None: `loss_mask.shape[-1]`, the
width the micro-batch's responses are padded to) and the actor scales each micro-batch by `1 / gradient_accumulation`,
so its loss is ours times the micro-batch size per GPU; ours is the mean over samples
whatever the micro-batches. Its other modes are ours where the micro-batches of a step
hold equal numbers of samples.
"""

from __future__ import annotations

import torch

from tandem.megatron.choices import LOSS_AGGREGATIONS, LossAggregation

__all__ = [
    "LOSS_AGGREGATIONS",
    "LossAggregation",
    "aggregate_loss",
    "loss_sum_and_count",
    "metric_aggregation",
]

_PER_SAMPLE_COUNT = ("sample_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
"""The modes whose count is the samples with a trainable token."""


def _check_mode(mode: str, norm_tokens: int | None) -> None:
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(
            f"loss aggregation `mode` {mode!r} is unknown; choose one of {', '.join(LOSS_AGGREGATIONS)}"
        )
    if mode == "seq_mean_token_sum_norm" and (
        isinstance(norm_tokens, bool) or not isinstance(norm_tokens, int) or norm_tokens < 1
    ):
        raise ValueError(
            f"loss aggregation seq_mean_token_sum_norm divides each sample's token sum by a constant: "
            f"`norm_tokens` must be a positive integer (e.g. the longest response allowed), got {norm_tokens!r}"
        )


def metric_aggregation(mode: LossAggregation) -> LossAggregation:
    """The mode a per-token metric (a clip fraction, an entropy) takes beside a loss aggregated with `mode`.

    A step's metrics are divided by the loss's count, so they must share its kind of
    count; the token-sum modes count samples, and a metric summed over a sample's
    tokens would be no fraction: they take `sample_mean`, the others their own mode.
    """
    return "sample_mean" if mode in _PER_SAMPLE_COUNT else mode


def loss_sum_and_count(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: LossAggregation = "sample_mean",
    *,
    norm_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-token loss (or metric) as a numerator and a count whose ratio is its aggregate (module docstring).

    - "token_mean": numerator = Σ loss over trainable tokens; count = trainable tokens.
    - "sample_mean": numerator = Σ over samples of the sample's mean over its trainable
      tokens; count = samples with at least one trainable token. Megatron calls the
      count "tokens", but only divides by it, so a count of samples gives the mean over
      samples just as exactly.
    - "seq_mean_token_sum": numerator = Σ over samples of the sample's token sum; the
      same count of samples.
    - "seq_mean_token_sum_norm": that numerator divided by `norm_tokens`; the same count.

    Args:
        per_token_loss: shape `(batch, response_len)`; masked positions may hold anything finite.
        loss_mask: 1 (or True) for trainable tokens. Same shape.
        mode: one of `LOSS_AGGREGATIONS`.
        norm_tokens: seq_mean_token_sum_norm's constant divisor `L` (> 0); ignored by the others.

    Returns:
        `(numerator, count)`: a differentiable scalar in `per_token_loss`'s dtype,
        and an int64 scalar on its device.
    """
    _check_mode(mode, norm_tokens)
    if loss_mask.shape != per_token_loss.shape or per_token_loss.dim() != 2:
        raise ValueError(
            f"aggregate_loss: `per_token_loss` {tuple(per_token_loss.shape)} and `loss_mask` "
            f"{tuple(loss_mask.shape)} must both have shape (batch, response_len)"
        )
    mask = loss_mask.detach().to(per_token_loss.device) != 0
    # `where`, not multiplication: a non-finite value at a masked position must not leak.
    masked = torch.where(mask, per_token_loss, 0.0)
    if mode == "token_mean":
        return masked.sum(), mask.sum()
    samples = mask.any(dim=-1).sum()
    if mode == "seq_mean_token_sum":
        return masked.sum(), samples
    if mode == "seq_mean_token_sum_norm":
        assert norm_tokens is not None  # checked above
        return masked.sum() / norm_tokens, samples
    tokens_per_sample = mask.sum(dim=-1).clamp(min=1).to(per_token_loss.dtype)
    return (masked.sum(dim=-1) / tokens_per_sample).sum(), samples


def aggregate_loss(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: LossAggregation = "sample_mean",
    *,
    norm_tokens: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss (or metric) to one scalar over the trainable tokens of one batch.

    Modes (the module docstring's table):
    - "sample_mean" (default): each sample's mean over its trainable tokens,
      then the mean over samples. Every sample weighs the same, however long.
      Samples without a trainable token are left out of both sums.
    - "token_mean": the mean over all trainable tokens of the batch. Every token
      weighs the same, so long samples weigh more.
    - "seq_mean_token_sum": each sample's sum over its trainable tokens, then the mean
      over samples: a sample weighs in proportion to its length.
    - "seq_mean_token_sum_norm": the same divided by `norm_tokens` (Dr.GRPO).

    This is `numerator / count` of `loss_sum_and_count`. Under micro-batching
    and data parallelism the aggregate of the whole step is the ratio of the summed
    numerators and counts, not a mean of these per-batch figures: the train
    step hands the pairs to Megatron (`calculate_per_token_loss`).

    Args:
        per_token_loss: shape `(batch, response_len)`; masked positions may hold anything finite.
        loss_mask: 1 (or True) for trainable tokens. Same shape.
        mode: one of `LOSS_AGGREGATIONS`.
        norm_tokens: seq_mean_token_sum_norm's constant divisor (> 0).

    Returns:
        A scalar tensor with `per_token_loss`'s dtype, differentiable; 0 (still
        connected to the graph) when nothing is trainable.
    """
    total, count = loss_sum_and_count(per_token_loss, loss_mask, mode, norm_tokens=norm_tokens)
    return total / count.clamp(min=1).to(total.dtype)
