"""Tandem's Megatron-core backend: the train worker (actor and critic roles), models, HF weights, PPO math.

Names are imported on first use, so `from tandem.megatron import compute_gae`
loads only torch, while `TrainWorker` or `build_model` load megatron-core (about
30 s on a small CPU machine).

- PPO math (torch only): `compute_gae`, `lambda_returns`, `policy_loss`, `value_loss`,
  `aggregate_loss`, `loss_sum_and_count`, `approx_kl`, `whiten_advantages`,
  `entropy_from_logits`, `explained_variance`.
- Critic-free estimators and GSPO (torch only): `grpo_advantages`, `rloo_advantages`,
  `group_centered_rewards`, `discounted_returns`, `token_advantages`, `gspo_policy_loss`.
- Data: `RolloutBatch` (with its padded per-token targets), `pad_responses`, `unpad_responses`.
- Models and weights: `ModelSpec`, `build_model`, `load_hf_checkpoint`,
  `export_hf_weights`, and the pure HF ⇄ Megatron mapping `param_map`, `to_megatron`, `to_hf`.
- Forward passes: `forward_only`, `run_micro_batches`.
- The worker: `WorkerConfig`; process side `TrainWorker` (imports Megatron); driver
  side `TrainGroup`, `create_train_group` (never imports Megatron).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

try:
    __version__ = _version("tandem-megatron-backend")
except PackageNotFoundError:  # source tree on PYTHONPATH (the offline GPU host), not installed
    __version__ = "0+unknown"

_EXPORTS = {
    "compute_gae": "gae",
    "lambda_returns": "gae",
    "loss_sum_and_count": "losses",
    "policy_loss": "losses",
    "value_loss": "losses",
    "aggregate_loss": "losses",
    "explained_variance": "losses",
    "approx_kl": "kl",
    "whiten_advantages": "advantages",
    "grpo_advantages": "estimators",
    "rloo_advantages": "estimators",
    "group_centered_rewards": "estimators",
    "discounted_returns": "estimators",
    "token_advantages": "estimators",
    "gspo_policy_loss": "gspo",
    "entropy_from_logits": "entropy",
    "RolloutBatch": "batch",
    "pad_responses": "batch",
    "unpad_responses": "batch",
    "ModelSpec": "hf_config",
    "build_model": "models",
    "load_hf_checkpoint": "hf_weights",
    "export_hf_weights": "hf_weights",
    "param_map": "conversion",
    "to_megatron": "conversion",
    "to_hf": "conversion",
    "forward_only": "forward",
    "run_micro_batches": "forward",
    "WorkerConfig": "config",
    "TrainWorker": "worker",
    "TrainGroup": "group",
    "create_train_group": "group",
}

if TYPE_CHECKING:
    from .advantages import whiten_advantages
    from .batch import RolloutBatch, pad_responses, unpad_responses
    from .config import WorkerConfig
    from .conversion import param_map, to_hf, to_megatron
    from .entropy import entropy_from_logits
    from .estimators import (
        discounted_returns,
        group_centered_rewards,
        grpo_advantages,
        rloo_advantages,
        token_advantages,
    )
    from .forward import forward_only, run_micro_batches
    from .gae import compute_gae, lambda_returns
    from .group import TrainGroup, create_train_group
    from .gspo import gspo_policy_loss
    from .hf_config import ModelSpec
    from .hf_weights import export_hf_weights, load_hf_checkpoint
    from .kl import approx_kl
    from .losses import aggregate_loss, explained_variance, loss_sum_and_count, policy_loss, value_loss
    from .models import build_model
    from .worker import TrainWorker


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
    "ModelSpec",
    "RolloutBatch",
    "TrainGroup",
    "TrainWorker",
    "WorkerConfig",
    "__version__",
    "aggregate_loss",
    "approx_kl",
    "build_model",
    "compute_gae",
    "create_train_group",
    "discounted_returns",
    "entropy_from_logits",
    "explained_variance",
    "export_hf_weights",
    "forward_only",
    "group_centered_rewards",
    "grpo_advantages",
    "gspo_policy_loss",
    "lambda_returns",
    "load_hf_checkpoint",
    "loss_sum_and_count",
    "pad_responses",
    "param_map",
    "policy_loss",
    "rloo_advantages",
    "run_micro_batches",
    "to_hf",
    "to_megatron",
    "token_advantages",
    "unpad_responses",
    "value_loss",
    "whiten_advantages",
]
