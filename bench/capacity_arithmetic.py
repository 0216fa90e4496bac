"""The capacity bench's arithmetic: `tandem.ppo.app.capacity`, which `ppo-driver train --dry-run` prints for a run.

The bench (`capacity_bench.py`) prints `estimate` beside each measured row, and stands alone for a
shape too big to try; the terms and the limits (the H200's 140 GiB, the host's 128 GiB and the
64 GiB disk of the lent H200 host) are in that module's docstring.
"""

from __future__ import annotations

from tandem.ppo.app.capacity import (
    BF16,
    DISK_GIB,
    FULL_BYTES_ASLEEP,
    FULL_BYTES_AWAKE,
    GIB,
    GPU_GIB,
    HOST_GIB,
    HOST_RESERVED_GIB,
    LORA_TARGETS,
    Estimate,
    Work,
    activations_gib,
    critic_params,
    estimate,
    lora_params,
    policy_params,
)

__all__ = [
    "BF16",
    "DISK_GIB",
    "FULL_BYTES_ASLEEP",
    "FULL_BYTES_AWAKE",
    "GIB",
    "GPU_GIB",
    "HOST_GIB",
    "HOST_RESERVED_GIB",
    "LORA_TARGETS",
    "Estimate",
    "Work",
    "activations_gib",
    "critic_params",
    "estimate",
    "lora_params",
    "policy_params",
]
