"""Tandem's Megatron-core backend: the train worker (actor and critic roles), models, HF weights, PPO math.

The package is cut in layers; a module imports only from its own layer and the
ones above it in this list (tests/test_import_graph.py):

1. the shared data: `choices` (the literal choices of every field), `batch` (`RolloutBatch`);
2. `algorithms`: the PPO math, pure torch;
3. `models`: the Megatron networks, HF config, weights and conversion, RoPE, packing, attention;
4. the seam both sides share: `config` (`WorkerConfig`, the checked config, over its
   check-free fields `WorkerFields`), `payloads` (the typed records
   that cross between driver and workers, and their routing);
5. `worker`: the process side (`TrainWorker`, the roles' train steps, checkpoints); imports Megatron;
6. `group`: the driver side (`TrainGroup`, `create_train_group`); never imports Megatron.

Names are imported on first use, so `from tandem.megatron import compute_gae`
loads only torch, while `TrainWorker` or `build_model` load megatron-core (about
30 s on a small CPU machine).

- PPO math (torch only): `compute_gae`, `lambda_returns`, `policy_loss`, `value_loss`,
  `aggregate_loss`, `loss_sum_and_count`, `approx_kl`, `whiten_advantages`,
  `entropy_from_logits`, `explained_variance`.
- On-policy distillation (torch only): `reverse_kl`, `distillation_rewards`, `distillation_loss`.
- Critic-free estimators, GSPO and CISPO (torch only): `grpo_advantages`, `rloo_advantages`,
  `group_centered_rewards`, `discounted_returns`, `token_advantages`, `gspo_policy_loss`,
  `cispo_policy_loss`.
- Data: `RolloutBatch` (with its padded per-token targets), `pad_responses`, `unpad_responses`.
- Models and weights: `ModelSpec`, `build_model`, `load_hf_checkpoint`,
  `export_hf_weights`, and the pure HF ⇄ Megatron mapping `param_map`, `to_megatron`, `to_hf`.
- Forward passes: `forward_only`, `run_micro_batches`.
- The worker: `WorkerConfig` (its fields alone, unchecked: `WorkerFields`); process side `TrainWorker` (imports Megatron); driver
  side `TrainGroup`, `create_train_group` (never imports Megatron); the records
  `TrainResult`, `CriticValues`, `ActorLogProbs`.
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
    "compute_gae": "algorithms.gae",
    "lambda_returns": "algorithms.gae",
    "loss_sum_and_count": "algorithms.losses",
    "policy_loss": "algorithms.losses",
    "value_loss": "algorithms.losses",
    "aggregate_loss": "algorithms.losses",
    "explained_variance": "algorithms.losses",
    "approx_kl": "algorithms.kl",
    "reverse_kl": "algorithms.distillation",
    "distillation_rewards": "algorithms.distillation",
    "distillation_loss": "algorithms.distillation",
    "whiten_advantages": "algorithms.advantages",
    "grpo_advantages": "algorithms.estimators",
    "rloo_advantages": "algorithms.estimators",
    "group_centered_rewards": "algorithms.estimators",
    "discounted_returns": "algorithms.estimators",
    "token_advantages": "algorithms.estimators",
    "gspo_policy_loss": "algorithms.gspo",
    "cispo_policy_loss": "algorithms.cispo",
    "entropy_from_logits": "algorithms.entropy",
    "RolloutBatch": "batch",
    "pad_responses": "batch",
    "unpad_responses": "batch",
    "ModelSpec": "models.hf_config",
    "build_model": "models.networks",
    "load_hf_checkpoint": "models.hf_weights",
    "export_hf_weights": "models.hf_weights",
    "param_map": "models.conversion",
    "to_megatron": "models.conversion",
    "to_hf": "models.conversion",
    "forward_only": "worker.forward",
    "run_micro_batches": "worker.forward",
    "WorkerConfig": "config",
    "WorkerFields": "config",
    "TrainWorker": "worker.train_worker",
    "TrainGroup": "group.train_group",
    "create_train_group": "group.train_group",
    "TrainResult": "payloads",
    "CriticValues": "payloads",
    "ActorLogProbs": "payloads",
}

if TYPE_CHECKING:
    from .algorithms.advantages import whiten_advantages
    from .algorithms.cispo import cispo_policy_loss
    from .algorithms.distillation import distillation_loss, distillation_rewards, reverse_kl
    from .algorithms.entropy import entropy_from_logits
    from .algorithms.estimators import (
        discounted_returns,
        group_centered_rewards,
        grpo_advantages,
        rloo_advantages,
        token_advantages,
    )
    from .algorithms.gae import compute_gae, lambda_returns
    from .algorithms.gspo import gspo_policy_loss
    from .algorithms.kl import approx_kl
    from .algorithms.losses import (
        aggregate_loss,
        explained_variance,
        loss_sum_and_count,
        policy_loss,
        value_loss,
    )
    from .batch import RolloutBatch, pad_responses, unpad_responses
    from .config import WorkerConfig, WorkerFields
    from .group.train_group import TrainGroup, create_train_group
    from .models.conversion import param_map, to_hf, to_megatron
    from .models.hf_config import ModelSpec
    from .models.hf_weights import export_hf_weights, load_hf_checkpoint
    from .models.networks import build_model
    from .payloads import ActorLogProbs, CriticValues, TrainResult
    from .worker.forward import forward_only, run_micro_batches
    from .worker.train_worker import TrainWorker


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
    "ActorLogProbs",
    "CriticValues",
    "ModelSpec",
    "RolloutBatch",
    "TrainGroup",
    "TrainResult",
    "TrainWorker",
    "WorkerConfig",
    "WorkerFields",
    "__version__",
    "aggregate_loss",
    "approx_kl",
    "build_model",
    "cispo_policy_loss",
    "compute_gae",
    "create_train_group",
    "discounted_returns",
    "distillation_loss",
    "distillation_rewards",
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
    "reverse_kl",
    "rloo_advantages",
    "run_micro_batches",
    "to_hf",
    "to_megatron",
    "token_advantages",
    "unpad_responses",
    "value_loss",
    "whiten_advantages",
]
