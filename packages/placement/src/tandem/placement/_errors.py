"""The errors placement raises beyond ValueError, in a module of their own so every other module can raise them."""

from __future__ import annotations


class PlacementTimeoutError(TimeoutError):
    """The cluster did not provide the placement group's bundles in time."""
