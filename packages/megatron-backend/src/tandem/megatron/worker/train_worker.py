"""The train worker, process side: one rank of the actor or of the critic, inside its Ray actor process.

`TrainWorker` owns the mechanism (docs/design.md, "The driver owns the plan"):
`train` wakes the model when it is asleep and never sleeps afterwards,
`save_model` never sleeps or wakes, and `sleep` / `wake_up` run the lifecycle
that the driver asks for, of every memory tag or of some (`memory.WorkerMemory`);
what `init` does to the process around building the trainee is `startup`'s, and
the weight export's sending is `weight_export`'s, and the figures it reports about itself
(memory, lifecycle timings, process groups) are `figures.WorkerFigures`'. This module imports Megatron:
only worker processes import it. The driver starts workers through
`group.create_train_group`, which never does.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from tandem.lifecycle import forget_all, make_backend
from tandem.megatron.batch import TARGETS, RolloutBatch, resolve_batch
from tandem.megatron.choices import Role
from tandem.megatron.config import WorkerConfig
from tandem.megatron.models._cpu_compat import enable_cpu_compat
from tandem.megatron.models._megatron_core import import_megatron_core
from tandem.megatron.payloads import ActorLogProbs, CriticValues, TrainResult
from tandem.megatron.runtime.fault_points import set_context as set_fault_context
from tandem.megatron.runtime.gpu_memory import AllocatorCalls, device_used_bytes
from tandem.megatron.worker import roles
from tandem.megatron.worker._trainee import BASE, PASSES, WEIGHTS, Trainee, build_trainee
from tandem.megatron.worker.checkpoint import load_checkpoint, save_checkpoint
from tandem.megatron.worker.figures import WorkerFigures
from tandem.megatron.worker.memory import WorkerMemory
from tandem.megatron.worker.parallel import destroy_distributed, free_port
from tandem.megatron.worker.startup import (
    build_lifecycle,
    clear_caches,
    gpu_start,
    join_world,
    keep_tensor_pickles_portable,
    resolve_device,
)
from tandem.megatron.worker.train_clock import CALL, TrainClock
from tandem.megatron.worker.weight_export import WeightReceiver, send_weights

__all__ = ["TrainWorker", "WeightReceiver"]

mpu = import_megatron_core().parallel_state

logger = logging.getLogger(__name__)


class TrainWorker(WorkerFigures):
    """One rank of the actor or the critic: trains, sleeps and wakes, saves and loads, exports weights.

    Used as a Ray actor (`create_train_group` starts a group). Call order:
    `master_address()` on rank 0, then `init(...)` on every rank, then any of
    `train`, `compute_log_probs`, `sleep`, `wake_up`, `save_model`, `load_model`,
    `update_weights`. `sleep` and `wake_up` take some of `memory_tags()` or all.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        # Once per process: a Ray actor runs every method in the thread that built it.
        enable_cpu_compat()
        self.rank = rank
        self.world_size = world_size
        self._trainee: Trainee | None = None
        self._lifecycle: Any = None
        self._memory: WorkerMemory | None = None
        self._backend: Any = None
        self._group: Any = None
        self._gpu_start: dict[str, int | None] = {}
        self._last_targets: dict[str, Any] = {}
        self._at_step: list[str] = []
        """`keep_asleep_for_passes`' tags."""

    # --- setup ---------------------------------------------------------------------------
    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0's rendezvous store."""
        return ray.util.get_node_ip_address(), free_port()

    def init(self, config: WorkerConfig, role: Role, master_addr: str, master_port: int) -> int:
        """Join the role's world, build the model and optimizer, load the latest checkpoint or the HF weights.

        Returns the rollout id to start from: the loaded checkpoint's plus one, else 0.
        """
        config.check_role(role)
        config.check_world(self.world_size, role=role)
        set_fault_context(role=role, rank=self.rank)
        on_gpu = resolve_device(config) == "cuda"
        device_before_context = device_used_bytes() if on_gpu else None
        self.config, self.role = config, role
        backend = self._backend = make_backend(config.offload_backend)
        self._group = join_world(config, role, self.rank, self.world_size, master_addr, master_port)
        if on_gpu:
            self._gpu_start = gpu_start(device_before_context)
        elif config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self._trainee = build_trainee(config, role, backend, on_gpu=on_gpu)
        keep_tensor_pickles_portable()
        tags = self._trainee.register(backend)
        self._lifecycle = build_lifecycle(backend, tags, config)
        self._memory = WorkerMemory(
            self._lifecycle, tags, self._trainee.weight_tags, self._trainee.state_nbytes
        )
        loaded = self.load_model()
        self._memory.record_state()
        clear_caches()  # the objects of start-up are frozen before the first sleep
        return 0 if loaded is None else loaded + 1

    # --- training --------------------------------------------------------------------------
    def train(
        self,
        rollout_id: int,
        data_ref: Any,
        *,
        critic: CriticValues | None = None,
        log_probs: ActorLogProbs | None = None,
        kl_coef: float | None = None,
    ) -> TrainResult:
        """Train on this rank's share of a rollout; wakes the model first if asleep, never sleeps after.

        Args:
            rollout_id: the rollout being trained on (logs; seeds the minibatch shuffling).
            data_ref: this rank's `RolloutBatch`, an ObjectRef or `Box` of it, or a
                list with one of those per data-parallel rank (this rank takes its own).
            critic: the actor's: this rank's old values from the critic (`TrainGroup.train`
                routes them), None when the run has no critic (values are 0).
            log_probs: the actor's: in the KL-first plan this rank's own
                `compute_log_probs` record, which is then reused. The critic's: with
                `kl_coef != 0`, the actor's record for this rank (required); ignored otherwise.
            kl_coef: this step's reward-level KL coefficient, the same for both roles (the adaptive
                KL controller's, `kl_target`); None: the config's `kl_coef`.

        Returns:
            A `TrainResult`: the metrics, the same on every rank; the allocator calls this
            rank made on CUDA (`alloc/device_mallocs`, `alloc/device_frees`;
            `gpu_memory.AllocatorCalls`, empty on CPU); on the critic's pipeline-last-stage
            ranks its old values (`CriticValues`).
        """
        entered = time.perf_counter()
        trainee = self._require_init()
        memory = self._require_memory()
        step_wakes = memory.wake_for_train(self._at_step)
        batch = self._batch(data_ref)
        logger.info(
            "rank %d: %s trains on rollout %d (%d samples)", self.rank, self.role, rollout_id, len(batch)
        )
        self._last_targets = {}
        if self.role == "critic" and critic is not None:
            raise ValueError("train: the critic takes no critic values; pass them to the actor's train")
        train = functools.partial(
            roles.train_critic
            if self.role == "critic"
            else functools.partial(roles.train_actor, critic=critic),
            trainee,
            batch,
            self._group,
            log_probs=log_probs,
            rank=self.rank,
            rollout_id=rollout_id,
            on_targets=self._keep_targets,
            kl_coef=kl_coef,
        )
        trainee.step_wakes = step_wakes
        trainee.clock = clock = TrainClock(trainee.device)
        try:
            with AllocatorCalls() as calls, memory.measure("train", outside=PASSES):
                out = train()
                clock.stop()
        finally:
            trainee.step_wakes = trainee.clock = None
        if step_wakes is None:
            memory.record_state_after_train()  # the optimizer's moments exist from the first step on
        # This rank's own counts (not reduced): what the allocator paid for memory handed back by a sleep, and
        # the seconds of the optimizer state's wakes and sleeps around each step.
        moves = {} if step_wakes is None else step_wakes.figures()
        # Beside the parts, the whole method (`CALL`): what the train's call holds beyond `total` (the batch
        # from the object store, the wakes, the figures); the driver's phase less it is the call's way there
        # and back and the driver's own routing.
        seconds = {**clock.figures(), CALL: time.perf_counter() - entered}
        return dataclasses.replace(out, allocator=calls.metrics(), step_moves=moves, train_time=seconds)

    def keep_asleep_for_passes(self, tags: list[str] | None) -> None:
        """The memory tags this worker's trains keep asleep through their forward and backward passes, from
        the next on (a memory plan's `PlannedTurn.at_step`): those asleep as a train begins stay so, wake for
        each optimizer step and sleep again after it, so that the passes' activations and this state never
        share the GPU. None or []: a train wakes every tag. ValueError naming the worker's tags for one it
        lacks."""
        self._require_init()
        self._at_step = self._require_memory().check("keep_asleep_for_passes", tags) or []

    def compute_log_probs(self, rollout_id: int, data_ref: Any) -> ActorLogProbs | None:
        """The actor's old and reference log-probs of this rank's samples, for the KL-first plan.

        Never wakes or sleeps: the driver wakes the actor's weights before (RuntimeError
        while a weight tag sleeps; the optimizer state and gradients may stay asleep).
        Old log-probs under `temperature` with the current weights, and
        reference log-probs with the reference weights swapped in from the host
        (kept when `kl_coef != 0` or `use_kl_loss`). Every rank must take part.

        Returns:
            On pipeline-last-stage ranks an `ActorLogProbs`, each Box `pack_values` of one
            tensor per sample (its response length; `ref_log_probs` only with reference
            weights); None elsewhere.
        """
        trainee = self._require_init()
        if self.role != "actor":
            raise ValueError(
                "compute_log_probs: only the actor computes log-probs (this worker is the critic)"
            )
        memory = self._require_memory()
        if asleep := memory.weights_asleep():
            raise RuntimeError(
                f"compute_log_probs: the weight tags {asleep} are asleep and computing never wakes them; "
                "the driver wakes the actor's weights first (wake_up(['weights', ...]) or wake_up())"
            )
        batch = self._batch(data_ref)
        logger.info("rank %d: actor log-probs of rollout %d (%d samples)", self.rank, rollout_id, len(batch))
        with memory.measure("log_probs"):
            return roles.compute_log_probs(trainee, batch)

    def last_targets(self) -> dict[str, Any]:
        """Host copies of this rank's per-token targets of its last `train` call (tests, debugging).

        On pipeline-last-stage ranks: `sample_indices` and the padded targets that
        were set (critic: `old_values`, `returns`, and `token_rewards` when its old values
        come from its update; actor: `old_log_probs`,
        `ref_log_probs`, `old_values` (the critic's values it used), `advantages`);
        `{}` elsewhere or before any `train`.
        """
        return dict(self._last_targets)

    def _keep_targets(self, batch: RolloutBatch) -> None:
        kept: dict[str, Any] = {"sample_indices": list(batch.sample_indices)}
        for name in TARGETS:
            value = getattr(batch, name)
            if value is not None:
                kept[name] = value.detach().to("cpu", copy=True)
        self._last_targets = kept

    def _batch(self, data_ref: Any) -> RolloutBatch:
        return resolve_batch(
            data_ref, dp_rank=mpu.get_data_parallel_rank(), dp_size=mpu.get_data_parallel_world_size()
        )

    # --- lifecycle ---------------------------------------------------------------------------
    def sleep(self, tags: list[str] | None = None) -> dict[str, float]:
        """Put the model's GPU memory away, of `tags` (some of `memory_tags()`) or every tag (None).

        Idempotent: tags asleep already are skipped. The process groups are torn down only
        when the sleep leaves every tag asleep (a model partly asleep still computes).
        Returns the seconds each step took: `Lifecycle.last_timings`' keys (empty when
        nothing was left to put away). ValueError naming the worker's tags for one it lacks.
        """
        self._require_init()
        return self._require_memory().sleep(tags)

    def wake_up(self, tags: list[str] | None = None) -> dict[str, float]:
        """Bring the model's memory back, of `tags` (some of `memory_tags()`) or every tag (None).

        Idempotent. The process groups come back with a wake from every tag asleep; `wake_up()`
        also reloads them when awake (a retried step). Returns the seconds each step took
        (`Lifecycle.last_timings`). ValueError naming the worker's tags for one it lacks.
        """
        self._require_init()
        return self._require_memory().wake_up(tags)

    def asleep(self) -> bool:
        """Whether the model is asleep (any of its tags)."""
        self._require_init()
        return bool(self._lifecycle.asleep)

    def memory_tags(self) -> list[str]:
        """This worker's memory tags, in the order a sleep puts them away (the backend's: pinned-host
        `[base,] weights, grads, main_params, optimizer_moments`; torch_memory_saver `[base,] weights,
        optimizer`)."""
        self._require_init()
        return list(self._require_memory().tags)

    def asleep_tags(self) -> list[str]:
        """The memory tags put away now, in `memory_tags()` order."""
        self._require_init()
        return self._require_memory().asleep()

    def empty_cache(self) -> None:
        """Hand the allocator's cached blocks back to the device (the clear step a sleep runs first; on the
        CPU it only collects garbage): for a role that stays partly resident after its phase."""
        self._require_init()
        clear_caches()

    # --- checkpoints -------------------------------------------------------------------------
    def save_model(self, rollout_id: int) -> None:
        """Save a checkpoint of rollout `rollout_id` into the role's save folder; never sleeps or wakes."""
        trainee = self._require_init()
        folder = self.config.save_of(self.role)
        if folder is None:
            raise ValueError(
                f"{'critic_save' if self.role == 'critic' else 'save'}: not set; nowhere to save"
            )
        if self._lifecycle.asleep:
            raise RuntimeError(
                "save_model: the model is asleep and saving never wakes it; the driver wakes it first "
                "(its save turn's wake)"
            )
        save_checkpoint(folder, rollout_id, trainee.train_state(), barrier=self._barrier)

    def load_model(self) -> int | None:
        """Load the role's checkpoint of `load_rollout_id` (None: the newest complete one) from its load
        folder; its rollout id, or None if there is none."""
        trainee = self._require_init()
        if self._lifecycle.asleep:
            raise RuntimeError("load_model: the model is asleep; wake it up first")
        return load_checkpoint(
            self.config.load_of(self.role), trainee.train_state(), rollout_id=self.config.load_rollout_id
        )

    # --- weights to the rollout engine ---------------------------------------------------------
    def update_weights(
        self, engine: Any, pack: Callable[[Any], Any] | None = None, *, adapters: bool = False
    ) -> int:
        """Send the model's weights, HF-named and in chunks, to `engine` (or each engine of a list).

        Every rank takes part (tensors are gathered over TP and PP). Without `pack`,
        rank 0 sends CPU copies to every engine; with `pack` (e.g. the engines'
        `ipc_payload`, when engine r shares rank r's GPU) rank r sends `pack(chunk)`
        to engine r, so there must be one engine per rank.
        While asleep only the weights come back, over temporary process groups
        that are torn down again afterwards. Returns the number of chunks sent.

        A LoRA actor sends its weights with the adapters merged in (a frozen base that
        sleeps comes back for it too), or with `adapters` its adapters alone, in PEFT's
        names, to each engine's `update_adapter_from_tensors(named, scaling=...)`, which
        merges them into its own copy of the base; then only the adapters come back.
        """
        trainee = self._require_init()
        if self.role != "actor":
            raise ValueError("update_weights: only the actor's weights go to the rollout engine")
        if adapters and trainee.lora is None:
            raise ValueError(
                "update_weights: adapters=True, but the actor trains in full (lora_rank is unset)"
            )
        engines = list(engine) if isinstance(engine, list | tuple) else [engine]
        if pack is not None and len(engines) != self.world_size:
            raise ValueError(
                f"update_weights: pack sends rank r's chunks to engine r, but there are {len(engines)} "
                f"engines for {self.world_size} ranks; pass one engine per rank, or no pack"
            )
        memory = self._require_memory()
        # Only the weight tags that sleep come back (and sleep again after), and the process
        # groups only where they are down and the export gathers over TP or PP (each rebuild
        # and teardown costs a communicator setup and shutdown): a rank of a TP = PP = 1
        # model holds every weight already.
        tp, pp = self.config.topology(self.role)
        needed = [WEIGHTS] if adapters else [BASE, WEIGHTS]
        chunk_bytes = self.config.update_weights_chunk_bytes
        with (
            memory.weights_back(collectives=tp * pp > 1, tags=needed) as groups_alive,
            memory.measure("weights"),
        ):
            chunks = send_weights(
                trainee, engines, pack, rank=self.rank, chunk_bytes=chunk_bytes, adapters=adapters
            )
            if groups_alive:  # without it the caller's wait for every rank's answer is the barrier
                self._barrier()
            return chunks

    def shutdown(self) -> None:
        """Leave the process groups (before the actor is killed)."""
        destroy_distributed()
        forget_all()

    # --- helpers -------------------------------------------------------------------------------
    def _barrier(self) -> None:
        torch.distributed.barrier(group=self._group)
