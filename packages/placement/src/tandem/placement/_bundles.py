"""Bundle ordering: where each bundle landed, and the (node IP, GPU id) order ranks follow."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ._arguments import count, type_name


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

    def __post_init__(self) -> None:
        count("bundle_index", self.bundle_index)
        count("gpu_id", self.gpu_id)
        if not isinstance(self.node_id, str):
            raise TypeError(
                f"node_id={self.node_id!r} must be a string (Ray's node id), got {type_name(self.node_id)}"
            )
        if not isinstance(self.node_ip, str):
            raise TypeError(f"node_ip={self.node_ip!r} must be a string, got {type_name(self.node_ip)}")
        if not _is_ip(self.node_ip) and not _is_hostname(self.node_ip):
            raise ValueError(
                f"node_ip={self.node_ip!r} is neither an IP address nor a host name; give the node's address "
                "as Ray reports it (ray.util.get_node_ip_address())"
            )

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
    contiguous instead of interleaving their GPUs. Two locations with one bundle
    index, or on one GPU of one node, are a ValueError: each bundle holds its own GPU.
    """
    if isinstance(locations, str | bytes | Mapping) or not isinstance(locations, Iterable):
        raise TypeError(f"locations must be an iterable of BundleLocation, got {type_name(locations)}")
    listed = list(locations)
    for i, location in enumerate(listed):
        if not isinstance(location, BundleLocation):
            raise TypeError(f"locations[{i}] is a {type_name(location)}, not a BundleLocation")
    for what, key in (
        ("bundle index", lambda b: b.bundle_index),
        ("GPU", lambda b: (b.node_ip, b.node_id, b.gpu_id)),
    ):
        seen: dict[object, int] = {}
        for i, location in enumerate(listed):
            if key(location) in seen:
                raise ValueError(
                    f"locations[{seen[key(location)]}] and locations[{i}] have the same {what} "
                    f"({location}); each bundle of a placement group is on a GPU of its own"
                )
            seen[key(location)] = i
    return sorted(listed, key=BundleLocation.sort_key)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _is_hostname(text: str) -> bool:
    labels = text.split(".")
    # All-numeric labels are an IP address gone wrong ("999.1.1.1", "10.0.0"), not a host name.
    if len(text) > 253 or all(label.isdigit() for label in labels):
        return False
    return all(_LABEL.fullmatch(label) for label in labels)
