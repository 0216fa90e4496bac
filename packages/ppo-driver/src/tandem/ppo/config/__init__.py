"""The run's config: `PPOConfig`, its checks, its YAML file and flags, and the flags' help.

Names are imported on first use: `from tandem.ppo.config import PPOConfig`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "BUILTIN_REWARDS": "fields",
    "FLAG_NAMES": "fields",
    "PPOConfig": "ppo_config",
    "RunFields": "fields",
    "flag": "fields",
}

if TYPE_CHECKING:
    from .fields import BUILTIN_REWARDS, FLAG_NAMES, RunFields, flag
    from .ppo_config import PPOConfig


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = ["BUILTIN_REWARDS", "FLAG_NAMES", "PPOConfig", "RunFields", "flag"]
