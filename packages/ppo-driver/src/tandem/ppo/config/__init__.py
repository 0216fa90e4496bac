"""The run's config: `PPOConfig`, its checks, its YAML file and flags, and the flags' help.

`fields` (`RunFields`, every flag, unchecked), `ppo_config` (`PPOConfig`: the fields
and `validate`), `checks` (the rules; the estimator's in `estimator_plan`, the
reward model's beside it in the rollout layer), `file` (YAML in and out, flags over
a file), `field_values` (YAML values read as the flags read them), `record` (a run's
own config.yaml), `flag_help` (`--help`) and `hub` (hub ids as local folders). It may
import the rollout layer and the engines below it, tandem.megatron's config and
tandem-placement's layout; never the run folder, the loop or the command, and never
torch, Ray or Megatron, lazily or not: `--help` and `--dry-run` load none of them
(tests/test_import_graph.py).

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
