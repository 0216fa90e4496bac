"""The closed sets of choices of the backend, one `Literal` each; their tuples come from `get_args`.

Every module that needs a role, a KL estimator or an aggregation mode imports
it from here, so a choice is spelled once and the validation messages list
exactly what the type admits. An advantage estimator is one `Estimator` here
(`ESTIMATORS`): what it needs and what it gives, which the config's checks, the
driver's plan and the worker all read; `algorithms.estimators` computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
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

OpdMode = Literal["reward", "loss"]
"""How on-policy distillation's per-token reverse KL to the teacher trains the student (`distillation`):
folded into the token rewards, or a term of the policy loss."""

PackedAttention = Literal["auto", "blocks", "varlen"]
"""How the SDPA core attention runs a packed row: a call per sample, one varlen flash call a layer, or
varlen wherever it can run (`models.attention.resolve_packed_attention`)."""

ROLES: tuple[Role, ...] = get_args(Role)
KL_KINDS: tuple[str, ...] = get_args(KlKind)
LR_DECAY_STYLES: tuple[str, ...] = get_args(LrDecayStyle)
DEVICES: tuple[str, ...] = get_args(Device)
OFFLOAD_BACKENDS: tuple[str, ...] = get_args(OffloadBackend)
PARAMS_DTYPES: tuple[str, ...] = get_args(ParamsDtype)
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
LOSS_TYPES: tuple[str, ...] = get_args(LossType)

Baseline = Literal["critic", "group_std", "leave_one_out", "group_mean", "none"]
"""What an estimator subtracts from the reward (`Estimator.baseline`)."""


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: its baseline and the shape of its advantages.

    Attributes:
        name: the `--advantage-estimator` value.
        baseline: `critic`, the critic's values (GAE); `group_std`, the mean of the
            prompt's samples, divided by their std (GRPO; Dr.GRPO without the division);
            `leave_one_out`, the mean of the prompt's other samples (RLOO); `group_mean`,
            the mean of the prompt's samples (REINFORCE++-baseline); `none`.
        per_sample: one advantage for every token of a sample, from its scalar reward:
            no token rewards (so no reward-level KL), no returns, and never whitened (the
            group's normalisation is its own); otherwise a return over the tokens.
    """

    name: AdvantageEstimator
    baseline: Baseline
    per_sample: bool

    @property
    def needs_critic(self) -> bool:
        """Whether a critic trains for it (its baseline is the critic's values)."""
        return self.baseline == "critic"

    @property
    def groups(self) -> bool:
        """Whether a sample's baseline comes from the other samples of its prompt (`n_samples_per_prompt >= 2`)."""
        return self.baseline in ("group_std", "leave_one_out", "group_mean")


ESTIMATORS: dict[str, Estimator] = {
    e.name: e
    for e in (
        Estimator("gae", baseline="critic", per_sample=False),
        Estimator("grpo", baseline="group_std", per_sample=True),
        Estimator("rloo", baseline="leave_one_out", per_sample=True),
        Estimator("reinforce_plus_plus", baseline="none", per_sample=False),
        Estimator("reinforce_plus_plus_baseline", baseline="group_mean", per_sample=False),
    )
}
"""Every advantage estimator, by name (the order of `AdvantageEstimator`)."""

TIS_MODES: tuple[str, ...] = get_args(TisMode)
OPD_MODES: tuple[str, ...] = get_args(OpdMode)
PACKED_ATTENTIONS: tuple[str, ...] = get_args(PackedAttention)
CRITIC_FREE_ESTIMATORS: tuple[str, ...] = tuple(n for n, e in ESTIMATORS.items() if not e.needs_critic)
"""The estimators whose baseline is not a learned value: a run with one of them trains no critic."""
GROUP_ESTIMATORS: tuple[str, ...] = tuple(n for n, e in ESTIMATORS.items() if e.groups)
"""The estimators whose baseline comes from the other samples of the same prompt (`n_samples_per_prompt >= 2`)."""


def estimator(name: str) -> Estimator:
    """The estimator called `name`; ValueError naming `advantage_estimator` and the choices otherwise."""
    found = ESTIMATORS.get(name)
    if found is None:
        raise ValueError(
            f"advantage_estimator: got {name!r}; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    return found


def check_role(role: str, where: str = "role") -> None:
    """ValueError unless `role` is one of `ROLES`."""
    if role not in ROLES:
        raise ValueError(f"{where}: got {role!r}; choose one of {', '.join(ROLES)}")


PIECE_SEPARATOR = "."
"""Between a memory tag's kind and its piece's index: `optimizer_moments.2` is the third piece of the
optimizer's moments (`memory_tag_pieces`), which a memory plan may put to sleep apart from the others."""


def memory_tag_pieces(kind: str, pieces: int) -> tuple[str, ...]:
    """The memory tags of `kind` split in `pieces`: `(kind,)` for one piece, else `kind.0` … `kind.{pieces-1}`."""
    if pieces < 1:
        raise ValueError(f"memory tag {kind!r}: {pieces} pieces; give at least 1")
    return (kind,) if pieces == 1 else tuple(f"{kind}{PIECE_SEPARATOR}{i}" for i in range(pieces))


def memory_tag_kind(tag: str) -> str:
    """What a memory tag holds, without its piece's index: `optimizer_moments.2` -> `optimizer_moments`."""
    return tag.split(PIECE_SEPARATOR, 1)[0]


TRAIN_PARTS: tuple[str, str] = ("passes", "optimizer_step")
"""The two parts of a train worker's measured `train` phase (`phase_peaks()`' keys `train/passes` and
`train/optimizer_step`): its forward and backward passes, and its optimizer steps, whose allocator peaks a
memory plan reads apart (the optimizer's state may sleep through the passes)."""
