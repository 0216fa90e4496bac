"""A run that outgrows one box: `ppo-driver train` on an existing two-node Ray cluster, and through `ray job submit`.

The cluster is two `ray start` nodes on this machine (`_ray_cluster`: a head at
127.0.0.1 and a node at 127.0.0.2, one logical GPU each, free ports, a temp dir
of its own, found by no other process and stopped process by process). The actor
and the critic run data-parallel with one rank on each node (gloo), each next to
an engine. Before that, a start whose model folder the nodes cannot see (a
relative path, which the workers resolve in their own working directory) is
refused before any worker starts, naming the flag and the node.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.ppo._demo import DEMO_DEFAULTS, prepare_demo
from tandem.ppo.config.file import unvalidated, write_yaml

from .._ray_cluster import two_node_cluster

pytestmark = pytest.mark.slow

ACROSS_NODES = (
    "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--micro-batch-size", "16",
    "--num-rollout", "1", "--no-progress", "--no-tensorboard", "--no-export-hf",
)  # fmt: skip


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_trained_across_nodes(run_dir: Path) -> None:
    (placement,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "placement"]
    # One actor (and critic) rank on each node. Ray names the head by this machine's address (it
    # resolves 127.0.0.1 to it), the second node by 127.0.0.2.
    nodes = placement["actor_nodes"]
    assert len(nodes) == len(set(nodes)) == 2 and "127.0.0.2" in nodes, nodes
    # The demo's settings evaluate the starting weights (step -1), then the one step trained.
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [-1, 0]
    for role in ("actor", "critic"):
        assert (run_dir / role / "iter_0000000" / "metadata.json").is_file()


def test_ppo_trains_on_a_two_node_cluster_and_through_ray_job_submit(tmp_path: Path) -> None:
    config = unvalidated(prepare_demo({**DEMO_DEFAULTS, "run_dir": str(tmp_path / "demo")}))
    demo_yaml = tmp_path / "demo.yaml"
    write_yaml(config, demo_yaml)  # the demo's model, data and settings, absolute paths
    with two_node_cluster() as cluster:
        cluster.check_not_discoverable()

        def train(*flags: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
            command = [
                sys.executable,
                "-m",
                "tandem.ppo.app.cli",
                "train",
                "--config",
                str(demo_yaml),
                *flags,
            ]
            return subprocess.run(
                command, env=cluster.env, cwd=cwd, capture_output=True, text=True, timeout=1800
            )

        # A model folder the nodes do not see: refused before any worker starts.
        relative = train(
            "--ray-address", cluster.address, "--hf-checkpoint", "demo/base", "--run-dir", str(tmp_path / "bad"),
            *ACROSS_NODES, cwd=tmp_path,
        )  # fmt: skip
        assert relative.returncode == 2, relative.stderr[-4000:]
        last = relative.stderr.strip().splitlines()[-1]
        assert last.startswith("ppo-driver train: error: --hf-checkpoint: node 127.0.0."), last
        assert (
            f"does not see demo/base/config.json (the model folder; its working directory is {cluster.temp_dir}"
            in last
        )
        assert not (tmp_path / "bad").exists()

        # ppo-driver train --ray-address HEAD --actor-num-nodes 2 ...
        run_dir = tmp_path / "run"
        proc = train("--ray-address", cluster.address, "--run-dir", str(run_dir), *ACROSS_NODES)
        assert proc.returncode == 0, proc.stderr[-4000:]
        check_trained_across_nodes(run_dir)

        # ray job submit -- ppo-driver train ... (the job's driver runs on the head, RAY_ADDRESS set)
        job_dir = tmp_path / "job"
        submit = [
            str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", cluster.dashboard, "--",
            "ppo-driver", "train", "--config", str(demo_yaml), "--run-dir", str(job_dir), *ACROSS_NODES,
        ]  # fmt: skip
        job = subprocess.run(submit, env=cluster.env, capture_output=True, text=True, timeout=1800)
        assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
        assert "succeeded" in job.stdout, job.stdout[-4000:]
        check_trained_across_nodes(job_dir)
    assert cluster.leftover_processes() == []
