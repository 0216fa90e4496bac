"""GPU layout and Ray placement groups for an actor, a critic sharing its GPUs, and a rollout engine.

`PlacementSpec` and `compute_layout` are pure Python; `create_placement_groups`,
`scheduling_options` and `GpuShares` import Ray only when called, so importing
this package imports neither Ray nor torch.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from ._bundles import BundleLocation, order_bundles
from ._colocation import GpuShares, colocation_options, scheduling_options
from ._errors import ClusterTooSmallError, PlacementTimeoutError
from ._groups import BUNDLE, STRATEGY, Placements, Slot, create_placement_groups
from ._layout import Layout, LayoutCase, compute_layout
from ._spec import PlacementSpec

try:
    __version__ = _version("tandem-placement")
except PackageNotFoundError:  # source tree on PYTHONPATH (the offline GPU host), not installed
    __version__ = "0+unknown"

__all__ = [
    "BUNDLE",
    "STRATEGY",
    "BundleLocation",
    "ClusterTooSmallError",
    "GpuShares",
    "Layout",
    "LayoutCase",
    "PlacementSpec",
    "PlacementTimeoutError",
    "Placements",
    "Slot",
    "__version__",
    "colocation_options",
    "compute_layout",
    "create_placement_groups",
    "order_bundles",
    "scheduling_options",
]
