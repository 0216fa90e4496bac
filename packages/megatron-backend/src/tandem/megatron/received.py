"""What one rank receives from the other role: the critic's values and the actor's log-probs, unpacked.

`TrainGroup.train` routes the other role's payloads to each rank (by rank, or by
sample when the layouts differ; `payloads`); here a rank checks that what it got
is for its own samples and turns it into padded `(n, max_response_len)` tensors.
A rank that refuses its payload tells the others (`any_rank`), so that every rank
of the group stops alike instead of hanging in a collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tandem.megatron.batch import RolloutBatch, pad_responses
from tandem.megatron.payloads import ACTOR_SAMPLE_INDICES, CRITIC_SAMPLE_INDICES, VALUES

__all__ = ["any_rank", "critic_values", "external", "raise_if"]


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
        raise ValueError(
            "external_data: another rank of this group refused its payload; see that rank's error"
        )


def unpack(payload: Any, batch: RolloutBatch, device: torch.device, what: str) -> torch.Tensor:
    """A Box or `SampleGather` of per-sample tensors for this rank's samples, padded `(n, max_response_len)`."""
    from tandem.value_transfer import unpack_values

    tensors = unpack_values(payload, device, sample_indices=batch.sample_indices)
    lengths = [int(t.numel()) for t in tensors]
    if lengths != list(batch.response_lengths):
        raise ValueError(
            f"external_data[{what!r}]: per-sample lengths {lengths[:8]} do not match this rank's response "
            f"lengths {list(batch.response_lengths)[:8]}; the payload was made for other samples"
        )
    return pad_responses(tensors)


def external(external_data: Any, key: str, batch: RolloutBatch, *, rank: int) -> torch.Tensor | None:
    """`external_data[key]` (the actor's log-probs) for this rank's samples, padded; None when absent."""
    if not isinstance(external_data, Mapping) or external_data.get(key) is None:
        return None
    indices = external_data.get(ACTOR_SAMPLE_INDICES)
    if indices is not None and tuple(indices) != tuple(batch.sample_indices):
        raise ValueError(
            f"external_data: rank {rank} got {key!r} of samples {list(indices)[:8]} but holds samples "
            f"{list(batch.sample_indices)[:8]}; route it with TrainGroup.train(..., sample_indices=...)"
        )
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return unpack(external_data[key], batch, device or torch.device("cpu"), key)


def critic_values(
    external_data: Any, batch: RolloutBatch, *, rank: int, device: torch.device
) -> torch.Tensor:
    """The critic's old values for this last-stage rank's samples, padded; zeros when the run has no critic."""
    from tandem.value_transfer import values_for_rank

    payload = external_data.get(VALUES) if isinstance(external_data, Mapping) else external_data
    # No critic: the payload is None, or holds only the actor's own log-probs (the KL-first plan).
    # A critic's result without values (a rank off the last stage) is a routing bug: values_for_rank says so.
    no_critic = external_data is None or (
        isinstance(external_data, Mapping) and VALUES not in external_data and "metrics" not in external_data
    )
    if no_critic:
        return torch.zeros(len(batch), batch.max_response_length, device=device)
    indices = external_data.get(CRITIC_SAMPLE_INDICES) if isinstance(external_data, Mapping) else None
    if indices is not None and tuple(indices) != tuple(batch.sample_indices):
        raise ValueError(
            f"external_data: actor rank {rank} got the critic's values of samples {list(indices)[:8]} but "
            f"holds samples {list(batch.sample_indices)[:8]}; with another critic layout pass "
            "TrainGroup.train(..., sample_indices=...) so that values are routed by sample"
        )
    # Raises, naming the rank, when a last-stage rank got no values.
    payload = values_for_rank(payload, rank=rank, is_pipeline_last_stage=True)
    assert payload is not None
    return unpack(payload, batch, device, VALUES)
