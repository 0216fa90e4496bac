"""Megatron distributed checkpoints (torch_dist) of one model: what they hold, saving and loading.

A checkpoint holds the model, the optimizer, the learning-rate scheduler, every
rank's RNG states and the rollout id; loading restores all of them, from the
newest complete checkpoint or from a given rollout's (`load_checkpoint(...,
rollout_id=k)`: a run's driver resumes every model from the same rollout).
The folder layout and the crash-safe save protocol (a staging folder, an atomic
"latest" marker) are `checkpoint_folder`'s, whose names are re-exported here.

Saves are synchronous, written by threads of the saving process
(`in_process_write_results`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.megatron.runtime.checkpoint_folder import (
    MARKER,
    begin_save,
    commit_save,
    complete_rollouts,
    incomplete_parts,
    iteration_dir,
    latest_dir,
    point_marker_at,
    read_latest,
    save_folder,
)
from tandem.megatron.runtime.checkpoint_manifest import verify_checkpoint
from tandem.megatron.worker.optimizer import inner_torch_optimizers, optimizer_parts

__all__ = [
    "MARKER",
    "TrainState",
    "begin_save",
    "commit_save",
    "complete_rollouts",
    "in_process_write_results",
    "incomplete_parts",
    "iteration_dir",
    "latest_dir",
    "load_checkpoint",
    "point_marker_at",
    "read_latest",
    "save_checkpoint",
    "save_folder",
]

logger = logging.getLogger(__name__)


# --- what a checkpoint holds ----------------------------------------------------------


@dataclass
class TrainState:
    """The objects a checkpoint saves and restores on one rank.

    Attributes:
        model: the model chunks (DDP-wrapped modules; `.module` has `sharded_state_dict`).
        optimizer: the Megatron optimizer.
        scheduler: Megatron's OptimizerParamScheduler.
        sharding_metadata: Megatron's sharded_state_dict metadata (optimizer sharding type, groups).
        trained_only: the model's part of a checkpoint holds only the parameters that train (a
            LoRA model: its adapters and the critic's value head); the frozen base is the Hugging
            Face folder's, loaded at start-up, and never saved.
        optimizer_region: the memory region the optimizer's state is created in (the worker's
            backend's, so that a sleep moves or releases it), entered where a load creates that state.
    """

    model: Sequence[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    sharding_metadata: dict[str, Any]
    trained_only: bool = False
    optimizer_region: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext


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


def _sharded_state_dict(
    state: TrainState, *, is_loading: bool, rollout_id: int, with_optimizer: bool = True
) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model_sd: dict[str, Any] = {}
    for i, chunk in enumerate(state.model):
        module: Any = getattr(chunk, "module", chunk)
        key = "model" if len(state.model) == 1 else f"model{i}"
        sharded = module.sharded_state_dict(metadata=state.sharding_metadata)
        if state.trained_only:
            trained = _trained_names(module)
            sharded = {k: v for k, v in sharded.items() if k in trained}
        model_sd[key] = sharded
    flat_model_sd: dict[str, Any] = {}
    for sd in model_sd.values():
        flat_model_sd.update(sd)
    optimizer = (
        {
            "optimizer": state.optimizer.sharded_state_dict(
                flat_model_sd, is_loading=is_loading, metadata=state.sharding_metadata
            )
        }
        if with_optimizer
        else {}
    )
    return {
        **model_sd,
        **optimizer,
        "opt_param_scheduler": state.scheduler.state_dict(),
        "rollout_id": rollout_id,
        # Each rank's RNG differs; one shard per rank, restored on the same topology.
        "rng_state": ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0),
    }


def _trained_names(module: torch.nn.Module) -> set[str]:
    return {name for name, param in module.named_parameters() if param.requires_grad}


def _load_model_part(chunk: torch.nn.Module, loaded: dict[str, Any], *, trained_only: bool) -> None:
    """Copy a checkpoint's model part into `chunk`; a trained-only part must hold every trained parameter."""
    if not trained_only:
        chunk.load_state_dict(loaded, strict=True)
        return
    module: Any = getattr(chunk, "module", chunk)
    missing, unexpected = module.load_state_dict(loaded, strict=False)
    absent = sorted(set(missing) & _trained_names(module))
    if absent or unexpected:
        raise RuntimeError(
            f"the checkpoint does not match the LoRA model: missing {absent[:5]}, unexpected {list(unexpected)[:5]} "
            "(was it saved with other LoRA settings, or without LoRA?)"
        )


def in_process_write_results() -> bool:
    """Let Megatron's synchronous save collect its writers' results in this process; whether it does.

    Megatron's torch_dist writer hands each save's write results over a queue that it makes once per
    process, as a `multiprocessing` Manager of the spawn context: a server process, a fresh interpreter
    that imports the main module and torch (about 10 s on a small CPU machine, more than a small
    model's whole save, paid by every actor and critic process at its first save). A synchronous save
    runs its writers as threads of the saving process (`execute_sync`), so a thread-safe
    `queue.Queue` serves the same. Set before the first save through megatron-core's module attribute
    `filesystem_async._results_queue` (megatron-core is bounded in pyproject.toml); where a release
    has no such attribute, nothing changes and saves keep Megatron's own queue. Asynchronous saves,
    which Tandem does not make, would need Megatron's.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        return False
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    return isinstance(filesystem_async._results_queue, queue.Queue)


def save_checkpoint(
    root: str | os.PathLike[str], rollout_id: int, state: TrainState, *, barrier: Callable[[], None]
) -> Path:
    """Save `state` as rollout `rollout_id`'s checkpoint under `root` (every rank of the model calls it).

    `barrier` synchronises all ranks of the model (e.g. `torch.distributed.barrier`).
    Returns the published folder.
    """
    from megatron.core import dist_checkpointing

    in_process_write_results()

    # A model that has taken no optimizer step yet (the actor in the critic-only warm-up) has no optimizer
    # state to save; megatron-core's distributed optimizer cannot even describe it (its state_dict()
    # asserts one step count over its parameters' states).
    stepped = optimizer_has_state(state.optimizer)

    def write(staging: Path) -> None:
        sharded = _sharded_state_dict(state, is_loading=False, rollout_id=rollout_id, with_optimizer=stepped)
        dist_checkpointing.save(sharded, str(staging))

    return save_folder(root, rollout_id, write, rank=torch.distributed.get_rank(), barrier=barrier)


def optimizer_has_state(optimizer: Any) -> bool:
    """Whether `optimizer` (a Megatron optimizer, chained or not) holds per-parameter state: it has stepped."""
    return any(len(inner.state) > 0 for inner in inner_torch_optimizers(optimizer))


def allocate_optimizer_state(optimizer: Any) -> None:
    """Give each distributed optimizer of `optimizer` that holds no state yet its per-parameter state
    (zeros, step 0), for a checkpoint's optimizer state to load into.

    A process that has taken no step (a run resumed from its checkpoint) holds none, and megatron-core's
    `DistributedOptimizer.sharded_state_dict(is_loading=True)` builds its template from its own
    `state_dict()`, which without Apex or Transformer Engine reads the one step count of the torch
    optimizer's per-parameter states and asserts there is exactly one. The moments come from the
    optimizer's own `init_state_fn` (Adam's `exp_avg`, `exp_avg_sq`), the step count as torch's Adam keeps
    it; the load then overwrites all of them in place. The plain optimizer (the CPU's) initialises its state
    itself when it loads.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for part in optimizer_parts(optimizer):
        if not isinstance(part, DistributedOptimizer) or len(part.optimizer.state) > 0:
            continue
        part.init_state_fn(part.optimizer, part.config)
        for group in part.optimizer.param_groups:
            for param in group["params"]:
                part.optimizer.state[param].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def _holds_optimizer_state(folder: Path) -> bool:
    """Whether the checkpoint in `folder` holds optimizer state tensors (Adam's moments): a model saves
    them once it has taken an optimizer step."""
    from megatron.core import dist_checkpointing

    return any(key.startswith("optimizer.") for key in dist_checkpointing.load_tensors_metadata(str(folder)))


def load_checkpoint(
    root: str | os.PathLike[str] | None, state: TrainState, *, rollout_id: int | None = None
) -> int | None:
    """Restore `state` from a complete checkpoint under `root`; its rollout id, or None if there is none.

    `rollout_id`: that rollout's checkpoint (RuntimeError when it is not complete under
    `root`); None: the newest complete one (the marker's).
    """
    from megatron.core import dist_checkpointing

    if rollout_id is None:
        found = latest_dir(root)
        if found is None:
            return None
        rollout_id, folder = found
    else:
        complete = complete_rollouts(root)
        if rollout_id not in complete:
            raise RuntimeError(
                f"no complete checkpoint of rollout {rollout_id} under {root} (complete: {sorted(complete)})"
            )
        folder = complete[rollout_id]
    # A file of another size than its save recorded (a shard truncated to 0 bytes) is named here, not
    # as the EOFError of the load; the driver checks sizes and checksums before a run starts.
    problem = verify_checkpoint(folder, checksums=False)
    if problem is not None:
        raise RuntimeError(f"the checkpoint of rollout {rollout_id} in {folder} does not read: {problem}")
    try:
        # A model saved before its first optimizer step (the actor during the critic-only warm-up) has no
        # optimizer state to restore: its optimizer starts fresh, as it was. (Building the loading
        # template would create Adam's moments without their step count.)
        stepped = _holds_optimizer_state(folder)
        if stepped:
            with state.optimizer_region():
                allocate_optimizer_state(state.optimizer)
        template = _sharded_state_dict(state, is_loading=True, rollout_id=rollout_id, with_optimizer=stepped)
        loaded = dist_checkpointing.load(template, str(folder))
    except Exception as exc:
        detail = " ".join(str(exc).split())[-300:]
        raise RuntimeError(
            f"the checkpoint of rollout {rollout_id} in {folder} does not load ({type(exc).__name__}: {detail}); "
            "a start of the run sets it aside and resumes from the one before"
        ) from exc
    for i, chunk in enumerate(state.model):
        part = loaded["model" if len(state.model) == 1 else f"model{i}"]
        _load_model_part(chunk, part, trained_only=state.trained_only)
    if stepped:
        state.optimizer.load_state_dict(loaded["optimizer"])
    # The scheduler adds the saved step count to its own; count from 0 when loading in place.
    state.scheduler.num_steps = 0
    state.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    _set_rng_state(loaded["rng_state"])
    if int(loaded["rollout_id"]) != rollout_id:
        raise RuntimeError(f"{folder} holds rollout {loaded['rollout_id']}, the marker says {rollout_id}")
    logger.info("loaded checkpoint of rollout %d from %s", rollout_id, folder)
    return rollout_id
