"""The adaptive KL controller: the reward-level KL coefficient steered towards a target KL, step by step.

Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences"
(arXiv:1909.08593), §2.2: with `e_t = clip(KL_t / KL_target − 1, −0.2, 0.2)`,

    β_{t+1} = β_t · (1 + K_β · e_t),   K_β = n / horizon,

where `n` is the number of samples the step's KL was measured on. A KL above the
target raises β, one below lowers it, by at most 20 % of `n / horizon` a step. verl
(b178a3c, `verl/trainer/ppo/core_algos.py` `AdaptiveKLController`; `n` the batch's
samples) and OpenRLHF (3c3be62, `openrlhf/trainer/ppo_utils/kl_controller.py`; `n`
= rollout batch size × samples per prompt) implement the same update; each feeds it
its step's KL measured with its own estimator (verl: the mean over samples of each
sample's token mean; Tandem: `reward_kl`, the token mean over the rollout).

The coefficient of step `t` is a pure function of the starting value and the KLs of
the steps before (`adaptive_kl_coef`), so a resumed run recomputes it from the metrics
it saved and needs no state of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["KL_ERROR_CLIP", "adaptive_kl_coef", "kl_controller_update"]

KL_ERROR_CLIP = 0.2
"""The proportional error `KL / target − 1` is clipped to ±this."""


def kl_controller_update(coef: float, kl: float, target: float, horizon: int, n_steps: int) -> float:
    """One step of the controller: `coef · (1 + clip(kl / target − 1, ±0.2) · n_steps / horizon)`.

    Args:
        coef: the coefficient the step used (β_t), >= 0.
        kl: the KL the step measured.
        target: the target KL, > 0.
        horizon: the controller's horizon in samples, > 0.
        n_steps: the samples the KL was measured on.
    """
    if not (math.isfinite(target) and target > 0) or horizon <= 0:
        raise ValueError(
            f"kl_controller_update: `target` and `horizon` must be > 0, got {target} and {horizon}"
        )
    error = min(max(kl / target - 1.0, -KL_ERROR_CLIP), KL_ERROR_CLIP)
    return coef * (1.0 + error * n_steps / horizon)


def adaptive_kl_coef(init: float, target: float, horizon: int, n_steps: int, kls: Iterable[float]) -> float:
    """The coefficient after the steps whose KLs are `kls` (in order), starting from `init`.

    `n_steps`: each step's samples (`samples_per_rollout`). A KL that is not finite
    (a step that measured none) leaves the coefficient as it was.
    """
    coef = init
    for kl in kls:
        if math.isfinite(kl):
            coef = kl_controller_update(coef, kl, target, horizon, n_steps)
    return coef
