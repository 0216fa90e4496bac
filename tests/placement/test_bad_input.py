"""Wrong types and values fed to every public function: only a ValueError or TypeError naming the argument escapes.

Each case starts from a call that works, replaces one argument with something
drawn from `junk`, and calls again. The call may still succeed, but if it fails
the error must be a ValueError or TypeError whose message names the argument
that was replaced. No Ray cluster is needed: the placement-group calls use a
layout of zero GPUs, which every argument check runs before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.placement import (
    BundleLocation,
    GpuShares,
    Layout,
    Placements,
    PlacementSpec,
    Slot,
    colocation_options,
    compute_layout,
    create_placement_groups,
    order_bundles,
    scheduling_options,
)


class FakeGroup:
    """Stands in for a PlacementGroup: the options only carry it."""


def _generator(n: int) -> Iterator[int]:
    yield from range(n)


SLOT = Slot(FakeGroup(), (3, 1, 0, 2), (0, 1, 2, 3), ("10.0.0.1",) * 4)  # type: ignore[arg-type]
EMPTY = Slot(None, (), ())
LOCATIONS = [BundleLocation(0, "10.0.0.2", 0, "n1"), BundleLocation(1, "10.0.0.1", 0, "n2")]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=2),
)
junk = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.lists(st.integers(-1, 5), max_size=4).map(tuple),
    st.dictionaries(st.text(max_size=3), scalars, max_size=3),
    st.dictionaries(st.sampled_from(["actor", "critic", "engine", ""]), st.floats(-1, 2), max_size=3),
    st.integers(0, 3).map(_generator),
    st.sampled_from(
        [
            {"actor_num_gpus_per_node": 2, "rollout_num_gpus": 2},
            "999.1.1.1",
            "10.0.0",
            "no such host!",
            "-bad-.example",
            "fe80::1",
            "node-a",
            ("10.0.0.1", 5),
            (0, 0),
            [LOCATIONS[0], LOCATIONS[0]],
            [LOCATIONS[0], "10.0.0.1"],
            LOCATIONS,
            SLOT,
            EMPTY,
            compute_layout(PlacementSpec(rollout_num_gpus=1)),
            "colocate",
            "nonsense",
            object(),
        ]
    ),
)

SPEC = {"actor_num_gpus_per_node": 2, "rollout_num_gpus": 2, "colocate": True, "use_critic": True}
ZERO_GPUS = PlacementSpec(rollout_external=True, debug_rollout_only=True)
LAYOUT = compute_layout(PlacementSpec(actor_num_gpus_per_node=2, rollout_num_gpus=1, eval_num_gpus=1))


def _claim(**kwargs: Any) -> None:
    GpuShares().claim(**kwargs)


def _release(**kwargs: Any) -> None:
    shares = GpuShares()
    shares.claim(SLOT, 1, role="actor", num_gpus=0.5)
    shares.release(**kwargs)


def _shares(**kwargs: Any) -> dict[str, float]:
    return GpuShares().shares(**kwargs)


def _options(**kwargs: Any) -> dict[str, Any]:
    return GpuShares().options(**kwargs)


CALLS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "PlacementSpec": (PlacementSpec, SPEC),
    "compute_layout": (compute_layout, {"spec": PlacementSpec(**SPEC)}),
    "Layout": (
        Layout,
        {
            "case": "separate",
            "num_gpus": 4,
            "rollout_offset": 2,
            "train_num_gpus": 2,
            "rollout_num_gpus": 1,
            "eval_num_gpus": 1,
        },
    ),
    "create_placement_groups": (
        create_placement_groups,
        {"spec": ZERO_GPUS, "timeout_s": 5.0, "name": "run", "check_resources": True},
    ),
    "BundleLocation": (
        BundleLocation,
        {"bundle_index": 1, "node_ip": "10.0.0.9", "gpu_id": 3, "node_id": "n1"},
    ),
    "order_bundles": (order_bundles, {"locations": LOCATIONS}),
    "Slot": (
        Slot,
        {
            "pg": FakeGroup(),
            "bundle_indices": (3, 1),
            "gpu_ids": (0, 1),
            "node_ips": ("10.0.0.1", "10.0.0.1"),
        },
    ),
    "Placements": (
        Placements,
        {"layout": LAYOUT, "pg": FakeGroup(), "actor": SLOT, "critic": None, "rollout": SLOT, "eval": EMPTY},
    ),
    "scheduling_options": (scheduling_options, {"slot": SLOT, "index": 1, "num_gpus": 0.5, "num_cpus": 0.5}),
    "GpuShares.options": (
        _options,
        {"slot": SLOT, "index": 1, "role": "actor", "num_gpus": 0.4, "num_cpus": None},
    ),
    "GpuShares.claim": (
        _claim,
        {"slot": SLOT, "index": 1, "role": "actor", "num_gpus": 0.4, "num_cpus": 0.3},
    ),
    "GpuShares.release": (_release, {"slot": SLOT, "index": 1, "role": "actor"}),
    "GpuShares.shares": (_shares, {"slot": SLOT, "index": 1}),
    "colocation_options": (
        colocation_options,
        {"slot": SLOT, "index": 0, "num_gpus": {"actor": 0.4, "critic": 0.4, "engine": 0.2}},
    ),
}

CASES = [(function, argument) for function, (_, kwargs) in CALLS.items() for argument in kwargs]


@pytest.mark.parametrize(("function", "argument"), CASES)
@settings(max_examples=80, deadline=None)
@given(value=junk)
def test_a_wrong_argument_is_named_in_a_value_or_type_error(function: str, argument: str, value: Any) -> None:
    call, kwargs = CALLS[function]
    kwargs = {**kwargs, argument: value}
    try:
        call(**kwargs)
    except (ValueError, TypeError) as err:
        assert argument in str(err), f"{function}({argument}={value!r}): the error does not name it: {err}"


def test_every_public_function_is_fed_junk() -> None:
    import tandem.placement as placement

    covered = {name.split(".")[0] for name in CALLS}
    # Constants and exception classes take no input of their own.
    exempt = {
        "__version__",
        "BUNDLE",
        "STRATEGY",
        "LayoutCase",
        "PlacementTimeoutError",
        "ClusterTooSmallError",
    }
    assert set(placement.__all__) - exempt <= covered


def test_a_dict_is_not_a_spec() -> None:
    with pytest.raises(
        TypeError, match=r"spec must be a PlacementSpec, got dict; build one with PlacementSpec\(\*\*spec\)"
    ):
        compute_layout(SPEC)  # type: ignore[arg-type]


def test_a_role_must_be_named() -> None:
    with pytest.raises(TypeError, match="role=None"):
        GpuShares().claim(SLOT, 0, role=None, num_gpus=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="role='' is blank"):
        GpuShares().claim(SLOT, 0, role="", num_gpus=0.5)


def test_an_empty_slot_says_it_has_no_bundles() -> None:
    with pytest.raises(ValueError, match="this slot has no bundles") as raised:
        scheduling_options(EMPTY, 0)
    assert "< 0" not in str(raised.value)


@pytest.mark.parametrize("ip", ["999.1.1.1", "10.0.0", "", "two words", "-x.example", "a..b"])
def test_a_bad_node_ip_is_refused(ip: str) -> None:
    with pytest.raises(ValueError, match="node_ip"):
        order_bundles([BundleLocation(0, ip, 0)])


def test_two_bundles_on_one_gpu_are_refused() -> None:
    with pytest.raises(ValueError, match=r"locations\[0\] and locations\[1\] have the same GPU"):
        order_bundles([BundleLocation(0, "10.0.0.1", 0), BundleLocation(1, "10.0.0.1", 0)])
    with pytest.raises(ValueError, match="same bundle index"):
        order_bundles([BundleLocation(0, "10.0.0.1", 0), BundleLocation(0, "10.0.0.1", 1)])
