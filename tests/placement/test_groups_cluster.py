"""Bundle ordering across nodes, end to end: raylets on loopback IPs 127.0.0.10 (head, 3 GPUs) and 127.0.0.9 (1 GPU)."""

from __future__ import annotations

import sys

import pytest

from tandem.placement import PlacementSpec, create_placement_groups

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="needs all of 127.0.0.0/8 on loopback (Linux)"),
    # Cluster.shutdown() kills the nodes' processes without reaping them all before the test
    # ends; Python then warns from Popen.__del__ (seen on a loaded 2-core machine).
    pytest.mark.filterwarnings("ignore:subprocess .* is still running:ResourceWarning"),
]


def test_bundles_are_ordered_by_node_ip_as_numbers_then_gpu(loopback_ray: tuple[str, str]) -> None:
    head, other = loopback_ray  # 127.0.0.10 and 127.0.0.9: text order and number order disagree
    spec = PlacementSpec(actor_num_gpus_per_node=3, rollout_num_gpus=1, use_critic=True)
    with create_placement_groups(spec, timeout_s=120) as placements:
        actor, rollout = placements.actor, placements.rollout
        assert placements.critic is actor
        # Rank 0 on .9 (its only GPU), then .10's GPUs in id order; the engine gets .10's last GPU.
        assert actor.node_ips == (other, head, head) and rollout.node_ips == (head,)
        assert actor.gpu_ids == (0, 0, 1) and rollout.gpu_ids == (2,)
        assert sorted(actor.bundle_indices + rollout.bundle_indices) == [0, 1, 2, 3]
        print(placements)  # shows which bundles moved, for whoever reads a failure
