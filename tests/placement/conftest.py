"""Ray for the placement tests: one local node with logical GPUs, or two "nodes" on loopback IPs.

Starts go through the shared `ray_start` fixture (tests/conftest.py), which tries
again when a busy machine makes the node time out starting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

LOCAL_GPUS = 4


@pytest.fixture(scope="module")
def local_ray(ray_start: Callable[[Callable[[], Any]], Any]) -> Iterator[int]:
    """A local Ray with LOCAL_GPUS logical GPUs (no real GPU needed); yields the GPU count."""
    if ray.is_initialized():
        ray.shutdown()
    # One logical CPU per bundle: Ray's CPUs here are bookkeeping, not processes.
    ray_start(
        lambda: ray.init(
            num_gpus=LOCAL_GPUS, num_cpus=LOCAL_GPUS, include_dashboard=False, log_to_driver=False
        )
    )
    yield LOCAL_GPUS
    ray.shutdown()


# As text "127.0.0.10" sorts first; as numbers 127.0.0.9 does. The head is .10 so that
# Ray's own node order (head first) disagrees with the wanted one.
HEAD_IP, OTHER_IP = "127.0.0.10", "127.0.0.9"


@pytest.fixture(scope="module")
def loopback_ray(ray_start: Callable[[Callable[[], Any]], Any]) -> Iterator[tuple[str, str]]:
    """Ray on two raylets with 3 and 1 logical GPUs, at HEAD_IP and OTHER_IP; yields (HEAD_IP, OTHER_IP).

    All of 127.0.0.0/8 is loopback on Linux, so each node can have its own IP on one
    machine and bundle ordering by node IP can be seen end to end.
    """
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster()
    try:
        # The head holds 3 GPUs and the other node 1, so PACK fills the head first and the
        # other node's bundle has to move to the front: the reordering is never a no-op.
        for ip, gpus in ((HEAD_IP, 3), (OTHER_IP, 1)):  # the first node added is the head
            ray_start(
                lambda ip=ip, gpus=gpus: cluster.add_node(
                    node_ip_address=ip, num_gpus=gpus, num_cpus=gpus, include_dashboard=False
                )
            )
        ray.init(address=cluster.address, _node_ip_address=HEAD_IP, log_to_driver=False)
        cluster.wait_for_nodes()
        yield HEAD_IP, OTHER_IP
    finally:
        ray.shutdown()
        cluster.shutdown()
