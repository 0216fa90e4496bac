"""Routing values by global sample index, for critic and actor with different data-parallel splits.

The data shapes, and why. A critic data-parallel (DP) rank returns `IndexedValues`:
a `Box` of its packed values plus the global sample index of each value, in the
box's order. The driver calls `route_by_sample`, which reads only those index
lists (never the tensors) and gives each actor DP rank a `SampleGather`: the boxes
of the critic ranks that hold its samples, and for each of its samples, in its own
order, which box and which position to take. The actor rank fetches those boxes
with one `ray.get` and copies out its samples (`unpack_values`).

Alternatives weighed: regrouping in the driver pulls every tensor through the
driver process; a Ray task per actor rank that regroups adds a task launch and one
more trip through the object store for the same bytes; one object per sample
multiplies the object count (and its per-object cost) by the batch size. Fetching
whole critic boxes costs an actor rank at most the bytes of the critic ranks it
draws from; with contiguous DP splits (the common case) it draws almost only its
own samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.value_transfer import _arguments as arguments
from tandem.value_transfer._box import Box
from tandem.value_transfer._packed import PackedValues

_SHOWN = 10  # indices listed in an error message before it says how many there are


@dataclass(frozen=True, slots=True)
class IndexedValues:
    """One critic rank's values keyed by global sample index (what `route_by_sample` reads).

    Attributes:
        values: the rank's values, packed by `pack_values`.
        sample_indices: the global sample index of each packed value, in the packed order.
    """

    values: Box[PackedValues]
    sample_indices: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.values, Box):
            raise TypeError(
                f"IndexedValues.values must be a Box from pack_values, got {arguments.type_name(self.values)}"
            )
        indices = arguments.index_list("IndexedValues.sample_indices", self.sample_indices, unique=True)
        object.__setattr__(self, "sample_indices", indices)


@dataclass(frozen=True, slots=True)
class SampleGather:
    """One actor rank's values, to be picked from critic ranks' boxes (made by `route_by_sample`).

    Attributes:
        sources: the boxes of the critic ranks that hold this rank's samples.
        picks: for each of this rank's samples, in its order, `(source, position)`:
            the value is sample `position` of `sources[source]`.
        sample_indices: this rank's global sample indices, in its order.
    """

    sources: tuple[Box[PackedValues], ...]
    picks: tuple[tuple[int, int], ...]
    sample_indices: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.sources, tuple) or not all(isinstance(b, Box) for b in self.sources):
            raise TypeError("SampleGather.sources must be a tuple of Box; build it with route_by_sample")
        if not isinstance(self.picks, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 for p in self.picks
        ):
            raise TypeError("SampleGather.picks must be a tuple of (source, position) pairs")
        for i, (source, position) in enumerate(self.picks):
            arguments.index(f"SampleGather.picks[{i}] position", position)
            if arguments.index(f"SampleGather.picks[{i}] source", source) >= len(self.sources):
                raise ValueError(
                    f"SampleGather.picks[{i}] names source {source} but sources holds {len(self.sources)} boxes; "
                    "build it with route_by_sample"
                )
        indices = arguments.index_list("SampleGather.sample_indices", self.sample_indices, unique=True)
        if len(indices) != len(self.picks):
            raise ValueError(
                f"SampleGather.sample_indices has {len(indices)} entries but picks has {len(self.picks)}"
            )
        object.__setattr__(self, "sample_indices", indices)


def _listed(indices: Sequence[int]) -> str:
    shown = sorted(indices)[:_SHOWN]
    more = f" ... ({len(indices)} in all)" if len(indices) > _SHOWN else ""
    return f"{shown}{more}"


def _critic_sources(
    critic_values: Sequence[IndexedValues | None], critic_dp_ranks: Sequence[int] | None
) -> list[tuple[int, IndexedValues]]:
    """One `(critic rank, values)` per source of distinct samples.

    Without `critic_dp_ranks`, every non-None entry is a source. With it, the ranks of
    one DP group (tensor-parallel peers on the last pipeline stage) hold the same
    samples: the first non-None entry of each group is used, the others must list the
    same samples, and every group must have one.
    """
    if critic_dp_ranks is None:
        return [(rank, v) for rank, v in enumerate(critic_values) if v is not None]
    if len(critic_dp_ranks) != len(critic_values):
        raise ValueError(
            f"critic_dp_ranks has {len(critic_dp_ranks)} entries but critic_values has "
            f"{len(critic_values)}; give the data-parallel rank of every critic rank"
        )
    chosen: dict[int, tuple[int, IndexedValues]] = {}
    for rank, (dp, v) in enumerate(zip(critic_dp_ranks, critic_values, strict=True)):
        if v is None:
            continue
        if dp not in chosen:
            chosen[dp] = (rank, v)
        elif chosen[dp][1].sample_indices != v.sample_indices:
            raise ValueError(
                f"critic_dp_ranks puts critic ranks {chosen[dp][0]} and {rank} in data-parallel rank {dp} "
                "but they return different sample indices; ranks of one DP group must hold the same samples"
            )
    missing = sorted(set(critic_dp_ranks) - set(chosen))
    if missing:
        raise ValueError(
            f"critic_dp_ranks: critic data-parallel ranks {missing} returned no values (all their entries in "
            "critic_values are None); each DP group's pipeline-last-stage ranks must return IndexedValues"
        )
    return [chosen[dp] for dp in sorted(chosen)]


def route_by_sample(
    critic_values: Sequence[IndexedValues | None],
    actor_sample_indices: Sequence[Sequence[int]],
    *,
    critic_dp_ranks: Sequence[int] | None = None,
    actor_dp_ranks: Sequence[int] | None = None,
) -> list[SampleGather]:
    """Plan, for each actor rank, which critic values it takes, keyed by global sample index.

    Every sample that an actor DP rank owns gets the values of exactly that sample, in
    the order the actor rank processes its samples; nothing is lost (every critic value
    is taken) and nothing is duplicated. Reads only the index lists: no tensor passes
    through the caller (the driver).

    Args:
        critic_values: one entry per critic rank, `None` where the rank holds no values
            (not on the pipeline-last stage).
        actor_sample_indices: per actor DP rank, its global sample indices in its order.
        critic_dp_ranks: the DP rank of each critic rank, when several ranks of one DP
            group return the same samples (tensor parallelism); see `_critic_sources`.
        actor_dp_ranks: the DP rank of each actor rank; when given, the result has one
            payload per actor rank (its DP group's), else one per actor DP rank.

    Returns:
        One `SampleGather` per actor rank (or per actor DP rank), in order.

    Raises:
        ValueError: a sample held by two critic sources or owned by two actor DP ranks,
            a sample some actor rank owns that no critic rank returned, a critic value
            that no actor rank owns, or inconsistent rank lists; the message names them.
    """
    critic_values, actor_sample_indices, critic_dp_ranks, actor_dp_ranks = _checked(
        critic_values, actor_sample_indices, critic_dp_ranks, actor_dp_ranks
    )
    sources = _critic_sources(critic_values, critic_dp_ranks)
    where: dict[int, tuple[int, int]] = {}  # sample index -> (source, position)
    for s, (rank, v) in enumerate(sources):
        for p, index in enumerate(v.sample_indices):
            if index in where:
                other = sources[where[index][0]][0]
                raise ValueError(
                    f"critic_values: sample index {index} is returned by critic rank {other} and "
                    f"by critic rank {rank}; each sample's values must come from one data-parallel "
                    "rank (pass critic_dp_ranks when tensor-parallel peers return the same samples)"
                )
            where[index] = (s, p)

    owner: dict[int, int] = {}
    for dp, indices in enumerate(actor_sample_indices):
        for index in indices:
            if index in owner:
                raise ValueError(
                    f"actor_sample_indices: sample index {index} is owned by actor data-parallel "
                    f"rank {owner[index]} and by rank {dp}; each sample must belong to one DP rank"
                )
            owner[index] = dp
    missing = [i for i in owner if i not in where]
    if missing:
        raise ValueError(
            f"actor_sample_indices: samples {_listed(missing)} are owned by actor ranks but no "
            f"critic rank returned values for them in critic_values ({len(where)} returned, {len(owner)} owned)"
        )
    unowned = [i for i in where if i not in owner]
    if unowned:
        raise ValueError(
            f"critic_values: values for samples {_listed(unowned)} are owned by no actor rank and "
            f"would be lost ({len(where)} returned, {len(owner)} owned); the actor's split "
            "(actor_sample_indices) must cover the critic's samples"
        )

    per_dp = [_gather_for(indices, where, sources) for indices in actor_sample_indices]
    if actor_dp_ranks is None:
        return per_dp
    bad = sorted({dp for dp in actor_dp_ranks if not 0 <= dp < len(per_dp)})
    if bad:
        raise ValueError(
            f"actor_dp_ranks names data-parallel ranks {bad} but actor_sample_indices has "
            f"{len(per_dp)} entries (DP ranks 0..{len(per_dp) - 1})"
        )
    unserved = sorted(set(range(len(per_dp))) - set(actor_dp_ranks))
    if unserved:
        raise ValueError(
            f"actor_dp_ranks has no rank in data-parallel ranks {unserved}; their samples would be lost"
        )
    return [per_dp[dp] for dp in actor_dp_ranks]


def _checked(
    critic_values: object, actor_sample_indices: object, critic_dp_ranks: object, actor_dp_ranks: object
) -> tuple[list[IndexedValues | None], list[tuple[int, ...]], tuple[int, ...] | None, tuple[int, ...] | None]:
    """The arguments of `route_by_sample`, type-checked; TypeError or ValueError naming the one at fault."""
    if not isinstance(critic_values, list | tuple):
        raise TypeError(
            "critic_values must be a list with one entry per critic rank (IndexedValues or None), "
            f"got {arguments.type_name(critic_values)}"
        )
    for rank, v in enumerate(critic_values):
        if isinstance(v, Box):
            raise TypeError(
                f"critic_values[{rank}] is a Box (from pack_values) without sample indices; route_by_sample "
                "needs pack_indexed_values(values, sample_indices) from each critic rank"
            )
        if v is not None and not isinstance(v, IndexedValues):
            raise TypeError(
                f"critic_values[{rank}] is a {arguments.type_name(v)}; give IndexedValues "
                "(from pack_indexed_values) or None"
            )
    if isinstance(actor_sample_indices, str | bytes) or not isinstance(actor_sample_indices, Sequence):
        raise TypeError(
            "actor_sample_indices must be a list with one list of sample indices per actor DP rank, "
            f"got {arguments.type_name(actor_sample_indices)}"
        )
    actor = [
        arguments.index_list(f"actor_sample_indices[{dp}]", v) for dp, v in enumerate(actor_sample_indices)
    ]
    critic_dp = None if critic_dp_ranks is None else arguments.index_list("critic_dp_ranks", critic_dp_ranks)
    actor_dp = None if actor_dp_ranks is None else arguments.index_list("actor_dp_ranks", actor_dp_ranks)
    return list(critic_values), actor, critic_dp, actor_dp


def _gather_for(
    indices: Sequence[int], where: dict[int, tuple[int, int]], sources: list[tuple[int, IndexedValues]]
) -> SampleGather:
    """The `SampleGather` of one actor DP rank: only the boxes it draws from, renumbered."""
    local: dict[int, int] = {}  # source number in `sources` -> number in this gather
    picks = []
    for index in indices:
        s, p = where[index]
        picks.append((local.setdefault(s, len(local)), p))
    boxes = tuple(sources[s][1].values for s in local)  # dicts keep insertion order
    return SampleGather(sources=boxes, picks=tuple(picks), sample_indices=tuple(indices))
