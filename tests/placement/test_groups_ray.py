"""Placement groups on a real local Ray with logical GPUs (`ray.init(num_gpus=4)`, no GPU needed)."""

from __future__ import annotations

import time

import pytest

from tandem.placement import (
    BUNDLE,
    STRATEGY,
    ClusterTooSmallError,
    GpuShares,
    PlacementSpec,
    PlacementTimeoutError,
    create_placement_groups,
)

ray = pytest.importorskip("ray")


@ray.remote(num_cpus=0)
class Tenant:
    """Stands in for a train worker or an engine: reports the GPU Ray gave it."""

    def gpu_ids(self) -> list[int]:
        return [int(g) for g in ray.get_gpu_ids()]


def _pg_state(pg: object) -> str:
    return str(ray.util.placement_group_table(pg)["state"])


def test_groups_are_created_ready_and_ordered(local_ray: int) -> None:
    spec = PlacementSpec(actor_num_gpus_per_node=2, rollout_num_gpus=1, eval_num_gpus=1, use_critic=True)
    with create_placement_groups(spec, timeout_s=120) as placements:
        pg = placements.pg
        assert pg is not None and _pg_state(pg) == "CREATED"
        assert pg.bundle_specs == [{k: float(v) for k, v in BUNDLE.items()}] * 4
        assert ray.util.placement_group_table(pg)["strategy"] == STRATEGY

        assert placements.critic is placements.actor
        actor, rollout, evaluation = placements.actor, placements.rollout, placements.eval
        assert (len(actor), len(rollout), len(evaluation)) == (2, 1, 1)
        every = actor.bundle_indices + rollout.bundle_indices + evaluation.bundle_indices
        assert sorted(every) == [0, 1, 2, 3]
        # One node here, so the order is by GPU id: rank order == GPU order, rollout after training.
        gpus = actor.gpu_ids + rollout.gpu_ids + evaluation.gpu_ids
        assert list(gpus) == sorted(gpus) and len(set(gpus)) == 4
        assert set(actor.node_ips + rollout.node_ips) == {ray.util.get_node_ip_address()}

        # The ids are the ones Ray really hands an actor placed on that bundle.
        shares = GpuShares()
        tenant = Tenant.options(**shares.options(rollout, 0, role="engine", num_gpus=1.0)).remote()
        assert ray.get(tenant.gpu_ids.remote()) == [rollout.gpu_ids[0]]
        assert "Slot(pg=" in repr(placements.actor) and "critic=actor's" in repr(placements)
    assert _pg_state(pg) == "REMOVED"
    placements.remove()  # a second removal is harmless (cleanup code may run twice)


def test_three_roles_share_one_bundle_and_a_fourth_is_refused(local_ray: int) -> None:
    spec = PlacementSpec(actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=True, use_critic=True)
    placements = create_placement_groups(spec, timeout_s=120)
    try:
        assert placements.layout.num_gpus == 2
        assert placements.rollout.bundle_indices == placements.actor.bundle_indices  # colocated
        shares = GpuShares()
        fractions = {"actor": 0.4, "critic": 0.4, "engine": 0.2}
        slots = {"actor": placements.actor, "critic": placements.critic, "engine": placements.rollout}
        tenants = [
            Tenant.options(**shares.options(slots[role], 1, role=role, num_gpus=share)).remote()
            for role, share in fractions.items()
        ]
        seen = ray.get([t.gpu_ids.remote() for t in tenants])
        assert seen == [[placements.actor.gpu_ids[1]]] * 3
        with pytest.raises(ValueError, match=r"reward 0\.1 = 1\.1 GPUs"):
            shares.options(placements.rollout, 1, role="reward", num_gpus=0.1)
        for tenant in tenants:
            ray.kill(tenant)
    finally:
        placements.remove()


def test_a_cluster_too_small_fails_at_once_with_the_numbers(local_ray: int) -> None:
    spec = PlacementSpec(actor_num_gpus_per_node=local_ray, rollout_num_gpus=2)
    before = set(ray.util.placement_group_table())
    started = time.monotonic()
    with pytest.raises(ClusterTooSmallError, match=f"asked for {local_ray + 2} GPUs") as raised:
        create_placement_groups(spec, timeout_s=600)
    assert time.monotonic() - started < 30, "it waited instead of failing at once"
    assert f"the cluster has {local_ray} GPUs and {local_ray} CPUs in all" in str(raised.value)
    assert "rollout_num_gpus" in str(raised.value)  # the fix names the flags
    assert set(ray.util.placement_group_table()) == before  # no group was even asked for


def test_without_the_check_it_waits_and_says_how_many_were_asked_and_how_many_exist(local_ray: int) -> None:
    """With an autoscaler the cluster may grow: `check_resources=False` waits, then times out clearly."""
    spec = PlacementSpec(actor_num_gpus_per_node=local_ray, rollout_num_gpus=2)
    before = set(ray.util.placement_group_table())
    with pytest.raises(PlacementTimeoutError, match=f"asked for {local_ray + 2} GPUs") as raised:
        create_placement_groups(spec, timeout_s=1, check_resources=False)
    assert f"the cluster has {local_ray} GPUs" in str(raised.value)
    assert "rollout_num_gpus" in str(raised.value)
    # The pending group was removed rather than left to grab GPUs later.
    new = {pg_id: info for pg_id, info in ray.util.placement_group_table().items() if pg_id not in before}
    assert [info["state"] for info in new.values()] == ["REMOVED"]
