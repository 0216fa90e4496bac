"""The train worker, driver side: start one role's workers on placement-group bundles, and call them.

Nothing here imports Megatron (30 s on a small CPU machine): the Ray actors
are `TrainWorkerHost`s (`actors.ActorHost`), which build `worker.TrainWorker` in
their own process and run any of its public methods by name (`TrainGroup.call`).
Actor and critic are separate torch.distributed worlds; `create_train_group`
starts one role's workers on the bundles of a placement group (fractional GPUs,
so both roles share the same bundles) and agrees on the rendezvous address
through rank 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

from tandem.megatron.choices import Role
from tandem.megatron.config import WorkerConfig
from tandem.megatron.group.actors import ActorHost
from tandem.megatron.payloads import (
    ActorLogProbs,
    CriticValues,
    TrainResult,
    critic_payloads,
    last_stage_ranks,
    route_payloads,
)

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

    from tandem.megatron.batch import RolloutBatch

__all__ = ["TRAIN_WORKER", "ShareLedger", "TrainGroup", "TrainWorkerHost", "create_train_group"]

TRAIN_WORKER = "tandem.megatron.worker.train_worker:TrainWorker"
"""The class each rank's host builds in its own process."""

type DataRefs = Sequence[ObjectRef[RolloutBatch]]
"""One rollout's batches in Ray's object store, one per rank or per data-parallel rank."""


class Bundles(Protocol):
    """The bundles a group runs on: a placement group (`pg`) and its bundle indices (a `tandem.placement.Slot`)."""

    @property
    def pg(self) -> PlacementGroup | None: ...

    @property
    def bundle_indices(self) -> Sequence[int]: ...


class ShareLedger(Protocol):
    """What `create_train_group` needs of tandem-placement's `GpuShares`: claim and release a bundle share."""

    def claim(
        self, slot: Bundles, index: int, *, role: str, num_gpus: float, num_cpus: float | None = None
    ) -> None:
        """Record `role`'s share of bundle `index`; ValueError when the bundle's shares pass one GPU."""
        ...

    def release(self, slot: Bundles, index: int, role: str) -> None:
        """Give `role`'s share of bundle `index` back."""
        ...


class _Bundles(NamedTuple):
    """A group's bundles in the form `ShareLedger` takes (the fields of tandem-placement's `Slot`)."""

    pg: PlacementGroup | None
    bundle_indices: tuple[int, ...]


class TrainWorkerHost(ActorHost):
    """The Ray actor of one train-worker rank: an `ActorHost` of `TRAIN_WORKER`.

    A class of its own so that Ray's process title (`ray::TrainWorkerHost.call`) names a
    train worker in an error that comes from one.
    """


@dataclass
class TrainGroup:
    """The Ray actors of one role, in rank order, initialised and ready to train.

    Attributes:
        role: "actor" or "critic".
        workers: the worker actor handles (`TrainWorkerHost`s), rank `i` at index `i`; each
            runs `TrainWorker`'s methods by name (`w.call.remote("train", ...)`, `call` here).
        start_rollout_id: the rollout to start from (after a loaded checkpoint, else 0).
        shares: the ledger that holds this group's GPU shares (released by `kill`), if any.
        bundles: the placement group and bundle indices the workers run on.
        layout: the role's (tensor-parallel, pipeline-parallel) sizes, when known
            (`create_train_group` sets it); lets `train` take sample indices per data-parallel rank.
    """

    role: Role
    workers: list[ActorHandle]
    start_rollout_id: int
    shares: ShareLedger | None = None
    bundles: Bundles | None = field(default=None, repr=False)
    layout: tuple[int, int] | None = None

    @property
    def data_parallel_size(self) -> int | None:
        """The role's data-parallel size (None when `layout` is unknown)."""
        if self.layout is None:
            return None
        return len(self.workers) // (self.layout[0] * self.layout[1])

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[ObjectRef[Any]]:
        """Call `TrainWorker`'s `method` on every worker; the ObjectRefs, in rank order."""
        return [w.call.remote(method, *args, **kwargs) for w in self.workers]

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker and wait; the results, in rank order."""
        import ray

        return list(ray.get(self.call(method, *args, **kwargs)))

    # --- the lifecycle and the checkpoints: the driver's calls, each waited for --------------------
    def wake_up(self, tags: Sequence[str] | None = None) -> list[dict[str, float]]:
        """Bring every rank's memory back, of `tags` (some of `memory_tags()`) or all (None); each rank's
        seconds per lifecycle step, in rank order."""
        return self.run("wake_up", None if tags is None else list(tags))

    def sleep(self, tags: Sequence[str] | None = None) -> list[dict[str, float]]:
        """Put every rank's GPU memory away, of `tags` (some of `memory_tags()`) or all (None); each rank's
        seconds per lifecycle step, in rank order. The process groups go only with the last tag."""
        return self.run("sleep", None if tags is None else list(tags))

    def asleep(self) -> list[bool]:
        """Whether each rank's model is asleep (any of its tags), in rank order."""
        return self.run("asleep")

    def memory_tags(self) -> list[str]:
        """The role's memory tags, in the order a sleep puts them away (rank 0's: every rank has the same)."""
        import ray

        tags: list[str] = ray.get(self.workers[0].call.remote("memory_tags"))
        return tags

    def asleep_tags(self) -> list[list[str]]:
        """Each rank's memory tags put away now, in rank order."""
        return self.run("asleep_tags")

    def empty_cache(self) -> None:
        """Every rank hands its allocator's cached blocks back to the device (a role left partly resident)."""
        self.run("empty_cache")

    def state_nbytes(self) -> list[dict[str, int]]:
        """Each rank's bytes of training state by memory tag (`TrainWorker.state_nbytes`, also asleep)."""
        return self.run("state_nbytes")

    def phase_peaks(self) -> list[dict[str, int]]:
        """Each rank's largest transient bytes by work (`train`, `log_probs`, `weights`) and the most its
        allocator kept cached after one (`gpu_memory.CACHED`); empty on the CPU."""
        return self.run("phase_peaks")

    def save_model(self, rollout_id: int) -> None:
        """Save every rank's checkpoint of rollout `rollout_id` (the model must be awake)."""
        self.run("save_model", rollout_id)

    def load_model(self) -> list[int | None]:
        """Load the role's checkpoint on every rank; each rank's loaded rollout id (None: none)."""
        return self.run("load_model")

    def update_weights(
        self,
        engines: Sequence[ActorHandle],
        pack: Callable[[Any], Any] | None = None,
        *,
        adapters: bool = False,
    ) -> list[int]:
        """Send the actor's weights to `engines` (every rank takes part); each rank's chunk count.

        `pack`: the engines' `ipc_payload` when engine r shares rank r's GPU, else None (CPU copies).
        `adapters`: a LoRA actor's adapters alone, to the engines' `update_adapter_from_tensors`
        (`TrainWorker.update_weights`); else its whole weights, adapters merged in.
        """
        return self.run("update_weights", list(engines), pack, adapters=adapters)

    def shutdown(self) -> None:
        """Every rank leaves its process groups (before `kill`)."""
        self.run("shutdown")

    # --- training -----------------------------------------------------------------------------
    def train(
        self,
        rollout_id: int,
        data_refs: DataRefs,
        *,
        critic: Sequence[TrainResult | CriticValues | None] | CriticValues | None = None,
        log_probs: Sequence[ActorLogProbs | None] | ActorLogProbs | None = None,
        sample_indices: Sequence[Sequence[int]] | None = None,
        kl_coef: float | None = None,
    ) -> list[ObjectRef[TrainResult]]:
        """Start `train` on every rank with its records; the refs (of `TrainResult`s), in rank order.

        `critic` (the actor's): the critic's per-rank results of its `train`, or
        their `CriticValues`; None when the run has no critic (values 0).
        `log_probs`: the actor's per-rank `compute_log_probs` results (the KL-first
        plan), for the critic and for the actor itself. Either may also be a single
        record for every rank. `sample_indices`: this group's samples, one list per
        rank (or per data-parallel rank), each in its batch's order. Without it,
        record `r` goes to rank `r` (`route_per_rank`); with it, the records are
        routed by sample when they do not line up rank by rank (actor and critic
        with different layouts), see `payloads.route_payloads`. `kl_coef`: this step's
        reward-level KL coefficient, the same for both roles (the driver's adaptive KL
        controller, `kl_target`); None: the config's `kl_coef`.
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
            w.call.remote(
                "train",
                rollout_id,
                data_refs,
                critic=None if values is None else values[r],
                log_probs=lp,
                kl_coef=kl_coef,
            )
            for r, (w, lp) in enumerate(zip(self.workers, routed, strict=True))
        ]

    def compute_log_probs(
        self, rollout_id: int, data_refs: DataRefs
    ) -> list[ObjectRef[ActorLogProbs | None]]:
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
    placement_group: PlacementGroup | None,
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

    if placement_group is None:
        raise ValueError("create_train_group: placement_group is None; give the slot's placement group")
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
        from tandem.lifecycle import torch_memory_saver_env  # torch: the driver side imports none

        env = {**torch_memory_saver_env(), **env}
    remote_cls = ray.remote(TrainWorkerHost)
    # Ray types an actor's start as handle | class: it is the handle.
    workers = [
        cast(
            "ActorHandle",
            remote_cls.options(
                num_cpus=num_cpus_per_worker,
                num_gpus=num_gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=index
                ),
                runtime_env={"env_vars": env} if env else None,
            ).remote(TRAIN_WORKER, rank, len(bundle_indices)),
        )
        for rank, index in enumerate(bundle_indices)
    ]
    group = TrainGroup(role, workers, 0, shares, bundles, config.topology(role))
    try:
        master_addr: str
        master_port: int
        master_addr, master_port = ray.get(workers[0].call.remote("master_address"))
        starts = group.run("init", config, role, master_addr, master_port)
        if len(set(starts)) != 1:
            raise RuntimeError(f"{role} ranks resumed from different rollouts: {starts}")
    except BaseException:
        group.kill()
        raise
    group.start_rollout_id = starts[0]
    return group
