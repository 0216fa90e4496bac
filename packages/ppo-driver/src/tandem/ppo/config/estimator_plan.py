"""What the advantage estimator asks of a run: whether a critic trains, and the flag combinations refused.

GAE needs the critic's values; GRPO, RLOO and REINFORCE++(-baseline) need none,
so a run with one of them starts no critic group, never puts one to sleep or
wakes it, and skips the critic phase of each step. `--use-critic` left unset
follows the estimator (`imply_critic`); set against it, the run is refused,
naming both flags. The long-response flags (DAPO's overlong shaping,
`--filter-truncated`) are checked here too, being rules of the same rollout.

Messages start with a flag, as every `PPOConfig.validate` refusal does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

from tandem.megatron.choices import CRITIC_FREE_ESTIMATORS

__all__ = ["check_estimator_plan", "critic_flag_given", "imply_critic"]

CRITIC_FLAGS = ("--use-critic", "--no-use-critic")


class EstimatorFields(Protocol):
    """The fields of the run's config (`PPOConfig`) that the estimator's rules read."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def advantage_estimator(self) -> str: ...

    @property
    def use_critic(self) -> bool: ...

    @property
    def num_critic_only_steps(self) -> int: ...

    @property
    def overlong_buffer_len(self) -> int | None: ...

    @property
    def overlong_penalty_factor(self) -> float: ...

    @property
    def rollout_max_response_len(self) -> int: ...

    @property
    def rollout_ignore_eos(self) -> bool: ...

    @property
    def filter_truncated(self) -> bool: ...


def critic_flag_given(values: Mapping[str, Any], argv: Sequence[str] = ()) -> bool:
    """Whether the user set `use_critic`: a key of `values` (YAML, the demo's base) or a flag in `argv`."""
    flags = {arg.split("=", 1)[0].replace("_", "-") for arg in argv}
    return "use_critic" in values or any(f in flags for f in CRITIC_FLAGS)


def imply_critic[C: EstimatorFields](config: C, *, given: bool) -> C:
    """`config` with `use_critic` following `--advantage-estimator` (`gae`: a critic), unless `given`."""
    if given:
        return config
    return dataclasses.replace(config, use_critic=config.advantage_estimator not in CRITIC_FREE_ESTIMATORS)


def check_estimator_plan(config: EstimatorFields) -> None:
    """ValueError, naming both flags, for a critic the estimator cannot use or lacks, and bad long-response flags."""
    estimator = config.advantage_estimator
    critic_free = estimator in CRITIC_FREE_ESTIMATORS
    if critic_free and config.use_critic:
        raise ValueError(
            f"--use-critic: --advantage-estimator {estimator} needs no critic, so none can train; drop "
            "--use-critic (a critic-free estimator implies --no-use-critic), or use --advantage-estimator gae"
        )
    if not critic_free and not config.use_critic:
        raise ValueError(
            "--advantage-estimator: gae needs the critic's values, but --no-use-critic starts no critic; "
            f"choose a critic-free estimator ({', '.join(CRITIC_FREE_ESTIMATORS)}) or drop --no-use-critic"
        )
    if config.num_critic_only_steps and not config.use_critic:
        raise ValueError(
            f"--num-critic-only-steps: {config.num_critic_only_steps} critic warm-up steps, but the run has no "
            f"critic (--advantage-estimator {estimator}); set --num-critic-only-steps 0"
        )
    buffer = config.overlong_buffer_len
    if buffer is not None:
        if (
            isinstance(buffer, bool)
            or not isinstance(buffer, int)
            or not 1 <= buffer <= config.rollout_max_response_len
        ):
            raise ValueError(
                f"--overlong-buffer-len: got {buffer!r}; it must be an integer in [1, --rollout-max-response-len "
                f"= {config.rollout_max_response_len}] (the tokens before the cap over which the penalty grows), "
                "or unset"
            )
        if config.rollout_ignore_eos:
            raise ValueError(
                "--overlong-buffer-len: with --rollout-ignore-eos every response runs to "
                "--rollout-max-response-len, so every one pays the same penalty; drop one of the two"
            )
    factor = config.overlong_penalty_factor
    if (
        isinstance(factor, bool)
        or not isinstance(factor, int | float)
        or not (math.isfinite(factor) and factor >= 0)
    ):
        raise ValueError(f"--overlong-penalty-factor: got {factor!r}; it must be a finite number >= 0")
    if config.filter_truncated and config.rollout_ignore_eos:
        raise ValueError(
            "--filter-truncated: with --rollout-ignore-eos every response is cut at --rollout-max-response-len, "
            "so nothing would be left to train on; drop one of the two"
        )
