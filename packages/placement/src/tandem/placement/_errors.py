"""The errors placement raises beyond ValueError, in a module of their own so every other module can raise them."""

from __future__ import annotations


class PlacementTimeoutError(TimeoutError):
    """The cluster did not provide the placement group's bundles in time."""


class ClusterTooSmallError(ValueError):
    """The whole cluster has fewer GPUs or CPUs than the layout's bundles need; waiting would not help."""
