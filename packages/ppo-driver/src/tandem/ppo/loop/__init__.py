"""The PPO loop: the driver, one step's schedule and its turns, the weights to the engines, the run's start-up.

A newcomer reads the step here: `driver` (`PPODriver`: setup, one step, save, eval), `training`
(`train`: one start of a run as a command runs it),
`schedule` (a step's turns as data, checked), `memory_model`, `turn_memory`, `memory_plan` and
`memory_planner` (the memory tags asleep at each turn, chosen and checked against the GPU), `memory_figures` (the plan's inputs read
off the run's roles, `--memory-plan fit`), `step_plans` (which steps take the plan: `StepPlans`), `out_of_memory` (a step's out-of-memory error and its note),
`turns` (each turn's work),
`shared_gpus` (`SharedGpus`: the roles on the GPUs and who is awake; `planned_moves`, its memory
plan's tag sleeps and wakes), `weight_sync`,
`step_metrics`, `hints` (the run's hints said), `run_loop` (one step per rollout, sync or async, Ctrl-C), `startup`
(the run's processes coming up), `cluster` (Ray, placement groups, the groups) and
`node_checks`. It may import every layer below: the run folder, the config, the
rollout layer, the engines, tandem.megatron's `group` and shared records,
tandem-placement; never the command (tests/test_import_graph.py).

Names are imported on first use: `from tandem.ppo.loop import run_loop`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"Steps": "run_loop", "due": "run_loop", "run_loop": "run_loop"}

if TYPE_CHECKING:
    from .run_loop import Steps, due, run_loop


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = ["Steps", "due", "run_loop"]
