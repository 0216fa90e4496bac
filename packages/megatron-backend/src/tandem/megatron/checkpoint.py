"""Megatron distributed checkpoints (torch_dist) with an atomic "latest" marker.

Layout of a checkpoint folder (`save` / `critic_save`)::

    iter_0000007/                      one complete checkpoint per saved rollout
    latest_checkpointed_iteration.txt  the rollout id of the newest complete one

A save writes every rank's shards into a staging folder `iter_X.partial`; only
when all ranks are done does rank 0 move it to `iter_X` and then replace the
marker (write a temporary file, fsync, `os.replace`). A crash at any point of a
save therefore leaves the marker on the previous complete checkpoint; a re-save
of the marker's own rollout moves the old folder aside (`iter_X.old`) first, and
a reader falls back to that folder if the crash hit between the two renames.

A checkpoint holds the model, the optimizer, the learning-rate scheduler, every
rank's RNG states and the rollout id; loading restores all of them.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

MARKER = "latest_checkpointed_iteration.txt"
"""Name of the marker file (Megatron's own name, so its tools find our checkpoints)."""

_COMPLETE_FILE = "metadata.json"  # dist_checkpointing writes it last, after every shard


def iteration_dir(root: str | os.PathLike[str], rollout_id: int) -> Path:
    """The folder of rollout `rollout_id`'s checkpoint under `root`."""
    return Path(root) / f"iter_{rollout_id:07d}"


def _staging_dir(root: str | os.PathLike[str], rollout_id: int) -> Path:
    return iteration_dir(root, rollout_id).with_suffix(".partial")


def _aside_dir(root: str | os.PathLike[str], rollout_id: int) -> Path:
    return iteration_dir(root, rollout_id).with_suffix(".old")


def read_latest(root: str | os.PathLike[str] | None) -> int | None:
    """Rollout id of the newest complete checkpoint under `root`; None when there is none."""
    if root is None:
        return None
    marker = Path(root) / MARKER
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(f"checkpoint marker {marker} holds {text!r}, not a rollout id") from None


def latest_dir(root: str | os.PathLike[str] | None) -> tuple[int, Path] | None:
    """(rollout id, folder) of the newest complete checkpoint under `root`, or None."""
    rollout_id = read_latest(root)
    if rollout_id is None or root is None:
        return None
    for folder in (iteration_dir(root, rollout_id), _aside_dir(root, rollout_id)):
        if (folder / _COMPLETE_FILE).is_file():
            return rollout_id, folder
    raise RuntimeError(
        f"checkpoint marker in {root} names rollout {rollout_id} but {iteration_dir(root, rollout_id)} "
        "is missing or incomplete; the folder was changed by hand"
    )


def begin_save(root: str | os.PathLike[str], rollout_id: int) -> Path:
    """Create an empty staging folder for rollout `rollout_id` (rank 0 only) and return it."""
    staging = _staging_dir(root, rollout_id)
    if staging.exists():
        shutil.rmtree(staging)  # left by a save that crashed
    staging.mkdir(parents=True)
    return staging


def commit_save(root: str | os.PathLike[str], rollout_id: int) -> Path:
    """Publish the complete staging folder of `rollout_id` and point the marker at it (rank 0 only)."""
    staging, final, aside = (
        _staging_dir(root, rollout_id),
        iteration_dir(root, rollout_id),
        _aside_dir(root, rollout_id),
    )
    if not (staging / _COMPLETE_FILE).is_file():
        raise RuntimeError(f"{staging} is not a complete checkpoint (no {_COMPLETE_FILE})")
    if final.exists():
        # Re-saving a rollout: the marker may point at `final`; keep it readable as `aside`.
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
    os.replace(staging, final)
    _fsync_dir(Path(root))
    _write_marker(Path(root), rollout_id)
    if aside.exists():
        shutil.rmtree(aside)
    return final


def _write_marker(root: Path, rollout_id: int) -> None:
    tmp = root / f"{MARKER}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{rollout_id}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MARKER)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- what a checkpoint holds ----------------------------------------------------------


@dataclass
class TrainState:
    """The objects a checkpoint saves and restores on one rank.

    Attributes:
        model: the model chunks (DDP-wrapped modules; `.module` has `sharded_state_dict`).
        optimizer: the Megatron optimizer.
        scheduler: Megatron's OptimizerParamScheduler.
        sharding_metadata: Megatron's sharded_state_dict metadata (optimizer sharding type, groups).
    """

    model: Sequence[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    sharding_metadata: dict[str, Any]


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {
        "random": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state_dict(state: TrainState, *, is_loading: bool, rollout_id: int) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model_sd: dict[str, Any] = {}
    for i, chunk in enumerate(state.model):
        module: Any = getattr(chunk, "module", chunk)
        key = "model" if len(state.model) == 1 else f"model{i}"
        model_sd[key] = module.sharded_state_dict(metadata=state.sharding_metadata)
    flat_model_sd: dict[str, Any] = {}
    for sd in model_sd.values():
        flat_model_sd.update(sd)
    return {
        **model_sd,
        "optimizer": state.optimizer.sharded_state_dict(
            flat_model_sd, is_loading=is_loading, metadata=state.sharding_metadata
        ),
        "opt_param_scheduler": state.scheduler.state_dict(),
        "rollout_id": rollout_id,
        # Each rank's RNG differs; one shard per rank, restored on the same topology.
        "rng_state": ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0),
    }


def save_checkpoint(
    root: str | os.PathLike[str], rollout_id: int, state: TrainState, *, barrier: Callable[[], None]
) -> Path:
    """Save `state` as rollout `rollout_id`'s checkpoint under `root` (every rank of the model calls it).

    `barrier` synchronises all ranks of the model (e.g. `torch.distributed.barrier`).
    Returns the published folder.
    """
    from megatron.core import dist_checkpointing

    rank = torch.distributed.get_rank()
    if rank == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        begin_save(root, rollout_id)
    barrier()
    staging = _staging_dir(root, rollout_id)
    sharded = _sharded_state_dict(state, is_loading=False, rollout_id=rollout_id)
    dist_checkpointing.save(sharded, str(staging))
    barrier()
    if rank == 0:
        commit_save(root, rollout_id)
        logger.info("saved checkpoint of rollout %d to %s", rollout_id, iteration_dir(root, rollout_id))
    barrier()
    return iteration_dir(root, rollout_id)


def load_checkpoint(root: str | os.PathLike[str] | None, state: TrainState) -> int | None:
    """Restore `state` from the newest complete checkpoint under `root`; its rollout id, or None if none."""
    from megatron.core import dist_checkpointing

    found = latest_dir(root)
    if found is None:
        return None
    rollout_id, folder = found
    template = _sharded_state_dict(state, is_loading=True, rollout_id=rollout_id)
    loaded = dist_checkpointing.load(template, str(folder))
    for i, chunk in enumerate(state.model):
        chunk.load_state_dict(loaded["model" if len(state.model) == 1 else f"model{i}"], strict=True)
    state.optimizer.load_state_dict(loaded["optimizer"])
    # The scheduler adds the saved step count to its own; count from 0 when loading in place.
    state.scheduler.num_steps = 0
    state.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    _set_rng_state(loaded["rng_state"])
    if int(loaded["rollout_id"]) != rollout_id:
        raise RuntimeError(f"{folder} holds rollout {loaded['rollout_id']}, the marker says {rollout_id}")
    logger.info("loaded checkpoint of rollout %d from %s", rollout_id, folder)
    return rollout_id
