"""Critic values to actor ranks through the Ray object store, with no NCCL channel between the models.

The critic's pipeline-last-stage ranks pack their values (`pack_values`, one
`ray.put` each) and return the small `Box`; the driver routes one payload per actor
rank (`route_per_rank` when actor and critic share a topology, `route_by_sample`
when their data-parallel splits differ); each actor rank checks the topology
contract (`values_for_rank`) and fetches its values (`unpack_values`, one `ray.get`).
See docs/design.md, "One PPO step", steps 3 and 4.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from tandem.value_transfer._box import Box
from tandem.value_transfer._packed import PackedValues
from tandem.value_transfer._rank_routing import route_per_rank, values_for_rank
from tandem.value_transfer._sample_routing import IndexedValues, SampleGather, route_by_sample
from tandem.value_transfer._transfer import pack_indexed_values, pack_values, unpack_values

try:
    __version__ = _version("tandem-value-transfer")
except PackageNotFoundError:  # source tree on PYTHONPATH (the offline GPU host), not installed
    __version__ = "0+unknown"

__all__ = [
    "Box",
    "IndexedValues",
    "PackedValues",
    "SampleGather",
    "__version__",
    "pack_indexed_values",
    "pack_values",
    "route_by_sample",
    "route_per_rank",
    "unpack_values",
    "values_for_rank",
]
