"""Fractional GPU sharing: several Ray actors on one bundle (e.g. actor 0.4 + critic 0.4 + engine 0.2).

Ray itself would just leave an actor pending forever when a bundle is over-subscribed;
`GpuShares` refuses up front, naming the roles and fractions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import _arguments as arguments
from ._arguments import instance
from ._groups import Slot

# Ray represents fractional resources in units of 1/10000; counting in those units
# avoids float sums such as 0.4 + 0.4 + 0.2 = 1.0000000000000002.
_UNITS = 10_000


def scheduling_options(
    slot: Slot, index: int, *, num_gpus: float = 1.0, num_cpus: float | None = None
) -> dict[str, Any]:
    """Keyword arguments for `RemoteClass.options(**...)` that put one actor on bundle `index` of `slot`.

    `num_gpus` is this actor's share of the bundle's GPU (0 to 1); `num_cpus`
    defaults to the same share of the bundle's one CPU, so shares that fit the GPU
    also fit the CPU. Checks nothing across actors: use `GpuShares` for that.
    """
    _units("num_gpus", num_gpus)
    cpus = num_gpus if num_cpus is None else num_cpus
    _units("num_cpus", cpus)
    bundle_index = _bundle_index(slot, index)
    assert slot.pg is not None  # Slot refuses bundles without a group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=slot.pg, placement_group_bundle_index=bundle_index
        ),
        "num_gpus": num_gpus,
        "num_cpus": cpus,
    }


class GpuShares:
    """Per-bundle ledger of the GPU and CPU shares given to roles; refuses more than one bundle holds.

    >>> shares = GpuShares()
    >>> Actor.options(**shares.options(slot, 0, role="actor", num_gpus=0.4)).remote()   # doctest: +SKIP
    """

    def __init__(self) -> None:
        # (placement group, bundle index) -> role -> (GPU units, CPU units)
        self._claims: dict[tuple[object, int], dict[str, tuple[int, int]]] = {}

    def options(
        self, slot: Slot, index: int, *, role: str, num_gpus: float, num_cpus: float | None = None
    ) -> dict[str, Any]:
        """Claim `num_gpus` (and `num_cpus`, default the same) of bundle `index` for `role`; return its options."""
        self.claim(slot, index, role=role, num_gpus=num_gpus, num_cpus=num_cpus)
        return scheduling_options(slot, index, num_gpus=num_gpus, num_cpus=num_cpus)

    def claim(
        self, slot: Slot, index: int, *, role: str, num_gpus: float, num_cpus: float | None = None
    ) -> None:
        """Record `role`'s share of bundle `index`; ValueError if the bundle's shares would pass 1 GPU or 1 CPU."""
        role = arguments.role(role)
        gpu = _units("num_gpus", num_gpus)
        cpu = _units("num_cpus", num_gpus if num_cpus is None else num_cpus)
        bundle = _bundle_index(slot, index)  # checks slot first
        key = (slot.pg, bundle)
        roles = self._claims.get(key, {})
        if role in roles:
            raise ValueError(
                f"role {role!r} already holds a share of bundle {key[1]}; give each actor its own role "
                f"name (e.g. {role + '-1'!r}), or release({role!r}) first"
            )
        for what, position, asked in (("GPU", 0, gpu), ("CPU", 1, cpu)):
            total = sum(units[position] for units in roles.values()) + asked
            if total > _UNITS:
                shares = " + ".join(f"{r} {u[position] / _UNITS:g}" for r, u in roles.items())
                raise ValueError(
                    f"bundle {key[1]} has 1 {what}: {shares} + {role} {asked / _UNITS:g} "
                    f"= {total / _UNITS:g} {what}s; lower num_{what.lower()}s of {role!r} or of the others "
                    f"so that they add up to at most 1, or put {role!r} on another bundle"
                )
        self._claims[key] = {**roles, role: (gpu, cpu)}

    def release(self, slot: Slot, index: int, role: str) -> None:
        """Give `role`'s share of bundle `index` back (after its actor was killed)."""
        bundle = _bundle_index(slot, index)  # checks slot first
        key = (slot.pg, bundle)
        role = arguments.role(role)
        roles = self._claims.get(key, {})
        if role not in roles:
            raise ValueError(
                f"role {role!r} holds no share of bundle {key[1]} (index {index} of the slot); nothing to release"
            )
        self._claims[key] = {r: u for r, u in roles.items() if r != role}

    def shares(self, slot: Slot, index: int) -> dict[str, float]:
        """GPU share of each role on bundle `index`."""
        bundle = _bundle_index(slot, index)  # checks slot first
        roles = self._claims.get((slot.pg, bundle), {})
        return {role: units[0] / _UNITS for role, units in roles.items()}


def colocation_options(slot: Slot, index: int, num_gpus: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    """Options for each role sharing bundle `index`, e.g. `{"actor": 0.4, "critic": 0.4, "engine": 0.2}`.

    ValueError, naming the roles and fractions, when they add up to more than one GPU.
    """
    if not isinstance(num_gpus, Mapping):
        raise TypeError(
            "num_gpus must map each role to its share of the GPU, e.g. {'actor': 0.4, 'critic': 0.4, "
            f"'engine': 0.2}}, got {arguments.type_name(num_gpus)}"
        )
    for role in num_gpus:
        if not isinstance(role, str) or not role.strip():
            raise TypeError(f"num_gpus: the role {role!r} must be a non-empty string, e.g. 'actor'")
    shares = GpuShares()
    return {role: shares.options(slot, index, role=role, num_gpus=share) for role, share in num_gpus.items()}


def _bundle_index(slot: Slot, index: int) -> int:
    instance("slot", slot, Slot, "use a slot of create_placement_groups(...), e.g. placements.actor")
    if not slot.bundle_indices:
        raise ValueError(
            f"index={index!r}: this slot has no bundles (its role got no GPUs in the layout); "
            "check the spec's GPU counts, or do not start actors for this role"
        )
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(slot.bundle_indices):
        raise ValueError(
            f"index={index!r} is not a position in this slot of {len(slot.bundle_indices)} bundles; "
            f"give 0 <= index < {len(slot.bundle_indices)}"
        )
    return slot.bundle_indices[index]


def _units(name: str, value: float) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:  # NaN fails too
        raise ValueError(f"{name}={value!r} must be a share of one bundle, between 0 and 1")
    units = round(value * _UNITS)
    if abs(units - value * _UNITS) > 1e-6:
        raise ValueError(f"{name}={value!r} is finer than Ray's 0.0001 resolution; round it to 4 decimals")
    return units
