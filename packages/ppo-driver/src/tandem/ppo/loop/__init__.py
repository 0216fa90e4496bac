"""The PPO loop: the driver, one step's schedule and its turns, the weights to the engines, the run's start-up.

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
