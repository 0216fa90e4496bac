"""Step 1 of a PPO step: prompts, the engines' samples, rewards (rules and a reward model), per-rank batches.

Names are imported on first use: `from tandem.ppo.rollout import Rollout`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_NAMES = (
    "Rollout",
    "Sampled",
    "dynamic_sample",
    "generate_rollout",
    "has_signal",
    "sampling_params",
    "shard_per_role",
    "to_train_batches",
    "training_rewards",
)
_EXPORTS = dict.fromkeys(_NAMES, "samples")

if TYPE_CHECKING:
    from .samples import (
        Rollout,
        Sampled,
        dynamic_sample,
        generate_rollout,
        has_signal,
        sampling_params,
        shard_per_role,
        to_train_batches,
        training_rewards,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "Rollout",
    "Sampled",
    "dynamic_sample",
    "generate_rollout",
    "has_signal",
    "sampling_params",
    "shard_per_role",
    "to_train_batches",
    "training_rewards",
]
