"""What one rank receives from the other role: the critic's values and the actor's log-probs, unpacked.

`TrainGroup.train` routes the other role's payloads to each rank (by rank, or by
sample when the layouts differ; `payloads`); here a rank checks that what it got
is for its own samples and turns it into padded `(n, max_response_len)` tensors.
A rank that refuses its payload tells the others (`any_rank`), so that every rank
of the group stops alike instead of hanging in a collective.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.megatron.batch import RolloutBatch, pad_responses
from tandem.megatron.payloads import ActorLogProbs, CriticValues
from tandem.value_transfer import unpack_values

__all__ = ["any_rank", "critic_values", "log_probs_for", "raise_if"]


def any_rank(flags: list[bool], group: Any) -> list[bool]:
    """Whether each flag holds on any rank of `group` (one tiny all-reduce; every rank must call)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    vector = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
    torch.distributed.all_reduce(vector, op=torch.distributed.ReduceOp.MAX, group=group)
    return [bool(v > 0) for v in vector.tolist()]


def raise_if(failed: bool, error: Exception | None) -> None:
    """Raise this rank's error, or, when only another rank failed, say so (every rank stops alike)."""
    if error is not None:
        raise error
    if failed:
        raise ValueError("payload: another rank of this group refused its payload; see that rank's error")


def unpack(payload: Any, batch: RolloutBatch, device: torch.device, what: str) -> torch.Tensor:
    """A Box or `SampleGather` of per-sample tensors for this rank's samples, padded `(n, max_response_len)`."""

    tensors = unpack_values(payload, device, sample_indices=batch.sample_indices)
    lengths = [int(t.numel()) for t in tensors]
    if lengths != list(batch.response_lengths):
        raise ValueError(
            f"{what}: per-sample lengths {lengths[:8]} do not match this rank's response "
            f"lengths {list(batch.response_lengths)[:8]}; the payload was made for other samples"
        )
    return pad_responses(tensors)


def log_probs_for(
    log_probs: ActorLogProbs | None, batch: RolloutBatch, *, rank: int, reference: bool = False
) -> torch.Tensor | None:
    """The actor's log-probs (`reference`: its reference log-probs) for this rank's samples, padded; None when absent."""
    if log_probs is None:
        return None
    if not isinstance(log_probs, ActorLogProbs):
        raise TypeError(
            f"log_probs: expected the actor's ActorLogProbs (compute_log_probs), got {type(log_probs).__name__}"
        )
    name = "ref_log_probs" if reference else "log_probs"
    payload = log_probs.ref_log_probs if reference else log_probs.log_probs
    if payload is None:
        return None
    if tuple(log_probs.sample_indices) != tuple(batch.sample_indices):
        raise ValueError(
            f"log_probs: rank {rank} got {name!r} of samples {list(log_probs.sample_indices)[:8]} but holds "
            f"samples {list(batch.sample_indices)[:8]}; route it with TrainGroup.train(..., sample_indices=...)"
        )
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return unpack(payload, batch, device or torch.device("cpu"), name)


def critic_values(
    critic: CriticValues | None, batch: RolloutBatch, *, rank: int, device: torch.device
) -> torch.Tensor:
    """The critic's old values for this last-stage rank's samples, padded; zeros when the run has no critic.

    `TrainGroup.train` checks that every last-stage rank of an actor given the
    critic's results gets its values, so None here means: no critic.
    """
    if critic is None:
        return torch.zeros(len(batch), batch.max_response_length, device=device)
    if not isinstance(critic, CriticValues):
        raise TypeError(
            f"critic: expected the critic's CriticValues (TrainResult.values), got {type(critic).__name__}"
        )
    if tuple(critic.sample_indices) != tuple(batch.sample_indices):
        raise ValueError(
            f"critic: actor rank {rank} got the critic's values of samples {list(critic.sample_indices)[:8]} but "
            f"holds samples {list(batch.sample_indices)[:8]}; with another critic layout pass "
            "TrainGroup.train(..., sample_indices=...) so that values are routed by sample"
        )
    return unpack(critic.values, batch, device, "values")
