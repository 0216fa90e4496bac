"""The train worker: one rank of the actor or of the critic, run as a Ray actor.

`TrainWorker` owns the mechanism (DESIGN.md, "The driver owns the plan"):
`train` wakes the model when it is asleep and never sleeps afterwards,
`save_model` never sleeps or wakes, and `sleep` / `wake_up` run the lifecycle
that the driver asks for. Actor and critic are separate torch.distributed
worlds; `create_train_group` starts one role's workers on placement-group
bundles (fractional GPUs, so both roles share the same bundles) and agrees on
the rendezvous address through rank 0.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from tandem.megatron._worker_support import (
    device_used_bytes,
    free_port,
    keep_tensor_pickles_portable,
    load_hf,
    process_gpu_bytes,
    resolve_batch,
    resolve_device,
    send_chunk,
)
from tandem.megatron.config import Role, WorkerConfig

logger = logging.getLogger(__name__)


@runtime_checkable
class WeightReceiver(Protocol):
    """A rollout engine that takes HF-named weights in chunks (`update_weights`'s target).

    A Ray actor handle whose class has this method works too (the worker calls
    `.remote` and waits); it then receives CPU tensors.
    """

    def update_weights_from_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> Any:
        """Load these tensors (full, HF-named) into the engine's model."""
        ...


class TrainWorker:
    """One rank of the actor or the critic: trains, sleeps and wakes, saves and loads, exports weights.

    Used as a Ray actor (`create_train_group` starts a group). Call order:
    `master_address()` on rank 0, then `init(...)` on every rank, then any of
    `train`, `sleep`, `wake_up`, `save_model`, `load_model`, `update_weights`.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._trainee: Any = None
        self._lifecycle: Any = None
        self._group: Any = None
        self._gpu_start: dict[str, int | None] = {}

    # --- setup ---------------------------------------------------------------------------
    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0's rendezvous store."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def init(self, config: WorkerConfig, role: Role, master_addr: str, master_port: int) -> int:
        """Join the role's world, build the model and optimizer, load the latest checkpoint or the HF weights.

        Returns the rollout id to start from: the loaded checkpoint's plus one, else 0.
        """
        from tandem.lifecycle import (
            Lifecycle,
            clear_torch_caches,
            destroy_all,
            make_backend,
            reload_all,
            reloadable_groups,
        )
        from tandem.megatron._cpu_compat import enable_cpu_compat
        from tandem.megatron._trainee import build_trainee
        from tandem.megatron.parallel import init_distributed

        config.check_role(role)
        config.check_world(self.world_size)
        on_gpu = resolve_device(config) == "cuda"
        device_before_context = device_used_bytes() if on_gpu else None
        enable_cpu_compat()
        self.config, self.role = config, role
        tp, pp = config.topology(role)
        backend = make_backend(config.offload_backend)
        # Megatron's groups (and ours) are made reloadable so that sleep can tear their communicators down.
        with reloadable_groups():
            init_distributed(
                self.rank,
                self.world_size,
                master_addr,
                master_port,
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
                seed=config.seed,
            )
            self._group = torch.distributed.new_group(ranks=list(range(self.world_size)))
        if on_gpu:
            torch.zeros(1, device="cuda")  # the CUDA context exists from here on
            after = device_used_bytes()
            self._gpu_start = {
                "process_baseline": process_gpu_bytes(),
                "device_before_context": device_before_context,
                "context": None
                if after is None or device_before_context is None
                else after - device_before_context,
            }
        self._trainee = build_trainee(config, role, backend, on_gpu=on_gpu, load_hf=load_hf)
        keep_tensor_pickles_portable()
        tags = self._trainee.register(backend)
        # A full collection here walks ~0.5 M objects (torch, Megatron, Ray): freezing the
        # survivors keeps each sleep's and wake's collection to what was made since.
        clear_caches = functools.partial(clear_torch_caches, freeze_survivors=True)
        self._lifecycle = Lifecycle(
            backend,
            tags=tags,
            clear_caches=clear_caches,
            destroy_process_groups=destroy_all,
            reload_process_groups=reload_all,
        )
        loaded = self.load_model()
        clear_caches()  # the objects of start-up are frozen before the first sleep
        return 0 if loaded is None else loaded + 1

    # --- training --------------------------------------------------------------------------
    def train(self, rollout_id: int, data_ref: Any, external_data: Any = None) -> dict[str, Any]:
        """Train on this rank's share of a rollout; wakes the model first if asleep, never sleeps after.

        Args:
            rollout_id: the rollout being trained on (for logs).
            data_ref: this rank's `RolloutBatch`, an ObjectRef or `Box` of it, or a
                list with one of those per data-parallel rank (this rank takes its own).
            external_data: actor only: the critic's payload for this rank (a `Box`
                from the critic's `{"values": Box}`, that dict itself, or a
                `SampleGather`); None when the run has no critic (values are 0).

        Returns:
            `{"metrics": {...}}`, the same on every rank; the critic's
            pipeline-last-stage ranks add `"values"`: a `Box` of the old values.
        """
        from tandem.megatron import roles
        from tandem.megatron._cpu_compat import enable_cpu_compat

        enable_cpu_compat()
        self._require_init()
        if self._lifecycle.asleep:
            self._lifecycle.wake_up()
        batch = resolve_batch(data_ref)
        logger.info(
            "rank %d: %s trains on rollout %d (%d samples)", self.rank, self.role, rollout_id, len(batch)
        )
        if self.role == "critic":
            return roles.train_critic(self._trainee, batch, self._group)
        return roles.train_actor(self._trainee, batch, external_data, self._group, rank=self.rank)

    # --- lifecycle ---------------------------------------------------------------------------
    def sleep(self) -> dict[str, float]:
        """Put the model's GPU memory away (idempotent); returns the seconds each step took.

        The keys are `Lifecycle.last_timings`' (empty when already asleep).
        """
        self._require_init()
        self._lifecycle.sleep()
        timings: dict[str, float] = self._lifecycle.last_timings
        return timings

    def wake_up(self) -> dict[str, float]:
        """Bring the model's memory back (idempotent; when awake, reloads process groups only).

        Returns the seconds each step took (`Lifecycle.last_timings`).
        """
        self._require_init()
        self._lifecycle.wake_up()
        timings: dict[str, float] = self._lifecycle.last_timings
        return timings

    def asleep(self) -> bool:
        """Whether the model is asleep."""
        self._require_init()
        return bool(self._lifecycle.asleep)

    # --- checkpoints -------------------------------------------------------------------------
    def save_model(self, rollout_id: int) -> None:
        """Save a checkpoint of rollout `rollout_id` into the role's save folder; never sleeps or wakes."""
        from tandem.megatron._cpu_compat import enable_cpu_compat
        from tandem.megatron.checkpoint import save_checkpoint

        enable_cpu_compat()
        self._require_init()
        folder = self.config.save_of(self.role)
        if folder is None:
            raise ValueError(
                f"{'critic_save' if self.role == 'critic' else 'save'}: not set; nowhere to save"
            )
        if self._lifecycle.asleep:
            raise RuntimeError(
                "save_model: the model is asleep and saving never wakes it; the driver wakes it first "
                "(OffloadPlan.wake_up_before_save)"
            )
        save_checkpoint(folder, rollout_id, self._trainee.train_state(), barrier=self._barrier)

    def load_model(self) -> int | None:
        """Load the newest complete checkpoint of the role's load folder; its rollout id, or None if none."""
        from tandem.megatron._cpu_compat import enable_cpu_compat
        from tandem.megatron.checkpoint import load_checkpoint

        enable_cpu_compat()
        self._require_init()
        if self._lifecycle.asleep:
            raise RuntimeError("load_model: the model is asleep; wake it up first")
        return load_checkpoint(self.config.load_of(self.role), self._trainee.train_state())

    # --- weights to the rollout engine ---------------------------------------------------------
    def update_weights(self, engine: Any) -> int:
        """Send the model's weights, HF-named and in chunks, to `engine` (or each engine of a list).

        Every rank takes part (tensors are gathered over TP and PP); rank 0 sends.
        While asleep only the weights come back, over temporary process groups
        that are torn down again afterwards. Returns the number of chunks sent.
        """
        from tandem.megatron._cpu_compat import enable_cpu_compat
        from tandem.megatron._trainee import WEIGHTS

        enable_cpu_compat()
        self._require_init()
        if self.role != "actor":
            raise ValueError("update_weights: only the actor's weights go to the rollout engine")
        engines = list(engine) if isinstance(engine, list | tuple) else [engine]
        if not self._lifecycle.asleep:
            return self._send_weights(engines)
        # Only the weights come back, with the process groups; both go away again afterwards.
        self._lifecycle.wake_up([WEIGHTS])
        try:
            return self._send_weights(engines)
        finally:
            self._lifecycle.sleep([WEIGHTS])

    def _send_weights(self, engines: list[Any]) -> int:
        from tandem.megatron.hf_weights import export_hf_weights

        chunks = 0
        for named in export_hf_weights(
            self._trainee.module, self._trainee.spec, self.config.update_weights_chunk_bytes
        ):
            if self.rank == 0:
                for target in engines:
                    send_chunk(target, named)
            chunks += 1
        self._barrier()
        return chunks

    # --- introspection -------------------------------------------------------------------------
    def state_snapshot(self) -> dict[str, torch.Tensor]:
        """CPU copies of this rank's weights, optimizer state and schedule position (tests, debugging)."""
        self._require_init()
        if self._lifecycle.asleep:
            raise RuntimeError("state_snapshot: the model is asleep; wake it up first")
        snapshot: dict[str, torch.Tensor] = self._trainee.snapshot()
        return snapshot

    def state_nbytes(self) -> dict[str, int]:
        """Bytes of the training state that sleep moves, by memory tag (weights, grads, optimizer)."""
        self._require_init()
        if self._lifecycle.asleep:
            raise RuntimeError("state_nbytes: the model is asleep; wake it up first")
        nbytes: dict[str, int] = self._trainee.state_nbytes()
        return nbytes

    def gpu_memory(self) -> dict[str, int | None]:
        """This worker's GPU memory now and at start-up, in bytes, as nvidia-smi reports it.

        `process`: what the driver attributes to this process now (CUDA context
        included); `process_baseline`: the same once the CUDA context existed, before
        the model; `device_used` / `device_before_context` / `context`: the whole
        GPU now, before this worker's CUDA context, and that context's size. None
        where nvidia-smi cannot tell (no such pid in a container's view); all 0 on CPU.
        """
        if not torch.cuda.is_available():
            return dict.fromkeys(
                ("process", "process_baseline", "device_used", "device_before_context", "context"), 0
            )
        return {"process": process_gpu_bytes(), "device_used": device_used_bytes(), **self._gpu_start}

    def shutdown(self) -> None:
        """Leave the process groups (before the actor is killed)."""
        from tandem.lifecycle import forget_all
        from tandem.megatron.parallel import destroy_distributed

        destroy_distributed()
        forget_all()

    # --- helpers -------------------------------------------------------------------------------
    def _barrier(self) -> None:
        torch.distributed.barrier(group=self._group)

    def _require_init(self) -> None:
        if self._trainee is None:
            raise RuntimeError("TrainWorker: call init(config, role, master_addr, master_port) first")


@dataclass
class TrainGroup:
    """The Ray actors of one role, in rank order, initialised and ready to train.

    Attributes:
        role: "actor" or "critic".
        workers: the `TrainWorker` actor handles, rank `i` at index `i`.
        start_rollout_id: the rollout to start from (after a loaded checkpoint, else 0).
    """

    role: Role
    workers: list[Any]
    start_rollout_id: int

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker; the ObjectRefs, in rank order."""
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker and wait; the results, in rank order."""
        import ray

        return list(ray.get(self.call(method, *args, **kwargs)))

    def train(self, rollout_id: int, data_refs: Any, external_data: Any = None) -> list[Any]:
        """Start `train` on every rank, routing `external_data` per rank (`route_per_rank`); the refs."""
        from tandem.value_transfer import route_per_rank

        payloads = route_per_rank(external_data, len(self.workers))
        return [
            w.train.remote(rollout_id, data_refs, payload)
            for w, payload in zip(self.workers, payloads, strict=True)
        ]

    def kill(self) -> None:
        """Kill every worker process (no cleanup; for shutdown and crash tests)."""
        import ray

        for w in self.workers:
            ray.kill(w)


def create_train_group(
    config: WorkerConfig,
    role: Role,
    placement_group: Any,
    bundle_indices: Sequence[int],
    *,
    num_gpus_per_worker: float,
    num_cpus_per_worker: float = 0.5,
    env_vars: dict[str, str] | None = None,
) -> TrainGroup:
    """Start and initialise `role`'s workers, rank `i` on bundle `bundle_indices[i]` of `placement_group`.

    The bundles come from tandem.placement (a `Slot`'s `pg` and `bundle_indices`);
    give actor and critic the same ones, each with a fraction of the bundle's GPU
    (`num_gpus_per_worker`, e.g. 0.4). Rank 0 picks the rendezvous address and
    port; every rank then joins the role's own world. With the
    torch_memory_saver backend the workers start with its LD_PRELOAD hook.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    config.check_role(role)
    config.check_world(len(bundle_indices))
    env = dict(env_vars or {})
    if config.offload_backend == "torch_memory_saver":
        from tandem.lifecycle import torch_memory_saver_env

        env = {**torch_memory_saver_env(), **env}
    remote_cls = ray.remote(TrainWorker)
    workers: list[Any] = [
        remote_cls.options(
            num_cpus=num_cpus_per_worker,
            num_gpus=num_gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=index
            ),
            runtime_env={"env_vars": env} if env else None,
        ).remote(rank, len(bundle_indices))
        for rank, index in enumerate(bundle_indices)
    ]
    master_addr, master_port = ray.get(workers[0].master_address.remote())
    starts = ray.get([w.init.remote(config, role, master_addr, master_port) for w in workers])
    if len(set(starts)) != 1:
        raise RuntimeError(f"{role} ranks resumed from different rollouts: {starts}")
    return TrainGroup(role, workers, starts[0])
