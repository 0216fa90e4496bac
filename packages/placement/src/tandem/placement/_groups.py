"""Ray placement groups for actor, critic, rollout and eval: one PACK group, bundles ordered by node and GPU.

Ray is imported inside the functions that use it, so that `import tandem.placement`
stays light (the layout math is used where Ray is not running).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Self

from ._bundles import BundleLocation, order_bundles
from ._errors import PlacementTimeoutError
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
    spec: PlacementSpec, *, timeout_s: float | None = DEFAULT_TIMEOUT_S, name: str = ""
) -> Placements:
    """Reserve the run's GPUs in one Ray placement group and cut it into per-role slots.

    Bundles are `{"GPU": 1, "CPU": 1}`, strategy PACK. Once the group is ready, one
    short-lived probe actor per bundle reports its node IP and GPU id, and the
    bundles are ordered by (node IP as numbers, GPU id), so consecutive ranks share
    nodes. A layout of zero GPUs creates no group at all. Needs `ray.init()` first.

    Raises `PlacementTimeoutError` (a `TimeoutError`) when the group is not ready
    within `timeout_s` seconds (None: wait forever), saying how many GPUs were asked
    for and how many the cluster has, or when the probes then take longer than
    `timeout_s` again; the group is removed first.
    """
    layout = compute_layout(spec)
    if layout.num_gpus == 0:
        return Placements(layout, None, _EMPTY, _EMPTY if spec.use_critic else None, _EMPTY)

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from ._probe import probe_bundles

    if not ray.is_initialized():
        raise RuntimeError("Ray is not running: call ray.init() (or ray.init(address=...)) first")
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


def _not_ready_message(layout: Layout, timeout_s: float | None) -> str:
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    n = layout.num_gpus
    return (
        f"the placement group was not ready after {timeout_s} s: asked for {n} GPUs and {n} CPUs "
        f"({n} bundles {BUNDLE}, strategy {STRATEGY}, layout {layout.case}: {layout.train_num_gpus} training, "
        f"{layout.rollout_num_gpus} rollout, {layout.eval_num_gpus} eval); the cluster has "
        f"{_count(total, 'GPU')} GPUs ({_count(free, 'GPU')} free) and {_count(total, 'CPU')} CPUs "
        f"({_count(free, 'CPU')} free). Add GPUs to the cluster, or lower actor_num_nodes, "
        "actor_num_gpus_per_node, rollout_num_gpus or eval_num_gpus (colocate=True shares the training GPUs)"
    )


def _count(resources: dict[str, float], key: str) -> str:
    value = resources.get(key, 0.0)
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
