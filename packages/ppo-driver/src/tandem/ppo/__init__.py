"""Tandem's PPO driver: the run config, the driver loop, rollout engines, rewards, data, and `ppo-driver`.

- `PPOConfig`, `parse_config`: one typed config for a whole run (YAML plus flags), validated before Ray starts.
- `train(config)`, `PPODriver`: the PPO loop in which actor and critic time-share the GPUs.
- `build_base_model`, `write_task`: the demo's tiny local model and task (no downloads).
- `main`: the `ppo-driver` console script.

The package is cut in layers, lowest first, each importing only those below it
(tests/test_import_graph.py): `engines` (rollout engines), `rollout` (prompt data,
rewards, a reward model, a round of sampling), `config` (the run's fields, checks,
file and flags), `run` (the run folder, checkpoints, events, metrics, logs), `loop`
(the driver, the step's schedule and turns, the roles on the GPUs) and `app` (the
command; the demos' tasks `_demo`, `_sums`, `_tiny` beside it, here at the top).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

try:
    __version__ = _version("tandem-ppo-driver")
except PackageNotFoundError:  # source tree on PYTHONPATH (an offline GPU host), not installed
    __version__ = "0+unknown"

# Imported on first use: `ppo-driver` sets Ray's environment before anything imports Ray.
_EXPORTS = {
    "build_base_model": "_demo",
    "write_task": "_demo",
    "main": "app.cli",
    "PPOConfig": "config.ppo_config",
    "parse_config": "config.file",
    "PPODriver": "loop.driver",
    "RunSummary": "run.log",
    "train": "loop.training",
}

if TYPE_CHECKING:
    from ._demo import build_base_model, write_task
    from .app.cli import main
    from .config.file import parse_config
    from .config.ppo_config import PPOConfig
    from .loop.driver import PPODriver
    from .loop.training import train
    from .run.log import RunSummary


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "PPOConfig",
    "PPODriver",
    "RunSummary",
    "__version__",
    "build_base_model",
    "main",
    "parse_config",
    "train",
    "write_task",
]
