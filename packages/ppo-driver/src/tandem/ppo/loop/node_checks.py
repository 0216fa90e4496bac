"""What every node of a cluster must see before the workers start: the model folders and the run folder.

On a cluster of several machines a worker reads the model from `--hf-checkpoint`
on its own node, and the ranks of a model write their shards of a checkpoint
into the same folder under RUN_DIR: both paths must lead to the same files on
every node (a shared filesystem, or copies at the same path for the model).
`check_nodes_see_folders` runs one tiny task on each node of the run's
placement groups, after they are placed and before any worker starts, and
refuses the run naming the flag, the node and the path. The run folder counts as
seen where this run's own lock file is (`run_lock`), with this driver's PID in
it: a node with a folder of the same name that is not shared does not pass.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["check_nodes_see_folders", "folders_to_check"]

PROBE_CPUS = 0.01
"""CPU share of each probe task (the bundles are free then: no worker has started yet)."""

PROBE_TIMEOUT_S = 300.0
"""Seconds to wait for the probes (a node that must start a worker process first)."""


def _read(paths: Sequence[str]) -> list[str | None]:
    """On the node: each path's contents (a file), "" (a folder), or None (not there); and the working dir."""
    out: list[str | None] = []
    for path in paths:
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    out.append(f.read())
            except OSError:
                out.append(None)
        else:
            out.append("" if os.path.isdir(path) else None)
    return [*out, os.getcwd()]


def folders_to_check(config: Any, lock_file: Path) -> list[tuple[str, str, str | None]]:
    """(flag, path, expected contents or None: it must only exist) for `config`'s folders."""
    checks: list[tuple[str, str, str | None]] = [
        ("--hf-checkpoint", os.path.join(config.hf_checkpoint, "config.json"), None)
    ]
    for flag, folder in (
        ("--critic-hf-checkpoint", config.critic_hf_checkpoint),
        ("--ref-load", config.ref_load),
        ("--reward-model", config.reward_model),
        ("--teacher-hf-checkpoint", config.teacher_hf_checkpoint),
    ):
        if folder:
            checks.append((flag, os.path.join(folder, "config.json"), None))
    checks.append(("--run-dir", os.path.abspath(lock_file), lock_file.read_text()))
    return checks


def check_nodes_see_folders(slots: Sequence[Any], checks: Sequence[tuple[str, str, str | None]]) -> None:
    """One probe per node of `slots` (tandem.placement `Slot`s); ValueError naming the flag, node and path."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(_read)
    targets: dict[str, tuple[Any, int]] = {}
    for slot in slots:
        if slot is None or slot.pg is None:
            continue
        ips = slot.node_ips or ("?",) * len(slot.bundle_indices)
        for ip, bundle in zip(ips, slot.bundle_indices, strict=True):
            targets.setdefault(ip, (slot.pg, bundle))
    if len(targets) < 2 and "?" not in targets:
        return  # one node: the driver's own checks saw the same files
    paths = [path for _, path, _ in checks]
    refs = {
        ip: probe.options(
            num_cpus=PROBE_CPUS,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=b
            ),
        ).remote(paths)
        for ip, (pg, b) in targets.items()
    }
    for ip, ref in refs.items():
        *seen, cwd = ray.get(ref, timeout=PROBE_TIMEOUT_S)
        for (flag, path, expected), found in zip(checks, seen, strict=True):
            if found is None or (expected is not None and found != expected):
                what = "this run's lock file" if flag == "--run-dir" else "the model folder"
                raise ValueError(
                    f"{flag}: node {ip} does not see {path} ({what}; its working directory is {cwd}); every "
                    "node needs the same folder at the same path: put it on a filesystem that all nodes "
                    "share (or, for a model, copy it to that path on each node), and give absolute paths"
                )
