"""The PPO algorithm's checks that `WorkerConfig` runs at construction (`check_ppo`, `check_estimator`):
the losses' and clips' figures, the old log-probs' and values' reuse, the advantage estimator and the fields
only it or a critic uses, the KL controller, on-policy distillation. Each raises a `FieldError`: the field,
and the fix. The layout's, the batches', the folders' and LoRA's checks are `_config_checks`'.

Each function takes the `WorkerConfig` being built (typed `Any`: config.py imports this module).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tandem.megatron._field_error import FieldError
from tandem.megatron.choices import estimator as estimator_of

__all__ = ["check_estimator", "check_ppo"]


def _check_reuse(config: Any, field: str, what: str, redundant: Callable[[], str | None]) -> None:
    """A `reuse_old_*` field: True, False or None; True only where the old `what` are the update's own."""
    value = getattr(config, field)
    if value is not None and not isinstance(value, bool):
        raise FieldError(field, f"got {value!r}; it must be True, False or None (auto)")
    why = redundant() if value is True else None
    if why is not None:
        raise FieldError(
            field, f"the old {what} are not the update's own here: {why}; leave it unset (auto) or False"
        )


def check_ppo(config: Any) -> None:
    """Learning rates, loss coefficients, clip ranges, GAE and Adam constants are finite and in range."""
    non_negative = {
        "kl_coef": config.kl_coef,
        "lr": config.lr,
        "critic_lr": config.critic_lr,
        "min_lr": config.min_lr,
        "weight_decay": config.weight_decay,
        "clip_grad": config.clip_grad,
        "kl_loss_coef": config.kl_loss_coef,
        "entropy_coef": config.entropy_coef,
        "opd_coef": config.opd_coef,
    }
    for name, value in non_negative.items():
        if not math.isfinite(value) or value < 0:
            raise FieldError(name, f"got {value}; it must be a finite number >= 0")
    if config.min_lr > min(config.lr, config.critic_lr):
        raise FieldError(
            "min_lr",
            f"{config.min_lr} exceeds a peak learning rate (lr={config.lr}, critic_lr="
            f"{config.critic_lr}); lower it",
        )
    for name in ("eps_clip", "temperature", "adam_eps"):
        value = getattr(config, name)
        if not math.isfinite(value) or value <= 0:
            raise FieldError(name, f"got {value}; it must be a finite number > 0")
    if config.value_clip is not None and not (math.isfinite(config.value_clip) and config.value_clip > 0):
        raise FieldError("value_clip", f"got {config.value_clip}; it must be > 0, or None for no clipping")
    if not config.eps_clip < 1:
        raise FieldError(
            "eps_clip", f"got {config.eps_clip}; the ratio's lower bound 1 - {config.eps_clip} must stay > 0"
        )
    if config.eps_clip_high is not None and not config.eps_clip_high > 0:
        raise FieldError("eps_clip_high", f"got {config.eps_clip_high}; it must be > 0 or None")
    if config.eps_clip_c is not None and not config.eps_clip_c > 1:
        raise FieldError("eps_clip_c", f"got {config.eps_clip_c}; the dual-clip constant must be > 1 or None")
    _check_reuse(config, "reuse_old_log_probs", "log-probs", config.old_log_probs_redundant)
    _check_reuse(config, "reuse_old_values", "values", config.old_values_redundant)
    if not isinstance(config.use_tis, bool):
        raise FieldError("use_tis", f"got {config.use_tis!r}; it must be True or False")
    if isinstance(config.tis_cap, bool) or not isinstance(config.tis_cap, int | float):
        raise FieldError("tis_cap", f"got {config.tis_cap!r}; it must be a number >= 1 (e.g. 2.0)")
    if not (math.isfinite(config.tis_cap) and config.tis_cap >= 1):
        raise FieldError(
            "tis_cap",
            f"got {config.tis_cap}; it must be a finite number >= 1 (a cap below 1 would "
            "down-weight even on-policy tokens, whose weight is 1)",
        )
    if not (math.isfinite(config.tis_cap_low) and 0 <= config.tis_cap_low <= 1):
        raise FieldError(
            "tis_cap_low",
            f"got {config.tis_cap_low}; it must lie in [0, 1] (0: no lower bound; above 1 "
            "it would up-weight even on-policy tokens, whose weight is 1)",
        )
    if not config.use_tis and (config.tis_cap_low != 0 or config.tis_mode != "token"):
        field = "tis_cap_low" if config.tis_cap_low != 0 else "tis_mode"
        raise FieldError(
            field, "set, but truncated importance sampling is off; turn on `use_tis`, or unset it", "use_tis"
        )
    for name in ("gamma", "lambd", "adam_beta1", "adam_beta2"):
        value = getattr(config, name)
        if not 0 <= value <= 1:
            raise FieldError(name, f"got {value}; it must lie in [0, 1]")
    _check_optional_positive(config)


def _check_optional_positive(config: Any) -> None:
    """The optional numbers of the algorithms: unset, or finite and in range."""
    if config.critic_lambd is not None and not 0 <= config.critic_lambd <= 1:
        raise FieldError(
            "critic_lambd",
            f"got {config.critic_lambd}; it must lie in [0, 1], or be unset (`lambd`)",
            "lambd",
        )
    alpha = config.length_adaptive_gae_alpha
    if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
        raise FieldError(
            "length_adaptive_gae_alpha",
            f"got {alpha}; it must be a finite number > 0 (VAPO's 0.05: λ = 1 − "
            "1/(α · length)), or unset for one `lambd` for every response",
            "lambd",
        )
    for name, example in (("reward_clip", "10"), ("kl_target", "0.1")):
        value = getattr(config, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise FieldError(name, f"got {value}; it must be a finite number > 0 (e.g. {example}), or unset")


def check_estimator(config: Any) -> None:
    """The advantage estimator's needs: groups of samples, rewards without KL where it has none, GSPO's mean."""
    estimator = config.advantage_estimator
    kind = estimator_of(estimator)
    if kind.groups and config.n_samples_per_prompt < 2:
        raise FieldError(
            "advantage_estimator",
            f"{estimator} compares each sample with the other samples of its prompt, "
            f"but `n_samples_per_prompt` is {config.n_samples_per_prompt}; set `n_samples_per_prompt` to 2 "
            "or more (e.g. 8)",
            "n_samples_per_prompt",
        )
    if kind.per_sample and config.kl_coef != 0:
        raise FieldError(
            "kl_coef",
            f"{config.kl_coef} folds a per-token KL into the rewards, but `advantage_estimator` "
            f"{estimator} takes one reward per sample; set `kl_coef` to 0 and use `use_kl_loss` with "
            "`kl_loss_coef` (GRPO's KL term), or choose reinforce_plus_plus(_baseline) for KL in the reward",
            "advantage_estimator",
            "kl_coef",
            "use_kl_loss",
            "kl_loss_coef",
        )
    if config.loss_type == "gspo" and config.loss_aggregation != "sample_mean":
        raise FieldError(
            "loss_aggregation",
            f"{config.loss_aggregation} with `loss_type` gspo; GSPO's objective is a mean "
            "over sequences, so set `loss_aggregation` to sample_mean",
            "loss_type",
            "loss_aggregation",
        )
    if config.loss_type == "cispo" and config.eps_clip_c is not None:
        raise FieldError(
            "eps_clip_c",
            f"{config.eps_clip_c} is PPO's dual clip, a bound on the clipped surrogate's loss of "
            "negative advantages; `loss_type` cispo has no such loss to bound (its clipped weight never "
            "drops a gradient), so unset `eps_clip_c`, or use `loss_type` ppo",
            "loss_type",
            "eps_clip_c",
        )
    if config.loss_aggregation == "seq_mean_token_sum_norm" and config.loss_norm_tokens is None:
        raise FieldError(
            "loss_norm_tokens",
            "not set, but `loss_aggregation` seq_mean_token_sum_norm divides each sample's "
            "token sum by it; give the constant (e.g. the longest response allowed)",
            "loss_aggregation",
        )
    if estimator == "reinforce_plus_plus_baseline" and config.gamma != 1:
        raise FieldError(
            "gamma",
            f"{config.gamma} with `advantage_estimator` reinforce_plus_plus_baseline; its group-centred "
            "reward is an outcome reward taken whole by every token (OpenRLHF sets gamma to 1 for it, verl "
            "has no gamma there), so set `gamma` to 1, or use reinforce_plus_plus to discount",
            "advantage_estimator",
            "gamma",
        )
    _check_critic_only_fields(config)
    _check_kl_control(config)
    _check_distillation(config)


def _check_critic_only_fields(config: Any) -> None:
    """The critic's own algorithm fields need a critic (`advantage_estimator` gae)."""
    if config.advantage_estimator == "gae":
        return
    for name, default in (
        ("critic_lambd", None),
        ("length_adaptive_gae_alpha", None),
        ("critic_updates_per_step", 1),
    ):
        if getattr(config, name) != default:
            raise FieldError(
                name,
                f"set, but `advantage_estimator` {config.advantage_estimator} trains no critic and "
                "computes no GAE; unset it, or use `advantage_estimator` gae",
                "advantage_estimator",
            )


def _check_kl_control(config: Any) -> None:
    """The adaptive KL controller starts from a reward-level KL and keeps its factor above 0."""
    if config.kl_target is None:
        return
    if config.kl_coef == 0:
        raise FieldError(
            "kl_target",
            "the adaptive KL controller scales the reward-level KL coefficient, but `kl_coef` is 0 "
            "(no KL in the reward); give `kl_coef` its starting value (e.g. 0.01)",
            "kl_coef",
        )
    if not config.kl_horizon > 0.2 * config.samples_per_rollout:
        raise FieldError(
            "kl_horizon",
            f"{config.kl_horizon} samples; one step's factor 1 ± 0.2 · {config.samples_per_rollout} "
            f"/ {config.kl_horizon} could reach 0 or below, so raise it above {config.samples_per_rollout // 5}"
            " (e.g. 10000)",
        )


def _check_distillation(config: Any) -> None:
    """On-policy distillation's mode fits the estimator, and is set only with a coefficient."""
    if config.opd_coef == 0 and config.opd_mode != "reward":
        raise FieldError(
            "opd_mode",
            f"{config.opd_mode}, but `opd_coef` is 0 (no distillation); give `opd_coef` (e.g. 1.0), "
            "or leave `opd_mode` unset",
            "opd_coef",
            "opd_mode",
        )
    kind = estimator_of(config.advantage_estimator)
    if kind.per_sample and config.opd_in_rewards:
        raise FieldError(
            "opd_mode",
            "reward folds each token's reverse KL to the teacher into the rewards, but "
            f"`advantage_estimator` {config.advantage_estimator} takes one reward per sample; set `opd_mode` "
            "to loss (a term of the policy loss, which every estimator takes), or choose gae or "
            "reinforce_plus_plus(_baseline)",
            "advantage_estimator",
            "opd_mode",
        )
