"""The payloads that cross from one role to the other, and their routing to the receiving group's ranks.

Two payloads cross between the roles in a PPO step, both as per-rank dicts of
`Box`es (tandem.value_transfer's `pack_values`, one tensor per sample):

- critic → actor: `TrainWorker.train`'s result on the critic's pipeline-last-stage
  ranks, `{"metrics", "values", "critic_sample_indices"}`;
- actor → critic, and back to the actor itself (the KL-first plan): the actor's
  `TrainWorker.compute_log_probs` on its last-stage ranks,
  `{"log_probs", "ref_log_probs", "actor_sample_indices"}`.

Each payload names its samples under a key of its own role, so that the driver
may merge the two dicts of rank `r` (`{**critic_out[r], **log_probs_out[r]}`)
without losing either list. When the two roles have the same layout (TP, PP,
DP), payload `r` belongs to rank `r` (`route_per_rank`). When they do not (a
critic with its own topology), the receiving group routes the other role's
Boxes by sample (`route_by_sample`): every rank gets, for each of its samples in
its order, exactly that sample's tensor. The receiving role's own Boxes (the
actor's log-probs in the actor's merged dict) always stay with their rank.

Torch-free: the driver side (`group`) imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.megatron.choices import Role, check_role

__all__ = [
    "ACTOR_SAMPLE_INDICES",
    "CRITIC_SAMPLE_INDICES",
    "LOG_PROBS",
    "REF_LOG_PROBS",
    "VALUES",
    "per_rank_sample_indices",
    "route_payloads",
]

LOG_PROBS, REF_LOG_PROBS, VALUES = "log_probs", "ref_log_probs", "values"
"""The keys of the Boxes in the payloads."""
ACTOR_SAMPLE_INDICES, CRITIC_SAMPLE_INDICES = "actor_sample_indices", "critic_sample_indices"
"""The keys under which a payload names the samples of its Boxes, in their order."""

_FOREIGN: dict[str, tuple[tuple[str, ...], str]] = {
    "actor": ((VALUES,), CRITIC_SAMPLE_INDICES),
    "critic": ((LOG_PROBS, REF_LOG_PROBS), ACTOR_SAMPLE_INDICES),
}
"""For each receiving role: the keys that come from the other role, and the key of their samples."""


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


def route_payloads(
    role: Role,
    external_data: Any,
    world_size: int,
    *,
    sample_indices: Sequence[Sequence[int]] | None = None,
    layout: tuple[int, int] | None = None,
) -> list[Any]:
    """One payload per rank of the receiving `role`'s group, from the other role's per-rank payloads.

    Without `sample_indices`: `route_per_rank` (payload `r` to rank `r`, or one
    payload to every rank). With them (this group's samples, per rank or per
    data-parallel rank): when every payload `r` names exactly rank `r`'s samples,
    the same; otherwise each of the other role's Boxes is routed by sample
    (`route_by_sample`: a `SampleGather` per rank), tensor-parallel peers that
    return the same samples counting once. Nothing is lost or duplicated; a
    sample that no payload holds, or that no rank owns, is a ValueError naming it.
    """
    from tandem.value_transfer import IndexedValues, route_by_sample, route_per_rank

    check_role(role)
    payloads = route_per_rank(external_data, world_size)
    if sample_indices is None or external_data is None:
        return payloads
    own = per_rank_sample_indices(sample_indices, world_size, layout)
    if not all(p is None or isinstance(p, Mapping) for p in payloads):
        raise TypeError(
            "external_data: routing by sample needs the per-rank result dicts (with "
            f"{_FOREIGN[role][1]!r}), not bare Boxes; pass the other role's results as they came back"
        )
    keys, index_key = _FOREIGN[role]
    if all(p is not None and _indices(p, index_key) == own[r] for r, p in enumerate(payloads)):
        return payloads  # they line up rank by rank
    routed: list[dict[str, Any]] = [
        {k: v for k, v in (p or {}).items() if k not in keys and k != index_key} for p in payloads
    ]
    distinct = list(dict.fromkeys(own))  # one entry per data-parallel rank, in order
    for key in keys:
        sources: dict[tuple[int, ...], Any] = {}
        for r, p in enumerate(payloads):
            if p is None or p.get(key) is None:
                continue
            indices = _indices(p, index_key)
            if indices is None:
                raise ValueError(
                    f"external_data[{r}] has {key!r} but no {index_key!r}; route by sample needs the "
                    "samples of each payload (pass the results of train / compute_log_probs unchanged)"
                )
            # Tensor-parallel peers of the last stage return the same samples: one source.
            sources.setdefault(indices, IndexedValues(values=p[key], sample_indices=indices))
        if not sources:
            continue
        gathers = route_by_sample(
            list(sources.values()), distinct, actor_dp_ranks=[distinct.index(i) for i in own]
        )
        for r, gather in enumerate(gathers):
            routed[r][key] = gather
    return routed


def _indices(payload: Mapping[str, Any], key: str) -> tuple[int, ...] | None:
    value = payload.get(key)
    return None if value is None else tuple(int(i) for i in value)
