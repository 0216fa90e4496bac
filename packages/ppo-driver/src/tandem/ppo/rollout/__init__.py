"""Step 1 of a PPO step: prompts, the engines' samples, rewards (rules and a reward model), per-rank batches.

`data` (prompt files and the data cursor; `prompt_tables`: Parquet and `datasets` folders), `rewards` (the rule rewards and user
functions), `reward_mix` (the reward as a weighted sum of terms), `reward_model/`
(a reward model on the shared GPUs), `samples` (a round of sampling, its scores,
dynamic sampling), `train_batches` (the rewards trained on, the per-rank batches), `episodes/` (multi-turn rollouts with an
environment, tools and a chat endpoint), `preflight` (the run's inputs checked
before Ray starts) and `model_folder` (the "folder missing" error of every model
flag). It may import the engines, torch, transformers, Ray and
tandem.megatron's shared data and algorithms; never the config, the run folder,
the loop or the command: what it needs of the config it names as a Protocol
(tests/test_import_graph.py).

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
_EXPORTS = dict.fromkeys(_NAMES, "samples") | dict.fromkeys(
    ("shard_per_role", "to_train_batches", "training_rewards"), "train_batches"
)

if TYPE_CHECKING:
    from .samples import (
        Rollout,
        Sampled,
        dynamic_sample,
        generate_rollout,
        has_signal,
        sampling_params,
    )
    from .train_batches import shard_per_role, to_train_batches, training_rewards


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
