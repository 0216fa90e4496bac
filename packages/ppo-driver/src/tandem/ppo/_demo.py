"""`ppo-driver demo`: how a Tandem run sits on its GPUs, shown on a local Ray with logical GPUs.

Until the PPO loop lands this is the main job's stand-in: it builds the layout
from a `PlacementSpec`, reserves the placement group, orders its bundles, and
co-locates an actor rank, a critic rank and a rollout engine on every shared
GPU through fractional `num_gpus`, then reports where each one landed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DemoArgs:
    """Options of `ppo-driver demo`."""

    gpus: int = 4
    """Logical GPUs of the local Ray cluster (no real GPU is needed)."""
    actor_gpus: int = 4
    """Training GPUs (actor and critic share them)."""
    rollout_gpus: int = 4
    """GPUs of the rollout engine."""
    colocate: bool = True
    """Rollout engine on the training GPUs; with False it gets GPUs of its own."""
    actor_share: float = 0.4
    """Fraction of a GPU asked for by each actor rank."""
    critic_share: float = 0.4
    """Fraction of a GPU asked for by each critic rank."""
    engine_share: float = 0.2
    """Fraction of a GPU asked for by each rollout-engine rank."""


def run_demo(args: DemoArgs) -> list[dict[str, Any]]:
    """Place actor, critic and engine ranks; print and return where each landed."""
    import ray

    from tandem.placement import GpuShares, PlacementSpec, compute_layout, create_placement_groups

    spec = PlacementSpec(
        actor_num_gpus_per_node=args.actor_gpus,
        rollout_num_gpus=args.rollout_gpus,
        colocate=args.colocate,
        use_critic=True,
    )
    layout = compute_layout(spec)
    print(f"layout: {layout}")
    if layout.num_gpus > args.gpus:
        raise ValueError(
            f"the layout needs {layout.num_gpus} GPUs but --gpus is {args.gpus}; raise --gpus to at least "
            f"{layout.num_gpus}, or lower --actor-gpus / --rollout-gpus"
        )

    class Probe:
        """Stands in for a train worker or engine rank: reports where Ray put it."""

        def where(self, role: str, rank: int) -> dict[str, Any]:
            ctx = ray.get_runtime_context()
            return {
                "role": role,
                "rank": rank,
                "node": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "actor_id": (ctx.get_actor_id() or "")[:8],
            }

    remote_probe: Any = ray.remote(Probe)
    ray.init(num_gpus=args.gpus, num_cpus=max(2, args.gpus), include_dashboard=False, log_to_driver=False)
    try:
        with create_placement_groups(spec, timeout_s=60) as placements:
            print(placements)
            shares = GpuShares()
            assert placements.critic is placements.actor  # the critic reuses the actor's bundles
            plan: list[tuple[str, Any, float]] = [
                ("actor", placements.actor, args.actor_share),
                ("critic", placements.critic, args.critic_share),
                ("engine", placements.rollout, args.engine_share),
            ]
            handles = []
            for role, slot, share in plan:
                for rank in range(len(slot)):
                    opts = shares.options(slot, rank, role=role, num_gpus=share, num_cpus=0)
                    handles.append(remote_probe.options(**opts).remote().where.remote(role, rank))
            rows: list[dict[str, Any]] = ray.get(handles)
            print(f"{'role':<8}{'rank':>5}  {'node':<16}{'gpu':>5}  share")
            shares_by_role = {role: share for role, _, share in plan}
            for row in rows:
                gpu = ",".join(row["gpu_ids"])
                print(
                    f"{row['role']:<8}{row['rank']:>5}  {row['node']:<16}{gpu:>5}  {shares_by_role[row['role']]}"
                )
            return rows
    finally:
        ray.shutdown()
