"""The machine a command runs on: without a GPU, the settings a CPU run needs, chosen and said in one line.

On a machine without CUDA GPUs (and no Ray cluster to join, whose GPUs are not
this machine's), `train`, `demo` and `eval` need a local Ray cluster with logical
GPUs, the CPU device and float32 weights; `cpu_settings` fills in exactly those,
and the command logs one line naming the flags it set, so a CPU run needs none of
`--local-gpus 1 --device cpu --params-dtype float32`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any

from tandem.placement import compute_layout
from tandem.ppo.config.fields import flag
from tandem.ppo.config.ppo_config import PPOConfig

__all__ = [
    "adapt_to_machine",
    "cpu_settings",
    "describe_changes",
    "eval_local_gpus",
    "has_local_gpu",
    "joins_a_cluster",
]

# The name its lines show on the terminal, kept from before the layers.
logger = logging.getLogger("tandem.ppo.machine")


def has_local_gpu() -> bool:
    """Whether torch sees a CUDA GPU on this machine."""
    import torch

    return bool(torch.cuda.is_available())


def joins_a_cluster(ray_address: str | None) -> bool:
    """Whether the command joins a running Ray cluster (`--ray-address` or `RAY_ADDRESS`)."""
    return bool(ray_address or os.environ.get("RAY_ADDRESS"))


def cpu_settings(config: PPOConfig) -> dict[str, Any]:
    """The fields a run of `config` on a machine without GPUs needs changed (nothing already right)."""
    changes: dict[str, Any] = {}
    if config.device == "auto":
        changes["device"] = "cpu"
    if config.device in ("auto", "cpu") and config.params_dtype == "bfloat16":
        changes["params_dtype"] = "float32"  # bfloat16 training is GPU-only
    if config.device in ("auto", "cpu") and config.offload_backend == "torch_memory_saver":
        changes["offload_backend"] = "pinned_host"
    if config.local_gpus is None:
        with contextlib.suppress(ValueError):  # a bad GPU count: validate() names its flag
            changes["local_gpus"] = max(1, compute_layout(config.placement_spec()).num_gpus)
    return changes


def describe_changes(changes: dict[str, Any]) -> str:
    """The flags of `changes` as a command line would give them."""
    return " ".join(f"{flag(name)} {value}" for name, value in changes.items())


def adapt_to_machine(config: PPOConfig) -> tuple[PPOConfig, dict[str, Any]]:
    """`config` as this machine runs it, and what changed: nothing with a GPU or a cluster, else `cpu_settings`."""
    if joins_a_cluster(config.ray_address) or config.device == "cuda" or has_local_gpu():
        return config, {}
    changes = cpu_settings(config)
    return dataclasses.replace(config, **changes), changes


def announce(changes: dict[str, Any]) -> None:
    """The one log line that says a run is on the CPU and which flags were set for it (none: nothing)."""
    if changes:
        logger.info("no GPU on this machine: a CPU run (%s)", describe_changes(changes))


def eval_local_gpus(local_gpus: int | None) -> int | None:
    """`ppo-driver eval`'s logical GPUs: as given, else 1 on a machine without GPUs (and no cluster)."""
    if local_gpus is not None or joins_a_cluster(None) or has_local_gpu():
        return local_gpus
    logger.info("no GPU on this machine: the engine runs on the CPU (--local-gpus 1)")
    return 1
