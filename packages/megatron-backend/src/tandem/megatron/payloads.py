"""The typed records that cross between the driver and the train workers, and their routing to ranks.

Three records cross the seam in a PPO step:

- `TrainResult`: one rank's result of `train` (its metrics, its allocator
  calls; on the critic's pipeline-last-stage ranks its old values as a
  `CriticValues`);
- `CriticValues`: critic → actor, one rank's old values as a `Box` (or, routed
  by sample, a `SampleGather`) and the samples they belong to;
- `ActorLogProbs`: actor → critic, and back to the actor itself (the KL-first
  plan): the actor's old and reference log-probs of one rank's samples
  (`TrainWorker.compute_log_probs` on its last-stage ranks).

`TrainGroup.train(..., critic=..., log_probs=...)` takes them as named
arguments, and `route_payloads` gives each receiving rank its record. When the
two roles have the same layout (TP, PP, DP), record `r` belongs to rank `r`
(`route_per_rank`). When they do not (a critic with its own topology), the
Boxes are routed by sample (`route_by_sample`): every rank gets, for each of its
samples in its order, exactly that sample's tensor, in a record that names the
receiving rank's own samples.

Torch-free: the driver side (`group`) imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from tandem.value_transfer import Box, SampleGather

__all__ = [
    "ActorLogProbs",
    "CriticValues",
    "PerSampleTensors",
    "TrainResult",
    "critic_payloads",
    "per_rank_sample_indices",
    "route_payloads",
]

type PerSampleTensors = Box | SampleGather
"""One float tensor per sample, of shape `(response_length,)` each, in the record's sample order: a
`Box` (`value_transfer.pack_values`, one object in Ray's store), or once routed by sample a
`SampleGather` of parts of several Boxes (`value_transfer.route_by_sample`); `unpack_values` gives
the tensors back on a device."""


@dataclass(frozen=True)
class CriticValues:
    """The critic's old values of one rank's samples, for the actor's advantages.

    Attributes:
        values: the old values, one tensor per sample, shape `(response_length,)`.
        sample_indices: the samples of `values`, in their order.
    """

    values: PerSampleTensors
    sample_indices: tuple[int, ...]

    BOXES: ClassVar[tuple[str, ...]] = ("values",)
    """The fields that hold per-sample tensors (what `route_payloads` moves by sample)."""


@dataclass(frozen=True)
class ActorLogProbs:
    """The actor's old and reference log-probs of one rank's samples (the KL-first plan).

    Attributes:
        log_probs: the old log-probs, one tensor per sample, shape `(response_length,)`.
        ref_log_probs: the same under the reference weights; None when the actor keeps none.
        sample_indices: the samples of both, in their order.
    """

    log_probs: PerSampleTensors
    ref_log_probs: PerSampleTensors | None
    sample_indices: tuple[int, ...]

    BOXES: ClassVar[tuple[str, ...]] = ("log_probs", "ref_log_probs")
    """The fields that hold per-sample tensors (what `route_payloads` moves by sample)."""


@dataclass(frozen=True)
class TrainResult:
    """One rank's result of `train`.

    Attributes:
        metrics: the role's metrics of the rollout, the same on every rank.
        allocator: the CUDA allocator calls this rank made during the train
            (`alloc/device_mallocs`, `alloc/device_frees`; empty on CPU), not reduced.
        values: the critic's old values on its pipeline-last-stage ranks; None
            elsewhere and for the actor.
        step_moves: the seconds this rank's wakes and sleeps of the tags kept asleep through the passes
            took, around its optimizer steps (`step_wake_s`, `step_sleep_s`; `TrainWorker.keep_asleep_for_passes`),
            and the GiB they moved, both ways (`step_moved_gib`), not reduced; empty without such tags.
        train_time: this rank's seconds of the train by part (`worker.train_clock`: the forward passes of
            their own, the update's passes, the optimizer steps, `other` and `total`; beside them `call`, the
            worker's whole `train` method), not reduced.
    """

    metrics: dict[str, float]
    allocator: dict[str, float] = field(default_factory=dict)
    values: CriticValues | None = None
    step_moves: dict[str, float] = field(default_factory=dict)
    train_time: dict[str, float] = field(default_factory=dict)


type Payload = CriticValues | ActorLogProbs


def critic_payloads(
    critic: Sequence[TrainResult | CriticValues | None] | TrainResult | CriticValues | None,
) -> list[CriticValues | None] | CriticValues | None:
    """The critic's values as `CriticValues` per rank, from its `TrainResult`s (or the records themselves)."""
    if critic is None or isinstance(critic, CriticValues):
        return critic
    if isinstance(critic, TrainResult):
        return critic.values
    return [c.values if isinstance(c, TrainResult) else c for c in critic]


def per_rank_sample_indices(
    sample_indices: Sequence[Sequence[int]], world_size: int, layout: tuple[int, int] | None
) -> list[tuple[int, ...]]:
    """Each rank's sample indices, from one list per rank or (with `layout` = (TP, PP)) one per data-parallel rank.

    Megatron orders ranks tensor-parallel first, then data-parallel, then
    pipeline stages (its default "tp-cp-ep-dp-pp"), so rank `r` is in
    data-parallel rank `(r // TP) % DP`.
    """
    if isinstance(sample_indices, str | bytes) or not isinstance(sample_indices, Sequence):
        raise TypeError(
            f"sample_indices: expected a list of lists of ints, got {type(sample_indices).__name__}"
        )
    lists = [tuple(int(i) for i in rank) for rank in sample_indices]
    if len(lists) == world_size:
        return lists
    if layout is not None:
        tp, pp = layout
        dp = world_size // (tp * pp)
        if len(lists) == dp:
            return [lists[(r // tp) % dp] for r in range(world_size)]
    raise ValueError(
        f"sample_indices: got {len(lists)} lists for a group of {world_size} ranks; give one list per rank "
        "(each rank's samples in its batch's order) or one per data-parallel rank"
    )


def last_stage_ranks(world_size: int, layout: tuple[int, int] | None) -> list[int] | None:
    """The ranks on the pipeline-last stage (Megatron's rank order), or None when `layout` is unknown."""
    if layout is None:
        return None
    tp, pp = layout
    per_stage = world_size // pp
    return list(range(world_size - per_stage, world_size)) if tp * pp <= world_size else None


def route_payloads[P: Payload](
    name: str,
    records: Sequence[P | None] | P | None,
    world_size: int,
    *,
    sample_indices: Sequence[Sequence[int]] | None = None,
    layout: tuple[int, int] | None = None,
) -> list[P | None]:
    """One record per rank of the receiving group, from the other role's per-rank records.

    `name`: the argument they came in (`critic`, `log_probs`), for the errors.
    Without `sample_indices`: `route_per_rank` (record `r` to rank `r`, or one
    record to every rank). With them (the receiving group's samples, per rank or
    per data-parallel rank): when every record `r` names exactly rank `r`'s
    samples, the same; otherwise each of the record's Boxes is routed by sample
    (`route_by_sample`: a `SampleGather` per rank), tensor-parallel peers that
    return the same samples counting once. Nothing is lost or duplicated; a
    sample that no record holds, or that no rank owns, is a ValueError naming it.
    """
    from tandem.value_transfer import (  # Ray and torch: the seam imports neither
        IndexedValues,
        route_by_sample,
        route_per_rank,
    )

    routed: list[P | None] = route_per_rank(records, world_size)
    if sample_indices is None or records is None:
        return routed
    if not all(p is None or isinstance(p, CriticValues | ActorLogProbs) for p in routed):
        raise TypeError(
            f"{name}: routing by sample needs the records with their samples (CriticValues or "
            "ActorLogProbs), not bare Boxes; pass the other role's results as they came back"
        )
    own = per_rank_sample_indices(sample_indices, world_size, layout)
    if all(p is not None and p.sample_indices == own[r] for r, p in enumerate(routed)):
        return routed  # they line up rank by rank
    template = next((p for p in routed if p is not None), None)
    if template is None:
        return routed
    distinct = list(dict.fromkeys(own))  # one entry per data-parallel rank, in order
    fields: dict[str, Sequence[SampleGather | None]] = {}
    for key in template.BOXES:
        sources: dict[tuple[int, ...], IndexedValues] = {}
        for p in routed:
            if p is None or getattr(p, key) is None:
                continue
            # Tensor-parallel peers of the last stage return the same samples: one source.
            sources.setdefault(
                p.sample_indices, IndexedValues(values=getattr(p, key), sample_indices=p.sample_indices)
            )
        if sources:
            fields[key] = route_by_sample(
                list(sources.values()), distinct, actor_dp_ranks=[distinct.index(i) for i in own]
            )
        else:
            fields[key] = [None for _ in range(world_size)]
    # Each routed record: the template with the receiving rank's samples and its part of each field.
    replace: Callable[..., P] = dataclasses.replace
    return [
        replace(template, sample_indices=own[r], **{k: v[r] for k, v in fields.items()})
        for r in range(world_size)
    ]
