"""The closed sets of choices of the backend, one `Literal` each; their tuples come from `get_args`.

Every module that needs a role, a KL estimator or an aggregation mode imports
it from here, so a choice is spelled once and the validation messages list
exactly what the type admits.
"""

from __future__ import annotations

from typing import Literal, get_args

Role = Literal["actor", "critic"]
"""Which network a train worker trains: the policy or the value model."""

KlKind = Literal["k1", "k2", "k3", "low_var_kl", "abs", "k3+", "low_var_kl+"]
"""KL estimators (`kl.approx_kl`); a `+` keeps the value and takes k2's gradient (straight-through)."""

LrDecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root"]
"""Shapes of Megatron's learning-rate decay."""

Device = Literal["auto", "cuda", "cpu"]
"""Where a worker trains."""

OffloadBackend = Literal["torch_memory_saver", "pinned_host", "none"]
"""How `sleep()` hands GPU memory back (tandem-lifecycle's backends)."""

ParamsDtype = Literal["float32", "bfloat16"]
"""Dtype of every model weight."""

LossAggregation = Literal["sample_mean", "token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
"""How per-token losses become one scalar (`aggregation.aggregate_loss`)."""

AdvantageEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
"""How the actor's advantages are estimated (`estimators`); every one but `gae` needs no critic."""

LossType = Literal["ppo", "gspo", "cispo"]
"""The actor's policy loss: PPO's per-token ratio (`losses.policy_loss`), GSPO's sequence ratio (`gspo`)
or CISPO's clipped weight (`cispo`)."""

TisMode = Literal["token", "seq_mask"]
"""Truncated importance sampling per token, or with whole sequences masked out (`importance`)."""

ROLES: tuple[Role, ...] = get_args(Role)
KL_KINDS: tuple[str, ...] = get_args(KlKind)
LR_DECAY_STYLES: tuple[str, ...] = get_args(LrDecayStyle)
DEVICES: tuple[str, ...] = get_args(Device)
OFFLOAD_BACKENDS: tuple[str, ...] = get_args(OffloadBackend)
PARAMS_DTYPES: tuple[str, ...] = get_args(ParamsDtype)
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
TIS_MODES: tuple[str, ...] = get_args(TisMode)
CRITIC_FREE_ESTIMATORS: tuple[str, ...] = tuple(e for e in ADVANTAGE_ESTIMATORS if e != "gae")
"""The estimators whose baseline is not a learned value: a run with one of them trains no critic."""
GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce_plus_plus_baseline")
"""The estimators whose baseline comes from the other samples of the same prompt (`n_samples_per_prompt >= 2`)."""


def check_role(role: str, where: str = "role") -> None:
    """ValueError unless `role` is one of `ROLES`."""
    if role not in ROLES:
        raise ValueError(f"{where}: got {role!r}; choose one of {', '.join(ROLES)}")
