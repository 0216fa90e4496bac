"""Fractional co-location bookkeeping (no Ray cluster needed: only the options are built)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.placement import GpuShares, Slot, colocation_options, scheduling_options


class FakeGroup:
    """Stands in for a PlacementGroup: the options only carry it."""


SLOT = Slot(FakeGroup(), bundle_indices=(3, 1, 0, 2), gpu_ids=(0, 1, 2, 3))  # type: ignore[arg-type]


def test_options_point_at_the_ordered_bundle() -> None:
    options = scheduling_options(SLOT, 1, num_gpus=0.4)
    strategy = options["scheduling_strategy"]
    assert strategy.placement_group is SLOT.pg
    assert strategy.placement_group_bundle_index == 1  # position 1 of the slot is bundle 1
    assert scheduling_options(SLOT, 0)["scheduling_strategy"].placement_group_bundle_index == 3
    # The CPU share follows the GPU share by default, so shares that fit the GPU fit the bundle's CPU.
    assert (options["num_gpus"], options["num_cpus"]) == (0.4, 0.4)
    assert scheduling_options(SLOT, 1, num_gpus=0.4, num_cpus=0.1)["num_cpus"] == 0.1


def test_actor_critic_and_engine_fit_and_a_fourth_is_refused() -> None:
    options = colocation_options(SLOT, 0, {"actor": 0.4, "critic": 0.4, "engine": 0.2})
    assert {role: o["num_gpus"] for role, o in options.items()} == {
        "actor": 0.4,
        "critic": 0.4,
        "engine": 0.2,
    }
    with pytest.raises(ValueError, match=r"actor 0\.4 \+ critic 0\.4 \+ engine 0\.2 \+ reward 0\.1 = 1\.1"):
        colocation_options(SLOT, 0, {"actor": 0.4, "critic": 0.4, "engine": 0.2, "reward": 0.1})


shares = st.lists(st.integers(0, 10_000).map(lambda u: u / 10_000), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(shares)
def test_a_bundle_accepts_shares_exactly_while_they_fit(fractions: list[float]) -> None:
    ledger = GpuShares()
    units = 0
    for i, fraction in enumerate(fractions):
        units += round(fraction * 10_000)
        if units <= 10_000:
            ledger.claim(SLOT, 2, role=f"r{i}", num_gpus=fraction)
        else:
            with pytest.raises(ValueError, match=f"r{i}"):
                ledger.claim(SLOT, 2, role=f"r{i}", num_gpus=fraction)
            units -= round(fraction * 10_000)
    assert round(sum(ledger.shares(SLOT, 2).values()) * 10_000) == units
    assert ledger.shares(SLOT, 1) == {}  # other bundles are untouched


def test_release_frees_the_share_and_roles_are_unique_per_bundle() -> None:
    ledger = GpuShares()
    ledger.claim(SLOT, 0, role="actor", num_gpus=0.6)
    with pytest.raises(ValueError, match="'actor' already holds"):
        ledger.claim(SLOT, 0, role="actor", num_gpus=0.1)
    with pytest.raises(ValueError, match="critic"):
        ledger.claim(SLOT, 0, role="critic", num_gpus=0.6)
    ledger.claim(SLOT, 1, role="critic", num_gpus=0.6)  # another bundle has its own GPU
    ledger.release(SLOT, 0, "actor")
    ledger.claim(SLOT, 0, role="critic", num_gpus=0.6)
    assert ledger.shares(SLOT, 0) == {"critic": 0.6}
    with pytest.raises(ValueError, match="holds no share"):
        ledger.release(SLOT, 0, "actor")


def test_cpu_shares_are_counted_too() -> None:
    ledger = GpuShares()
    ledger.claim(SLOT, 0, role="actor", num_gpus=0.1, num_cpus=0.9)
    with pytest.raises(ValueError, match="1 CPU"):
        ledger.claim(SLOT, 0, role="engine", num_gpus=0.1, num_cpus=0.2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(num_gpus=1.5), "num_gpus"),
        (dict(num_gpus=-0.1), "num_gpus"),
        (dict(num_gpus=0.12345), "num_gpus"),
        (dict(num_gpus=0.5, num_cpus=2), "num_cpus"),
        (dict(num_gpus=True), "num_gpus"),
    ],
)
def test_bad_shares_are_refused(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        scheduling_options(SLOT, 0, **kwargs)


@pytest.mark.parametrize("index", [-1, 4, 1.0])
def test_index_must_be_a_position_in_the_slot(index: Any) -> None:
    with pytest.raises(ValueError, match="0 <= index < 4"):
        scheduling_options(SLOT, index)
    with pytest.raises(ValueError, match="index"):
        scheduling_options(Slot(None, (), ()), 0)


def test_slot_checks_its_own_shape() -> None:
    with pytest.raises(ValueError, match="gpu_ids"):
        Slot(FakeGroup(), (0, 1), (0,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pg"):
        Slot(None, (0,), (0,))
    assert len(SLOT) == SLOT.num_gpus == 4
    assert not Slot(None, (), ())
