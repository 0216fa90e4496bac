"""Bundle ordering: (node IP as numbers, node, GPU id), whatever order Ray handed the bundles in."""

from __future__ import annotations

import ipaddress
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.placement import BundleLocation, order_bundles

ipv4 = st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv4Address(n)))
# Few distinct nodes, so that examples have several GPUs per node and shared IPs.
nodes = st.lists(st.tuples(ipv4, st.sampled_from(["n-a", "n-b", "n-c"])), min_size=1, max_size=4, unique=True)


@st.composite
def shuffled_bundles(draw: st.DrawFn) -> list[BundleLocation]:
    """Bundles on a few nodes, each node's GPU ids distinct, handed over in a random order."""
    chosen = draw(nodes)
    cells = []
    for ip, node_id in chosen:
        for gpu in draw(st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True)):
            cells.append((ip, node_id, gpu))
    cells = draw(st.permutations(cells))
    return [BundleLocation(i, ip, gpu, node_id) for i, (ip, node_id, gpu) in enumerate(cells)]


@settings(max_examples=300, deadline=None)
@given(shuffled_bundles())
def test_order_is_a_permutation_sorted_by_ip_number_then_gpu(bundles: list[BundleLocation]) -> None:
    ordered = order_bundles(bundles)
    assert sorted(b.bundle_index for b in ordered) == list(range(len(bundles)))
    for before, after in itertools.pairwise(ordered):
        ip_before, ip_after = (
            int(ipaddress.ip_address(before.node_ip)),
            int(ipaddress.ip_address(after.node_ip)),
        )
        assert ip_before <= ip_after
        if (before.node_ip, before.node_id) == (after.node_ip, after.node_id):
            assert before.gpu_id < after.gpu_id


@settings(max_examples=200, deadline=None)
@given(shuffled_bundles())
def test_each_node_is_contiguous(bundles: list[BundleLocation]) -> None:
    """Consecutive ranks share a node, also when several nodes share one IP (raylets on one host)."""
    ordered = order_bundles(bundles)
    seen: list[tuple[str, str]] = []
    for b in ordered:
        if not seen or seen[-1] != (b.node_ip, b.node_id):
            assert (b.node_ip, b.node_id) not in seen, "a node's bundles were split"
            seen.append((b.node_ip, b.node_id))


@settings(max_examples=100, deadline=None)
@given(shuffled_bundles(), st.randoms(use_true_random=False))
def test_order_does_not_depend_on_arrival_order(bundles: list[BundleLocation], rnd: object) -> None:
    reshuffled = list(bundles)
    rnd.shuffle(reshuffled)  # type: ignore[attr-defined]
    assert order_bundles(reshuffled) == order_bundles(bundles)


def test_numbers_not_text() -> None:
    # As text "10.0.0.10" < "10.0.0.9"; as numbers it is the other way round.
    bundles = [
        BundleLocation(0, "10.0.0.10", 0),
        BundleLocation(1, "10.0.0.9", 1),
        BundleLocation(2, "10.0.0.9", 0),
        BundleLocation(3, "10.0.0.10", 1),
    ]
    assert [b.bundle_index for b in order_bundles(bundles)] == [2, 1, 0, 3]


def test_ipv6_and_hostnames_still_give_a_total_order() -> None:
    bundles = [
        BundleLocation(0, "node-b", 0),
        BundleLocation(1, "fe80::2", 0),
        BundleLocation(2, "node-a", 0),
        BundleLocation(3, "192.168.0.1", 0),
    ]
    assert [b.bundle_index for b in order_bundles(bundles)] == [3, 1, 2, 0]
