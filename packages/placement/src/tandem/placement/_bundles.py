"""Bundle ordering: where each bundle landed, and the (node IP, GPU id) order ranks follow."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BundleLocation:
    """Where one bundle of a placement group landed, as its probe actor saw it."""

    bundle_index: int
    """Index of the bundle in the placement group (the order Ray was given)."""
    node_ip: str
    """IP address of the node holding the bundle."""
    gpu_id: int
    """GPU id Ray assigned to the bundle on that node."""
    node_id: str = ""
    """Ray node id; only separates nodes that share an IP (several raylets on one host)."""

    def sort_key(self) -> tuple[int, int, str, str, int]:
        """Key that orders bundles by node IP *as numbers*, then node, then GPU id.

        Numbers, not text: as text "10.0.0.10" sorts before "10.0.0.9", which would
        put node 10's GPUs before node 9's and scramble which ranks share a node.
        """
        try:
            address = ipaddress.ip_address(self.node_ip)
        except ValueError:
            # Not an IP (a hostname): after every address, in text order.
            return (99, 0, self.node_ip, self.node_id, self.gpu_id)
        return (address.version, int(address), "", self.node_id, self.gpu_id)


def order_bundles(locations: Iterable[BundleLocation]) -> list[BundleLocation]:
    """Bundles sorted by (node IP as numbers, node id, GPU id): position i is rank i's GPU.

    The node id sits between IP and GPU id so that nodes sharing an IP stay
    contiguous instead of interleaving their GPUs.
    """
    return sorted(locations, key=BundleLocation.sort_key)
