"""The train worker, driver side: start one role's workers on placement-group bundles, and call them.

Nothing here imports Megatron (30 s on a small CPU machine): the Ray actors
are `_WorkerHost`s, which import `worker.TrainWorker` in their own process and
pass every call through. Actor and critic are separate torch.distributed
worlds; `create_train_group` starts one role's workers on the bundles of a
placement group (fractional GPUs, so both roles share the same bundles) and
agrees on the rendezvous address through rank 0.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from tandem.megatron.choices import Role
from tandem.megatron.config import WorkerConfig
from tandem.megatron.payloads import (
    ActorLogProbs,
    CriticValues,
    TrainResult,
    critic_payloads,
    last_stage_ranks,
    route_payloads,
)

__all__ = ["ShareLedger", "TrainGroup", "create_train_group"]


class ShareLedger(Protocol):
    """What `create_train_group` needs of tandem-placement's `GpuShares`: claim and release a bundle share.

    `slot` is anything with the placement group as `pg` and the bundle indices
    as `bundle_indices` (a `tandem.placement.Slot`, or the group's own view).
    """

    def claim(
        self, slot: Any, index: int, *, role: str, num_gpus: float, num_cpus: float | None = None
    ) -> None:
        """Record `role`'s share of bundle `index`; ValueError when the bundle's shares pass one GPU."""
        ...

    def release(self, slot: Any, index: int, role: str) -> None:
        """Give `role`'s share of bundle `index` back."""
        ...


class _Bundles(NamedTuple):
    """A group's bundles in the form `ShareLedger` takes (the fields of tandem-placement's `Slot`)."""

    pg: Any
    bundle_indices: tuple[int, ...]


class _WorkerHost:
    """The Ray actor of one rank: builds a `worker.TrainWorker` in its own process and passes calls through.

    Its methods are `TrainWorker`'s public methods, one to one (a test checks it).
    """

    def __init__(self, rank: int, world_size: int) -> None:
        from tandem.megatron.worker.train_worker import TrainWorker

        self._worker = TrainWorker(rank, world_size)

    def master_address(self) -> tuple[str, int]:
        return self._worker.master_address()

    def init(self, config: WorkerConfig, role: Role, master_addr: str, master_port: int) -> int:
        return self._worker.init(config, role, master_addr, master_port)

    def train(
        self,
        rollout_id: int,
        data_ref: Any,
        *,
        critic: CriticValues | None = None,
        log_probs: ActorLogProbs | None = None,
    ) -> TrainResult:
        return self._worker.train(rollout_id, data_ref, critic=critic, log_probs=log_probs)

    def compute_log_probs(self, rollout_id: int, data_ref: Any) -> ActorLogProbs | None:
        return self._worker.compute_log_probs(rollout_id, data_ref)

    def last_targets(self) -> dict[str, Any]:
        return self._worker.last_targets()

    def sleep(self) -> dict[str, float]:
        return self._worker.sleep()

    def wake_up(self) -> dict[str, float]:
        return self._worker.wake_up()

    def asleep(self) -> bool:
        return self._worker.asleep()

    def save_model(self, rollout_id: int) -> None:
        self._worker.save_model(rollout_id)

    def load_model(self) -> int | None:
        return self._worker.load_model()

    def update_weights(self, engine: Any, pack: Any = None, adapters: bool = False) -> int:
        return self._worker.update_weights(engine, pack, adapters=adapters)

    def state_snapshot(self) -> dict[str, Any]:
        return self._worker.state_snapshot()

    def state_nbytes(self) -> dict[str, int]:
        return self._worker.state_nbytes()

    def gpu_memory(self) -> dict[str, int | None]:
        return self._worker.gpu_memory()

    def host_buffer_bytes(self) -> int | None:
        return self._worker.host_buffer_bytes()

    def bytes_copied_to_host(self) -> dict[str, int]:
        return self._worker.bytes_copied_to_host()

    def lifecycle_timings(self) -> dict[str, float]:
        return self._worker.lifecycle_timings()

    def process_groups(self) -> dict[str, int]:
        return self._worker.process_groups()

    def shutdown(self) -> None:
        self._worker.shutdown()


@dataclass
class TrainGroup:
    """The Ray actors of one role, in rank order, initialised and ready to train.

    Attributes:
        role: "actor" or "critic".
        workers: the worker actor handles, rank `i` at index `i`; each has
            `TrainWorker`'s methods (`w.train.remote(...)`).
        start_rollout_id: the rollout to start from (after a loaded checkpoint, else 0).
        shares: the ledger that holds this group's GPU shares (released by `kill`), if any.
        bundles: the placement group and bundle indices the workers run on.
        layout: the role's (tensor-parallel, pipeline-parallel) sizes, when known
            (`create_train_group` sets it); lets `train` take sample indices per data-parallel rank.
    """

    role: Role
    workers: list[Any]
    start_rollout_id: int
    shares: ShareLedger | None = None
    bundles: Any = field(default=None, repr=False)
    layout: tuple[int, int] | None = None

    @property
    def data_parallel_size(self) -> int | None:
        """The role's data-parallel size (None when `layout` is unknown)."""
        if self.layout is None:
            return None
        return len(self.workers) // (self.layout[0] * self.layout[1])

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker; the ObjectRefs, in rank order."""
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker and wait; the results, in rank order."""
        import ray

        return list(ray.get(self.call(method, *args, **kwargs)))

    # --- the lifecycle and the checkpoints: the driver's calls, each waited for --------------------
    def wake_up(self) -> list[dict[str, float]]:
        """Bring every rank's memory back; each rank's seconds per lifecycle step, in rank order."""
        return self.run("wake_up")

    def sleep(self) -> list[dict[str, float]]:
        """Put every rank's GPU memory away; each rank's seconds per lifecycle step, in rank order."""
        return self.run("sleep")

    def asleep(self) -> list[bool]:
        """Whether each rank's model is asleep, in rank order."""
        return self.run("asleep")

    def save_model(self, rollout_id: int) -> None:
        """Save every rank's checkpoint of rollout `rollout_id` (the model must be awake)."""
        self.run("save_model", rollout_id)

    def load_model(self) -> list[int | None]:
        """Load the role's checkpoint on every rank; each rank's loaded rollout id (None: none)."""
        return self.run("load_model")

    def update_weights(
        self, engines: Sequence[Any], pack: Any = None, *, adapters: bool = False
    ) -> list[int]:
        """Send the actor's weights to `engines` (every rank takes part); each rank's chunk count.

        `pack`: the engines' `ipc_payload` when engine r shares rank r's GPU, else None (CPU copies).
        `adapters`: a LoRA actor's adapters alone, to the engines' `update_adapter_from_tensors`
        (`TrainWorker.update_weights`); else its whole weights, adapters merged in.
        """
        return self.run("update_weights", list(engines), pack, adapters)

    def shutdown(self) -> None:
        """Every rank leaves its process groups (before `kill`)."""
        self.run("shutdown")

    # --- training -----------------------------------------------------------------------------
    def train(
        self,
        rollout_id: int,
        data_refs: Any,
        *,
        critic: Sequence[TrainResult | CriticValues | None] | CriticValues | None = None,
        log_probs: Sequence[ActorLogProbs | None] | ActorLogProbs | None = None,
        sample_indices: Sequence[Sequence[int]] | None = None,
    ) -> list[Any]:
        """Start `train` on every rank with its records; the refs (of `TrainResult`s), in rank order.

        `critic` (the actor's): the critic's per-rank results of its `train`, or
        their `CriticValues`; None when the run has no critic (values 0).
        `log_probs`: the actor's per-rank `compute_log_probs` results (the KL-first
        plan), for the critic and for the actor itself. Either may also be a single
        record for every rank. `sample_indices`: this group's samples, one list per
        rank (or per data-parallel rank), each in its batch's order. Without it,
        record `r` goes to rank `r` (`route_per_rank`); with it, the records are
        routed by sample when they do not line up rank by rank (actor and critic
        with different layouts), see `payloads.route_payloads`.
        """
        if critic is not None and self.role != "actor":
            raise ValueError(
                "train: critic= is the actor's input (the critic's values); the critic takes none"
            )
        world = len(self.workers)
        route = functools.partial(route_payloads, sample_indices=sample_indices, layout=self.layout)
        values = route("critic", critic_payloads(critic), world) if critic is not None else None
        if values is not None:
            for rank in last_stage_ranks(world, self.layout) or ():
                if values[rank] is None:
                    raise ValueError(
                        f"critic: actor rank {rank} is on the pipeline-last stage but got no critic values; "
                        "pass the critic's results of train as they came back (one per critic rank)"
                    )
        # The actor's own log-probs stay with their rank; the critic's are routed by sample if need be.
        own = self.role == "actor"
        routed = (route_payloads if own else route)("log_probs", log_probs, world)
        return [
            w.train.remote(rollout_id, data_refs, critic=None if values is None else values[r], log_probs=lp)
            for r, (w, lp) in enumerate(zip(self.workers, routed, strict=True))
        ]

    def compute_log_probs(self, rollout_id: int, data_refs: Any) -> list[Any]:
        """Start the actor's `compute_log_probs` on every rank (the KL-first plan); the refs, in rank order.

        The model must be awake (the driver wakes it). Each last-stage rank's result
        is an `ActorLogProbs`, other ranks' None; pass the list as `log_probs` to the
        critic's `train` and to the actor's own.
        """
        if self.role != "actor":
            raise ValueError(
                "compute_log_probs: only the actor computes log-probs; call it on the actor's group"
            )
        return self.call("compute_log_probs", rollout_id, data_refs)

    def kill(self) -> None:
        """Kill every worker process (no cleanup; for shutdown and crash tests); give the GPU shares back."""
        import ray

        for w in self.workers:
            ray.kill(w)
        if self.shares is not None and self.bundles is not None:
            for index in range(len(self.bundles.bundle_indices)):
                self.shares.release(self.bundles, index, self.role)
            self.shares = None


def create_train_group(
    config: WorkerConfig,
    role: Role,
    placement_group: Any,
    bundle_indices: Sequence[int],
    *,
    num_gpus_per_worker: float,
    num_cpus_per_worker: float = 0.5,
    env_vars: dict[str, str] | None = None,
    shares: ShareLedger | None = None,
) -> TrainGroup:
    """Start and initialise `role`'s workers, rank `i` on bundle `bundle_indices[i]` of `placement_group`.

    The bundles come from tandem.placement (a `Slot`'s `pg` and `bundle_indices`);
    give actor and critic the same ones, each with a fraction of the bundle's GPU
    (`num_gpus_per_worker`, e.g. 0.4). With `shares` (tandem-placement's
    `GpuShares`, the one ledger of the run) each worker's share is claimed first
    under the role's name, so that actor + critic + engine on one GPU are
    refused with a ValueError when they add up to more than 1, instead of Ray
    leaving a worker pending forever. Rank 0 picks the rendezvous address and
    port; every rank then joins the role's own world. With the
    torch_memory_saver backend the workers start with its LD_PRELOAD hook.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    config.check_role(role)
    config.check_world(len(bundle_indices), role=role)
    bundles = _Bundles(placement_group, tuple(bundle_indices))
    if shares is not None:
        claimed = 0
        try:
            for index in range(len(bundles.bundle_indices)):
                shares.claim(
                    bundles, index, role=role, num_gpus=num_gpus_per_worker, num_cpus=num_cpus_per_worker
                )
                claimed += 1
        except ValueError:
            for index in range(claimed):
                shares.release(bundles, index, role)
            raise
    env = dict(env_vars or {})
    if config.offload_backend == "torch_memory_saver":
        from tandem.lifecycle import torch_memory_saver_env

        env = {**torch_memory_saver_env(), **env}
    remote_cls = ray.remote(_WorkerHost)
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
    group = TrainGroup(role, workers, 0, shares, bundles, config.topology(role))
    try:
        master_addr, master_port = ray.get(workers[0].master_address.remote())
        starts = ray.get([w.init.remote(config, role, master_addr, master_port) for w in workers])
        if len(set(starts)) != 1:
            raise RuntimeError(f"{role} ranks resumed from different rollouts: {starts}")
    except BaseException:
        group.kill()
        raise
    group.start_rollout_id = starts[0]
    return group
