"""A `ray start` cluster of our own on this machine: a head at 127.0.0.1 (and a node at 127.0.0.2), logical GPUs.

Two uses: the session's one-node cluster that most Ray tests join as a job of their own
(`ray_cluster` in tests/conftest.py), and tests/ppo/test_cluster.py's two nodes.

On a machine that other test runs share, such a cluster must never be found by
anyone else's `ray.init()`, and stopping it must stop nothing else:

- every port is a free one picked here, none of Ray's defaults (6379, 8265, ...);
- Ray's temp dir is a fresh folder of our own (`--temp-dir`): `ray start` writes the
  "current cluster" file, which `ray.init()` without an address reads to join a
  cluster, into that temp dir (`ray._private.utils.write_ray_address(address,
  temp_dir)`), not into /tmp/ray where everybody else's `ray.init()` looks
  (`get_ray_address_file(None)`); `check_not_discoverable` checks that this held;
- nothing is exported: the address reaches our own commands through their `env` only;
- each node is one `ray start --block` process, which makes itself a process group
  leader and starts Ray's daemons in that group (with a reaper that ends the group when
  it dies); `stop` sends SIGTERM, then SIGKILL, to exactly those process groups. Never
  `ray stop`, which ends every Ray process of the machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RAY = str(Path(sys.executable).parent / "ray")
DEFAULT_ADDRESS_FILE = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
"""Where `ray.init()` without an address looks for a cluster to join (Ray's default temp dir)."""
STOP_GRACE_S = 5.0
"""How long `LocalCluster.stop` waits after SIGTERM before SIGKILL. `ray start --block` answers SIGTERM
with Ray's own graceful stop of its daemons, which took 33 s on two cores with nothing left to do; a
test cluster has nothing to keep (its temp dir goes with it), so it is killed after a few seconds."""
WORKER_PORTS = 201
"""Ports of a node's worker range (`--min-worker-port` .. `--max-worker-port`)."""


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _file_state(path: Path) -> tuple[float, str] | None:
    try:
        return path.stat().st_mtime, path.read_text()
    except FileNotFoundError:
        return None


class LocalCluster:
    """Start with `start()`, stop with `stop()` (or use `two_node_cluster()` / `local_cluster()`)."""

    def __init__(
        self,
        gpus_per_node: int = 1,
        cpus_per_node: int = 2,
        dashboard: bool = True,
        nodes: int = 2,
        env: dict[str, str] | None = None,
    ) -> None:
        if nodes not in (1, 2):
            raise ValueError(f"nodes: {nodes}; a head alone (1) or a head and a node at 127.0.0.2 (2)")
        self.nodes = nodes
        self.with_dashboard = dashboard
        self.gpus_per_node = gpus_per_node
        self.cpus_per_node = cpus_per_node
        # Short: Ray puts unix sockets under it (108 bytes at most for a socket path).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="tdm-ray-", dir="/tmp"))
        self.port, self.dashboard_port, self.client_port = free_ports(3)
        self._taken: set[int] = {self.port, self.dashboard_port, self.client_port}
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self._default_file_before = _file_state(DEFAULT_ADDRESS_FILE)
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env |= {
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
            # Loopback only: no token (a local `ray.init()` may have left ~/.ray/auth_token, which the
            # head would then require of every node and driver).
            "RAY_AUTH_MODE": "disabled",
            # `ppo-driver` and `ray` of this environment first (ray job submit runs a shell command).
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        self.env |= env or {}

    def _node_ports(self) -> list[str]:
        """A node's ports: a range of 201 for its workers, then six free ports outside every range and
        port this cluster already uses (a free port drawn on its own can fall inside the workers'
        range, and `ray start` then refuses to start: "worker_ports is trying to use a port number
        that is used by other components")."""
        low = free_ports(1)[0]
        while low + WORKER_PORTS > 65535 or any(low <= p < low + WORKER_PORTS for p in self._taken):
            low = free_ports(1)[0]
        self._taken |= set(range(low, low + WORKER_PORTS))
        picked: list[int] = []
        while len(picked) < 6:
            picked += [p for p in free_ports(6 - len(picked)) if p not in self._taken and p not in picked]
        self._taken |= set(picked)
        manager, objects, agent, agent_grpc, metrics, runtime_env = picked
        return [
            "--node-manager-port", str(manager), "--object-manager-port", str(objects),
            "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
            "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(runtime_env),
            "--min-worker-port", str(low), "--max-worker-port", str(low + WORKER_PORTS - 1),
        ]  # fmt: skip

    def _start_node(self, name: str, args: list[str]) -> None:
        log = open(self.temp_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [RAY, "start", "--block", "--temp-dir", str(self.temp_dir), "--disable-usage-stats", *args,
             "--num-gpus", str(self.gpus_per_node), "--num-cpus", str(self.cpus_per_node), *self._node_ports()],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            cwd=self.temp_dir,  # the workers' working directory: not the driver's
        )  # fmt: skip
        log.close()
        self.procs.append(proc)

    def start(self, timeout_s: float = 600.0) -> None:
        """The head, then the second node once the head answers; returns when all are up."""
        self._start_node(
            "head",
            ["--head", "--node-ip-address", "127.0.0.1", "--port", str(self.port),
             "--include-dashboard", str(self.with_dashboard).lower(),
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
             # Ray's client server would take port 10001, which another test run's head may hold.
             "--ray-client-server-port", str(self.client_port)],
        )  # fmt: skip
        self._wait_for(lambda: self._answers(self.port), timeout_s, "the head's GCS port")
        if self.nodes == 2:
            self._start_node("node", ["--address", self.address, "--node-ip-address", "127.0.0.2"])
        self._wait_for(lambda: self.alive_nodes() == self.nodes, timeout_s, f"{self.nodes} alive node(s)")
        if self.with_dashboard:
            self._wait_for(
                lambda: self._answers(self.dashboard_port), timeout_s, "the dashboard (job server)"
            )

    @staticmethod
    def _answers(port: int) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
        return False

    def _wait_for(self, ready: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"`ray start` exited with {proc.returncode} waiting for {what}: {self.logs()}"
                    )
            if ready():
                return
            time.sleep(2)
        raise RuntimeError(f"no {what} after {timeout_s:g} s: {self.logs()}")

    def alive_nodes(self) -> int:
        """Alive nodes, asked of the cluster by a short-lived driver in its own process."""
        code = "import ray; ray.init(address=%r, log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))"
        proc = subprocess.run(
            [sys.executable, "-c", code % self.address],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return (
            int(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 and proc.stdout.strip() else 0
        )

    def logs(self) -> str:
        return " | ".join(
            f"{p.name}: {p.read_text(errors='replace')[-1500:]}" for p in sorted(self.temp_dir.glob("*.log"))
        )

    def check_not_discoverable(self) -> None:
        """The current-cluster file went into our temp dir and the machine's default one is untouched."""
        ours = self.temp_dir / "ray_current_cluster"
        assert ours.is_file() and ours.read_text().strip().endswith(f":{self.port}"), ours
        assert _file_state(DEFAULT_ADDRESS_FILE) == self._default_file_before, DEFAULT_ADDRESS_FILE

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to each node's process group (the `ray start` process leads it), `grace_s` for it to
        end, then SIGKILL to the groups and to whatever of their sessions is left (workers run in
        process groups of their own, in that session)."""
        groups = []
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                groups.append(os.getpgid(proc.pid))
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        deadline = time.monotonic() + 60
        while (left := self.leftover_processes()) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)  # a killed process leaves the table once reaped

    def leftover_processes(self) -> list[int]:
        """Processes still running in the sessions of our `ray start` processes (each started one)."""
        sessions = {proc.pid for proc in self.procs}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in sessions:
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                # Field 6 of /proc/PID/stat is the session id; the name (field 2) may hold spaces.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) in sessions and fields[0] != "Z":
                    found.append(int(entry.name))
        return found


@contextlib.contextmanager
def two_node_cluster(**kwargs: Any) -> Iterator[LocalCluster]:
    """A started two-node cluster, stopped (exactly its processes) and its temp dir removed afterwards."""
    with local_cluster(nodes=2, **kwargs) as cluster:
        yield cluster


@contextlib.contextmanager
def local_cluster(**kwargs: Any) -> Iterator[LocalCluster]:
    """A started cluster (`LocalCluster(**kwargs)`), stopped and its temp dir removed afterwards."""
    import shutil

    cluster = LocalCluster(**kwargs)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
