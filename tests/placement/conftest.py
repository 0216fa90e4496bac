"""Ray for the placement tests: one local node with logical GPUs, or two "nodes" on loopback IPs.

Ray's raylet aborts its start when the dashboard agent has not written its port
files within about 15 s, which happens on a busy 2-core machine; a start that
timed out is cleaned up and tried again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

ray = pytest.importorskip("ray")

STARTUP_ATTEMPTS = 3
LOCAL_GPUS = 4


def start_with_retries[T](start: Callable[[], T]) -> T:
    """Run a Ray start (ray.init, Cluster.add_node), again if the node timed out starting."""
    for attempt in range(1, STARTUP_ATTEMPTS + 1):
        try:
            return start()
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == STARTUP_ATTEMPTS:
                raise
            _kill_half_started_node(exc)
    raise AssertionError("unreachable")


def _kill_half_started_node(exc: BaseException) -> None:
    # Node.__init__ raised, so nobody holds the Node; its `self` is still in the traceback.
    from ray._private.node import Node

    tb = exc.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            node.kill_all_processes(check_alive=False, wait=True)
            return
        tb = tb.tb_next


@pytest.fixture(scope="module")
def local_ray() -> Iterator[int]:
    """A local Ray with LOCAL_GPUS logical GPUs (no real GPU needed); yields the GPU count."""
    if ray.is_initialized():
        ray.shutdown()
    # One logical CPU per bundle: Ray's CPUs here are bookkeeping, not processes.
    start_with_retries(
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
def loopback_ray() -> Iterator[tuple[str, str]]:
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
            start_with_retries(
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
