"""Box, packing and both routings through a real local Ray (actors stand in for critic and actor ranks)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import pytest
import ray
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.value_transfer import (
    Box,
    IndexedValues,
    PackedValues,
    SampleGather,
    pack_indexed_values,
    pack_values,
    route_by_sample,
    route_per_rank,
    unpack_values,
    values_for_rank,
)

# Each example makes a few object-store round trips: keep the count modest.
ray_settings = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def local_ray(module_ray_job: str) -> Iterator[None]:
    """This module as a job of the session's Ray cluster (tests/conftest.py)."""
    yield


def sample_value(index: int, length: int) -> torch.Tensor:
    """Values that say which sample they belong to (and where in it): no two samples alike."""
    return torch.arange(length, dtype=torch.float32) + 1000.0 * index


@ray.remote(num_cpus=0)
class Rank:
    """Stands in for a train worker: packs as a critic rank, unpacks as an actor rank.

    Two of them serve every test (each starts a Python with torch, slow on a small
    machine); critic rank r runs on one and actor rank r on the other, so values
    always cross processes.
    """

    def pack(self, lengths: list[int], first_index: int) -> Box[PackedValues]:
        return pack_values([sample_value(first_index + i, n) for i, n in enumerate(lengths)])

    def pack_indexed(self, lengths: list[int], sample_indices: list[int]) -> IndexedValues:
        values = [sample_value(i, n) for i, n in zip(sample_indices, lengths, strict=True)]
        return pack_indexed_values(values, sample_indices)

    def describe(self, arg: object) -> str:
        return type(arg).__name__ + ("" if not isinstance(arg, Box) else f"({type(arg.ref).__name__})")

    def unpack(
        self, payload: object, rank: int, is_last: bool, sample_indices: list[int] | None = None
    ) -> list[torch.Tensor] | None:
        mine = values_for_rank(payload, rank=rank, is_pipeline_last_stage=is_last)
        if mine is None:
            return None
        assert isinstance(mine, Box | SampleGather)
        return unpack_values(mine, "cpu", sample_indices=sample_indices)


@pytest.fixture(scope="module")
def ranks(local_ray: None) -> tuple[list, list]:
    """(critic ranks, actor ranks): two processes, critic rank r and actor rank r on different ones."""
    workers = [Rank.remote() for _ in range(2)]
    return workers, workers[::-1]


def assert_values_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.equal(g, e)


def test_box_refuses_what_is_not_an_object_ref() -> None:
    with pytest.raises(TypeError, match=r"Box.ref must be a ray.ObjectRef, got Tensor"):
        Box(torch.zeros(1))  # type: ignore[arg-type]


def test_box_is_frozen(local_ray: None) -> None:
    box = Box.put(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        box.ref = ray.put(2)  # type: ignore[misc]


def test_box_keeps_the_ref_unresolved_through_an_actor_call(ranks: tuple[list, list]) -> None:
    actor = ranks[1][0]
    ref = ray.put([1.0, 2.0])
    # A bare ref argument is resolved by Ray before the call (the contrast that makes Box needed) ...
    assert ray.get(actor.describe.remote(ref)) == "list"
    # ... a boxed one arrives as a ref.
    assert ray.get(actor.describe.remote(Box(ref))) == "Box(ObjectRef)"


@ray_settings
@given(
    lengths=st.lists(st.lists(st.integers(0, 9), max_size=5), min_size=2, max_size=2),
    is_last=st.lists(st.booleans(), min_size=2, max_size=2),
)
def test_per_rank_values_reach_their_rank_through_actor_calls(
    ranks: tuple[list, list], lengths: list[list[int]], is_last: list[bool]
) -> None:
    critics, actors = ranks
    firsts = [0, len(lengths[0])]
    # Critic ranks off the last stage return nothing; the driver only handles the small Boxes.
    payloads = [
        ray.get(c.pack.remote(n, first)) if last else None
        for c, n, first, last in zip(critics, lengths, firsts, is_last, strict=True)
    ]
    routed = route_per_rank(payloads, len(actors))
    got = ray.get(
        [
            a.unpack.remote(p, r, last, list(range(len(n))))
            for r, (a, p, last, n) in enumerate(zip(actors, routed, is_last, lengths, strict=True))
        ]
    )
    for rank, n in enumerate(lengths):
        if not is_last[rank]:
            assert got[rank] is None
            continue
        assert_values_equal(got[rank], [sample_value(firsts[rank] + i, k) for i, k in enumerate(n)])


def test_a_rank_with_no_samples_packs_and_unpacks_nothing(ranks: tuple[list, list]) -> None:
    critics, actors = ranks
    box = ray.get(critics[0].pack.remote([], 0))
    assert ray.get(actors[0].unpack.remote(box, 0, True, [])) == []


def test_the_count_is_checked_against_the_ranks_batch(local_ray: None) -> None:
    box = pack_values([torch.ones(3), torch.ones(2)])
    with pytest.raises(ValueError, match=r"batch has 3 samples but the payload carries 2 values"):
        unpack_values(box, "cpu", sample_indices=[0, 1, 2])


def test_packing_detaches_and_keeps_dtype_and_shapes(local_ray: None) -> None:
    grad = torch.randn(4, requires_grad=True)
    values = [grad * 2, torch.zeros(0), torch.randn(2, 3)]
    got = unpack_values(pack_values(values), "cpu")
    assert_values_equal(got, [v.detach() for v in values])
    assert not any(g.requires_grad for g in got)
    half = [torch.randn(5).to(torch.bfloat16), torch.randn(1).to(torch.bfloat16)]
    assert_values_equal(unpack_values(pack_values(half), torch.device("cpu")), half)


def test_unpacked_values_are_writable_copies(local_ray: None) -> None:
    box = pack_values([torch.ones(3)])
    first = unpack_values(box, "cpu")
    first[0].add_(1.0)  # must touch neither the object store nor a later unpack
    assert torch.equal(unpack_values(box, "cpu")[0], torch.ones(3))


def test_mixed_dtypes_are_refused(local_ray: None) -> None:
    with pytest.raises(ValueError, match=r"values: all tensors must share one dtype"):
        pack_values([torch.ones(2), torch.ones(2, dtype=torch.float64)])


def test_a_box_of_a_plain_tensor_list_is_accepted(local_ray: None) -> None:
    values = [torch.randn(3), torch.randn(1)]
    assert_values_equal(unpack_values(Box(ray.put(values)), "cpu"), values)


def test_a_box_of_something_else_is_refused(local_ray: None) -> None:
    with pytest.raises(TypeError, match=r"not PackedValues; box values with pack_values"):
        unpack_values(Box.put({"values": 1}), "cpu")


# --- routing by sample: critic and actor with different data-parallel splits ---


@st.composite
def splits(draw: st.DrawFn, max_samples: int = 24) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """(length of each sample, critic DP ranks' sample indices, actor DP ranks' sample indices).

    Both sides split the same samples, each in its own way: any DP size from 1 to 4,
    any order, empty ranks allowed.
    """
    n = draw(st.integers(0, max_samples))
    lengths = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))

    def split() -> list[list[int]]:
        order = draw(st.permutations(range(n)))
        size = draw(st.integers(1, 4))
        cuts = sorted(draw(st.lists(st.integers(0, n), min_size=size - 1, max_size=size - 1)))
        bounds = [0, *cuts, n]
        return [list(order[a:b]) for a, b in itertools.pairwise(bounds)]

    return lengths, split(), split()


def pack_split(lengths: list[int], critic_split: list[list[int]]) -> list[IndexedValues]:
    return [pack_indexed_values([sample_value(i, lengths[i]) for i in idx], idx) for idx in critic_split]


@ray_settings
@given(split=splits())
def test_every_sample_reaches_the_actor_rank_that_owns_it_in_its_order(
    local_ray: None, split: tuple[list[int], list[list[int]], list[list[int]]]
) -> None:
    lengths, critic_split, actor_split = split
    payloads = route_by_sample(pack_split(lengths, critic_split), actor_split)
    assert len(payloads) == len(actor_split)
    for owned, payload in zip(actor_split, payloads, strict=True):
        got = unpack_values(payload, "cpu", sample_indices=owned)
        assert_values_equal(got, [sample_value(i, lengths[i]) for i in owned])
        # An actor rank fetches only the critic boxes that hold its samples.
        holders = {c for c, idx in enumerate(critic_split) if set(idx) & set(owned)}
        assert len(payload.sources) == len(holders)


@ray_settings
@given(split=splits(max_samples=12), tp=st.integers(1, 3), data=st.data())
def test_tensor_parallel_copies_count_once_and_payloads_follow_the_dp_group(
    local_ray: None,
    split: tuple[list[int], list[list[int]], list[list[int]]],
    tp: int,
    data: st.DataObject,
) -> None:
    lengths, critic_split, actor_split = split
    packed = pack_split(lengths, critic_split)
    # Every critic DP group has `tp` last-stage ranks returning the same samples, plus a
    # first-stage rank per group that returns nothing.
    critic_values: list[IndexedValues | None] = []
    critic_dp_ranks = []
    for dp, v in enumerate(packed):
        copies = [v] * tp + [None]
        critic_values += copies
        critic_dp_ranks += [dp] * len(copies)
    actor_dp_ranks = data.draw(st.permutations([dp for dp in range(len(actor_split)) for _ in range(tp)]))
    payloads = route_by_sample(
        critic_values, actor_split, critic_dp_ranks=critic_dp_ranks, actor_dp_ranks=actor_dp_ranks
    )
    assert len(payloads) == len(actor_dp_ranks)
    for dp, payload in zip(actor_dp_ranks, payloads, strict=True):
        assert payload.sample_indices == tuple(actor_split[dp])
        got = unpack_values(payload, "cpu")
        assert_values_equal(got, [sample_value(i, lengths[i]) for i in actor_split[dp]])


@ray_settings
@given(split=splits(), data=st.data())
def test_wrong_counts_are_refused_naming_the_sample(
    local_ray: None, split: tuple[list[int], list[list[int]], list[list[int]]], data: st.DataObject
) -> None:
    lengths, critic_split, actor_split = split
    samples = [i for idx in actor_split for i in idx]
    if not samples:
        return
    victim = data.draw(st.sampled_from(samples))
    # Critic lost a sample.
    fewer = [[i for i in idx if i != victim] for idx in critic_split]
    with pytest.raises(ValueError, match=rf"samples \[{victim}\] are owned by actor ranks but no critic"):
        route_by_sample(pack_split(lengths, fewer), actor_split)
    # Actor does not own a sample the critic returned.
    unowned = [[i for i in idx if i != victim] for idx in actor_split]
    with pytest.raises(ValueError, match=rf"values for samples \[{victim}\] are owned by no actor rank"):
        route_by_sample(pack_split(lengths, critic_split), unowned)
    # A sample owned twice by the actor, or returned twice by the critic.
    twice = [*actor_split, [victim]]
    with pytest.raises(ValueError, match=rf"sample index {victim} is owned by actor data-parallel rank"):
        route_by_sample(pack_split(lengths, critic_split), twice)
    with pytest.raises(ValueError, match=rf"sample index {victim} is returned by critic rank"):
        route_by_sample(pack_split(lengths, [*critic_split, [victim]]), actor_split)


def test_routing_never_pulls_values_through_the_driver(
    local_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed = pack_split([3, 1, 2], [[0, 2], [1]])

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("route_by_sample fetched an object")

    monkeypatch.setattr(ray, "get", refuse)
    payloads = route_by_sample(packed, [[2], [1, 0]])
    monkeypatch.undo()
    assert_values_equal(unpack_values(payloads[1], "cpu"), [sample_value(1, 1), sample_value(0, 3)])


def test_rank_lists_that_lose_samples_are_refused(local_ray: None) -> None:
    packed = pack_split([1, 1], [[0], [1]])
    with pytest.raises(ValueError, match=r"critic data-parallel ranks \[1\] returned no values"):
        route_by_sample([packed[0], None], [[0, 1]], critic_dp_ranks=[0, 1])
    with pytest.raises(ValueError, match=r"critic ranks 0 and 1 in data-parallel rank 0"):
        route_by_sample(packed, [[0, 1]], critic_dp_ranks=[0, 0])
    with pytest.raises(ValueError, match=r"actor_dp_ranks has no rank in data-parallel ranks \[1\]"):
        route_by_sample(packed, [[0], [1]], actor_dp_ranks=[0, 0])
    with pytest.raises(ValueError, match=r"critic_dp_ranks has 1 entries but critic_values has 2"):
        route_by_sample(packed, [[0], [1]], critic_dp_ranks=[0])
    with pytest.raises(ValueError, match=r"sample_indices: this rank's batch has samples \[1, 0\]"):
        unpack_values(route_by_sample(packed, [[0, 1]])[0], "cpu", sample_indices=[1, 0])


def test_by_sample_values_reach_actor_ranks_through_actor_calls(ranks: tuple[list, list]) -> None:
    critics, actors = ranks
    lengths = [4, 0, 7, 2, 5]
    # Critic: DP 2, contiguous halves. Actor: DP 2 as well, but interleaved, and its
    # second DP rank gets one sample only ... and a third actor DP rank none at all.
    critic_split = [[0, 1, 2], [3, 4]]
    actor_split = [[4, 0, 2, 1], [3], []]
    critic_values = ray.get(
        [
            c.pack_indexed.remote([lengths[i] for i in idx], idx)
            for c, idx in zip(critics, critic_split, strict=True)
        ]
    )
    payloads = route_by_sample(critic_values, actor_split)
    workers = [actors[0], actors[1], actors[0]]
    got = ray.get(
        [
            w.unpack.remote(p, r, True, idx)
            for r, (w, p, idx) in enumerate(zip(workers, payloads, actor_split, strict=True))
        ]
    )
    for owned, values in zip(actor_split, got, strict=True):
        assert_values_equal(values, [sample_value(i, lengths[i]) for i in owned])


@pytest.mark.gpu
def test_values_travel_from_gpu_through_the_store_to_gpu(local_ray: None) -> None:
    values = [torch.randn(n, device="cuda") for n in (5, 0, 3000)]
    got = unpack_values(pack_values(values), "cuda")
    # The copy is asynchronous on the current stream; comparing on that stream is ordered after it.
    assert all(g.device.type == "cuda" for g in got)
    assert_values_equal(got, values)
    by_sample = route_by_sample([pack_indexed_values(values, [7, 8, 9])], [[9, 7], [8]])
    assert_values_equal(unpack_values(by_sample[0], "cuda"), [values[2], values[0]])
