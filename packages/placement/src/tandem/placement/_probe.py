"""Short-lived probe actors that report where each bundle of a placement group landed.

Imports Ray at module level, so only functions that already need Ray import this module.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ._bundles import BundleLocation
from ._errors import PlacementTimeoutError

# A sliver of the bundle's GPU: enough for Ray to assign the bundle's GPU id to the
# probe, small enough that it never holds up the real actors while it is being killed.
_PROBE_GPU_SHARE = 0.01


@ray.remote(num_cpus=0, num_gpus=_PROBE_GPU_SHARE)
class _BundleProbe:
    """Reports the node and GPU of the bundle it was scheduled on."""

    def location(self) -> tuple[str, str, list[int | str]]:
        return (
            ray.util.get_node_ip_address(),
            ray.get_runtime_context().get_node_id(),
            list(ray.get_gpu_ids()),
        )


def probe_bundles(pg: PlacementGroup, num_bundles: int, *, timeout_s: float | None) -> list[BundleLocation]:
    """Start one probe actor per bundle of a ready group, read its location, kill it.

    Raises `PlacementTimeoutError` when the probes have not all reported within `timeout_s`.
    """
    probes = [
        _BundleProbe.options(  # type: ignore[attr-defined]
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index
            )
        ).remote()
        for index in range(num_bundles)
    ]
    try:
        reports = ray.get([probe.location.remote() for probe in probes], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise PlacementTimeoutError(
            f"the {num_bundles} probe actors (one per bundle, to find each bundle's node and GPU) did not "
            f"all start within {timeout_s} s; check that Ray can start worker processes on every node "
            "(`ray status`, the raylet logs), or raise timeout_s"
        ) from None
    finally:
        for probe in probes:
            ray.kill(probe)
    return [
        BundleLocation(bundle_index=index, node_ip=ip, gpu_id=_one_gpu_id(index, gpu_ids), node_id=node_id)
        for index, (ip, node_id, gpu_ids) in enumerate(reports)
    ]


def _one_gpu_id(bundle_index: int, gpu_ids: list[int | str]) -> int:
    if len(gpu_ids) != 1:
        raise RuntimeError(
            f"bundle {bundle_index}: Ray assigned GPU ids {gpu_ids} to its probe, expected exactly one; "
            "each bundle must hold {'GPU': 1}"
        )
    try:
        return int(gpu_ids[0])
    except ValueError:
        raise RuntimeError(
            f"bundle {bundle_index}: Ray reported GPU id {gpu_ids[0]!r}, not an index; "
            "set CUDA_VISIBLE_DEVICES to GPU indices, not UUIDs, on the Ray nodes"
        ) from None
