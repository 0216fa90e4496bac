"""Ray placement groups for actor, critic, rollout and eval: one PACK group, bundles ordered by node and GPU.

Ray is imported inside the functions that use it, so that `import tandem.placement`
stays light (the layout math is used where Ray is not running).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Self

from ._arguments import count, instance, timeout, type_name
from ._bundles import BundleLocation, order_bundles
from ._errors import ClusterTooSmallError, PlacementTimeoutError
from ._layout import Layout, compute_layout
from ._spec import PlacementSpec

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

BUNDLE: dict[str, float] = {"GPU": 1, "CPU": 1}
"""Resources of every bundle: one GPU and one CPU."""
STRATEGY = "PACK"
"""Placement strategy: as few nodes as possible, so training ranks share nodes."""
DEFAULT_TIMEOUT_S = 300.0
"""How long `create_placement_groups` waits for the cluster by default (an autoscaler may add nodes)."""


@dataclass(frozen=True, slots=True)
class Slot:
    """The bundles one role gets, in rank order: rank i runs on bundle `bundle_indices[i]`, GPU `gpu_ids[i]`."""

    pg: PlacementGroup | None
    """The placement group holding the bundles; None for a slot with no bundles."""
    bundle_indices: tuple[int, ...]
    """Bundle indices inside `pg`, ordered by (node IP, GPU id)."""
    gpu_ids: tuple[int, ...]
    """GPU id (on its node) of each bundle, same order."""
    node_ips: tuple[str, ...] = ()
    """Node IP of each bundle, same order (empty when not probed)."""

    def __post_init__(self) -> None:
        for name in ("bundle_indices", "gpu_ids", "node_ips"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                raise TypeError(f"Slot.{name} must be a tuple, got {type_name(value)}")
        for name in ("bundle_indices", "gpu_ids"):
            for i, value in enumerate(getattr(self, name)):
                count(f"Slot.{name}[{i}]", value)
        for i, ip in enumerate(self.node_ips):
            if not isinstance(ip, str) or not ip:
                raise TypeError(f"Slot.node_ips[{i}]={ip!r} must be a node's IP address (a string)")
        if len(set(self.bundle_indices)) != len(self.bundle_indices):
            raise ValueError(f"Slot.bundle_indices={self.bundle_indices} lists a bundle twice")
        if len(self.gpu_ids) != len(self.bundle_indices):
            raise ValueError(
                f"gpu_ids has {len(self.gpu_ids)} entries but bundle_indices has {len(self.bundle_indices)}; "
                "give one GPU id per bundle"
            )
        if self.node_ips and len(self.node_ips) != len(self.bundle_indices):
            raise ValueError(
                f"node_ips has {len(self.node_ips)} entries but bundle_indices has {len(self.bundle_indices)}; "
                "give one node IP per bundle, or none"
            )
        if self.bundle_indices and self.pg is None:
            raise ValueError("a Slot with bundles needs its placement group: pass pg")

    def __len__(self) -> int:
        return len(self.bundle_indices)

    @property
    def num_gpus(self) -> int:
        """GPUs (bundles) in this slot."""
        return len(self.bundle_indices)

    def __repr__(self) -> str:
        pg = _short_id(self.pg)
        where = ", ".join(
            f"{b}:gpu{g}" + (f"@{self.node_ips[i]}" if self.node_ips else "")
            for i, (b, g) in enumerate(zip(self.bundle_indices, self.gpu_ids, strict=True))
        )
        return f"Slot(pg={pg}, bundles=[{where}])"


_EMPTY = Slot(None, (), ())


@dataclass(frozen=True, slots=True)
class Placements:
    """The slots of one run and the placement group behind them; `remove()` (or `with`) frees the GPUs."""

    layout: Layout
    """The counts and offsets the slots were cut from."""
    pg: PlacementGroup | None
    """The one placement group (None when the layout needs no GPUs)."""
    actor: Slot
    """Training bundles, positions `layout.train_gpus`."""
    critic: Slot | None
    """The very same object as `actor` when `use_critic`, else None."""
    rollout: Slot
    """Rollout-engine bundles, positions `layout.rollout_gpus` (starts at `rollout_offset`)."""
    eval: Slot = field(default=_EMPTY)
    """Evaluation-engine bundles, positions `layout.eval_gpus`."""

    def __post_init__(self) -> None:
        instance("layout", self.layout, Layout, "make it with compute_layout(spec)")
        for name in ("actor", "rollout", "eval"):
            instance(name, getattr(self, name), Slot)
        if self.critic is not None:
            instance("critic", self.critic, Slot)

    def remove(self) -> None:
        """Remove the placement group (frees its GPUs; actors still in it are killed by Ray)."""
        if self.pg is None:
            return
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        pg = _short_id(self.pg)
        critic = "actor's" if self.critic is self.actor else "None"
        return (
            f"Placements(case={self.layout.case}, num_gpus={self.layout.num_gpus}, pg={pg},\n"
            f"  actor={self.actor!r},\n  critic={critic},\n  rollout={self.rollout!r},\n  eval={self.eval!r})"
        )


def create_placement_groups(
    spec: PlacementSpec,
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    name: str = "",
    check_resources: bool = True,
) -> Placements:
    """Reserve the run's GPUs in one Ray placement group and cut it into per-role slots.

    Bundles are `{"GPU": 1, "CPU": 1}`, strategy PACK. Once the group is ready, one
    short-lived probe actor per bundle reports its node IP and GPU id, and the
    bundles are ordered by (node IP as numbers, GPU id), so consecutive ranks share
    nodes. A layout of zero GPUs creates no group at all. Needs `ray.init()` first.

    Before waiting, the cluster's total resources are compared with what the group
    needs: a cluster with fewer GPUs or CPUs in all raises `ClusterTooSmallError`
    (a `ValueError`) at once, with both numbers. Pass `check_resources=False` on a
    cluster whose autoscaler adds nodes on demand, to wait for them instead.

    Raises `PlacementTimeoutError` (a `TimeoutError`) when the group is not ready
    within `timeout_s` seconds (None: wait forever), saying how many GPUs were asked
    for and how many the cluster has, or when the probes then take longer than
    `timeout_s` again; the group is removed first.
    """
    instance("spec", spec, PlacementSpec, "build one with PlacementSpec(...)")
    timeout_s = timeout("timeout_s", timeout_s)
    instance("name", name, str)
    if not isinstance(check_resources, bool):
        raise TypeError(f"check_resources={check_resources!r} must be True or False")
    layout = compute_layout(spec)
    if layout.num_gpus == 0:
        return Placements(layout, None, _EMPTY, _EMPTY if spec.use_critic else None, _EMPTY)

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from ._probe import probe_bundles

    if not ray.is_initialized():
        raise RuntimeError("Ray is not running: call ray.init() (or ray.init(address=...)) first")
    if check_resources:
        _check_cluster_size(layout)
    pg = placement_group([dict(BUNDLE) for _ in range(layout.num_gpus)], strategy=STRATEGY, name=name)
    try:
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            raise PlacementTimeoutError(_not_ready_message(layout, timeout_s))
        ordered = order_bundles(probe_bundles(pg, layout.num_gpus, timeout_s=timeout_s))
    except BaseException:
        # Never leave a pending or half-probed group behind to hold (or later grab) GPUs.
        remove_placement_group(pg)
        raise
    actor = _slot(pg, ordered, layout.train_gpus)
    return Placements(
        layout=layout,
        pg=pg,
        actor=actor,
        critic=actor if spec.use_critic else None,
        rollout=_slot(pg, ordered, layout.rollout_gpus),
        eval=_slot(pg, ordered, layout.eval_gpus),
    )


def _short_id(pg: PlacementGroup | None) -> str:
    """First hex digits of the group's id, enough to tell groups apart in a repr."""
    if pg is None:
        return "None"
    pg_id = getattr(pg, "id", None)
    return pg_id.hex()[:8] if pg_id is not None else repr(pg)


def _slot(pg: PlacementGroup, ordered: Sequence[BundleLocation], positions: range) -> Slot:
    if not positions:
        return _EMPTY
    chosen = [ordered[p] for p in positions]
    return Slot(
        pg,
        tuple(b.bundle_index for b in chosen),
        tuple(b.gpu_id for b in chosen),
        tuple(b.node_ip for b in chosen),
    )


def _asked(layout: Layout) -> str:
    n = layout.num_gpus
    return (
        f"asked for {n} GPUs and {n} CPUs ({n} bundles {BUNDLE}, strategy {STRATEGY}, layout {layout.case}: "
        f"{layout.train_num_gpus} training, {layout.rollout_num_gpus} rollout, {layout.eval_num_gpus} eval)"
    )


_FIX = (
    "Add GPUs to the cluster, or lower actor_num_nodes, actor_num_gpus_per_node, rollout_num_gpus or "
    "eval_num_gpus (colocate=True shares the training GPUs)"
)


def _check_cluster_size(layout: Layout) -> None:
    """Fail at once when the whole cluster has fewer GPUs or CPUs than the group's bundles need."""
    import ray

    total = ray.cluster_resources()
    if all(total.get(key, 0.0) >= layout.num_gpus * amount for key, amount in BUNDLE.items()):
        return
    raise ClusterTooSmallError(
        f"the placement group cannot fit: {_asked(layout)}; the cluster has {_count(total, 'GPU')} GPUs and "
        f"{_count(total, 'CPU')} CPUs in all. {_FIX}; or pass check_resources=False when an autoscaler "
        "will add nodes"
    )


def _not_ready_message(layout: Layout, timeout_s: float | None) -> str:
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    return (
        f"the placement group was not ready after {timeout_s} s: {_asked(layout)}; the cluster has "
        f"{_count(total, 'GPU')} GPUs ({_count(free, 'GPU')} free) and {_count(total, 'CPU')} CPUs "
        f"({_count(free, 'CPU')} free). {_FIX}"
    )


def _count(resources: dict[str, float], key: str) -> str:
    value = resources.get(key, 0.0)
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
