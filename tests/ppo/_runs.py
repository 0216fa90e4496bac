"""The one way the tests run the PPO driver in-process: a config of the demo's task, and a run of it as a
job of the session's Ray cluster (`ray_cluster` in tests/conftest.py).

A run joins the cluster through its own `ray_address`, as `ppo-driver train --ray-address` does, so
the driver starts Ray exactly as a user's run on an existing cluster: with the worker-log hook of its
job, and leaving the cluster (its actors and placement groups ended by Ray) when it closes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.ppo._demo import DEMO_DEFAULTS, prepare_demo
from tandem.ppo.config import PPOConfig
from tandem.ppo.config.file import unvalidated
from tandem.ppo.loop.driver import PPODriver, RunSummary


def demo_config(run_dir: Path, **overrides: Any) -> PPOConfig:
    """The demo's settings, model and data (built under `run_dir`), with `overrides`."""
    values = {**DEMO_DEFAULTS, "run_dir": str(run_dir), "progress": False, **overrides}
    return unvalidated(prepare_demo(values))


def run_driver(
    config: PPOConfig,
    ray_address: str,
    *,
    snapshot: bool = False,
    after: Callable[[PPODriver], None] | None = None,
) -> RunSummary:
    """Run the driver on the cluster at `ray_address`; with `snapshot`, save each model's final weights
    and optimizer state to `last_state(RUN_DIR, role)`.

    `after(driver)` runs once the run is over, before the workers stop.
    """
    driver = PPODriver(dataclasses.replace(config, ray_address=ray_address))
    try:
        driver.setup()
        summary = driver.run()
        if snapshot:
            for group in (driver.actor, driver.critic):
                assert group is not None
                group.run("wake_up")
                torch.save(group.run("state_snapshot")[0], last_state(Path(config.run_dir), group.role))
        if after is not None:
            after(driver)
        return summary
    finally:
        driver.close()


def last_state(run_dir: Path, role: str) -> Path:
    """Where `run_driver(..., snapshot=True)` saves `role`'s final state."""
    return run_dir / f"{role}_state.pt"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
