"""How each rollout bundle's Ray GPU share is split between the engine and the forward-only roles beside it (pure)."""

from __future__ import annotations

from typing import Any, NamedTuple

from tandem.ppo.rollout.reward_mix import MODEL_TERM, reward_terms


class RolloutShares(NamedTuple):
    """The Ray GPU shares on each rollout bundle: the engine's, the reward model's and the teacher's (None: no such role)."""

    engine: float
    reward_model: float | None
    teacher: float | None


def rollout_bundle_shares(config: Any) -> RolloutShares:
    """The engine's, the reward model's and the teacher's Ray GPU share on each rollout bundle.

    The engine's slot is `--engine-gpu-share` when colocated, else the whole GPU; a reward
    model takes `--reward-model-gpu-share` of that slot, a teacher `--teacher-gpu-share`, and
    the engine the rest (scheduling only: in a shared step they never hold memory at once).
    """
    slot = config.engine_gpu_share if config.colocate else 1.0
    reward_model = config.reward_model_gpu_share if MODEL_TERM in reward_terms(config) else None
    teacher = config.teacher_gpu_share if config.teacher_hf_checkpoint else None
    rest = 1.0 - (reward_model or 0.0) - (teacher or 0.0)
    return RolloutShares(
        slot * rest,
        None if reward_model is None else slot * reward_model,
        None if teacher is None else slot * teacher,
    )
