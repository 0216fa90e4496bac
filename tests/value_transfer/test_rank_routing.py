"""Per-rank routing and the topology contract (identical actor and critic topology)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.value_transfer import route_per_rank, values_for_rank


@given(payloads=st.lists(st.one_of(st.none(), st.integers()), min_size=1, max_size=16))
def test_a_list_gives_payload_i_to_rank_i(payloads: list[int | None]) -> None:
    routed = route_per_rank(payloads, len(payloads))
    assert routed == payloads
    assert routed is not payloads  # the caller's list is not handed out for mutation


@given(
    payloads=st.lists(st.integers(), max_size=12),
    world_size=st.integers(1, 12),
)
def test_a_list_of_the_wrong_length_is_refused_naming_both_counts(
    payloads: list[int], world_size: int
) -> None:
    if len(payloads) == world_size:
        assert route_per_rank(payloads, world_size) == payloads
        return
    with pytest.raises(ValueError, match=rf"has {len(payloads)} payloads but world_size is {world_size}"):
        route_per_rank(tuple(payloads), world_size)


@given(world_size=st.integers(1, 16))
def test_a_single_payload_goes_to_every_rank_and_none_sends_nothing(world_size: int) -> None:
    payload = {"values": object()}
    routed = route_per_rank(payload, world_size)
    assert len(routed) == world_size and all(p is payload for p in routed)
    assert route_per_rank(None, world_size) == [None] * world_size


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size=0 must be at least 1"):
        route_per_rank(None, 0)


def _is_last_stage(rank: int, tp: int, dp: int, pp: int) -> bool:
    """Megatron's default rank order puts the pipeline stage outermost (tp, then dp, then pp)."""
    return rank // (tp * dp) == pp - 1


topologies = st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3))


@given(topology=topologies)
def test_critic_rank_r_reaches_actor_rank_r_on_the_last_stage_only(topology: tuple[int, int, int]) -> None:
    tp, dp, pp = topology
    world = tp * dp * pp
    # What each critic rank returns: a payload on the last stage, None elsewhere.
    critic = [f"values of critic rank {r}" if _is_last_stage(r, tp, dp, pp) else None for r in range(world)]
    routed = route_per_rank(critic, world)
    for rank in range(world):
        last = _is_last_stage(rank, tp, dp, pp)
        got = values_for_rank(routed[rank], rank=rank, is_pipeline_last_stage=last)
        assert got == (f"values of critic rank {rank}" if last else None)


@given(topology=topologies, data=st.data())
def test_a_last_stage_rank_without_values_is_a_bug_named_by_rank(
    topology: tuple[int, int, int], data: st.DataObject
) -> None:
    tp, dp, pp = topology
    world = tp * dp * pp
    last_ranks = [r for r in range(world) if _is_last_stage(r, tp, dp, pp)]
    dropped = data.draw(st.sampled_from(last_ranks))
    critic = [f"v{r}" if r in last_ranks and r != dropped else None for r in range(world)]
    routed = route_per_rank(critic, world)
    with pytest.raises(ValueError, match=rf"actor rank {dropped} is on the pipeline-last stage"):
        values_for_rank(routed[dropped], rank=dropped, is_pipeline_last_stage=True)


@given(topology=topologies)
def test_a_payload_sent_to_another_stage_is_ignored(topology: tuple[int, int, int]) -> None:
    tp, dp, pp = topology
    world = tp * dp * pp
    routed = route_per_rank("the same payload everywhere", world)
    for rank in range(world):
        last = _is_last_stage(rank, tp, dp, pp)
        got = values_for_rank(routed[rank], rank=rank, is_pipeline_last_stage=last)
        assert got == ("the same payload everywhere" if last else None)
