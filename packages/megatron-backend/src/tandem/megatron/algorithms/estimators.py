"""The actor's advantage estimators: GAE on the critic's values, or a baseline that needs no critic.

Conventions (docs/design.md, "PPO math conventions"): the samples of one prompt are
consecutive in the rollout, so sample `i` of the rollout belongs to group
`i // group_size` (`group_size` = `n_samples_per_prompt`); per-token tensors are
padded `(batch, response_len)` and 0 at masked positions; only trainable tokens
(`loss_mask != 0`) are steps.

- `gae`: GAE on the critic's values (Schulman et al. 2016; `gae.compute_gae`).
- `grpo`: GRPO's group-relative outcome advantage (Shao et al. 2024,
  "DeepSeekMath", §4.1.2), `A_i = (r_i − mean_g r) / (std_g r + ε)` with the
  unbiased std of the group (as verl, slime and OpenRLHF compute it) and
  `ε = GRPO_EPS`; every trainable token of sample `i` gets `A_i`. Without the
  std normalisation, `A_i = r_i − mean_g r`: Dr.GRPO (Liu et al. 2025,
  "Understanding R1-Zero-Like Training: A Critical Perspective", §3.1), which
  shows that dividing by the std weighs too-easy and too-hard prompts up.
- `rloo`: REINFORCE leave-one-out (Kool et al. 2019, "Buy 4 REINFORCE Samples,
  Get a Baseline for Free!"; Ahmadian et al. 2024, "Back to Basics", eq. 7):
  `A_i = r_i − 1/(G−1) Σ_{j≠i} r_j`, which is `G/(G−1) · (r_i − mean_g r)`.
- `reinforce_plus_plus`: REINFORCE++ (Hu et al. 2025, arXiv:2501.03262, eq. 8-10):
  token rewards `r_t = −β KL_t` plus the scalar reward at the last trainable
  token (`kl.kl_penalized_rewards`, β = `kl_coef`), the discounted return
  `A_t = Σ_{s≥t} γ^{s−t} r_s`, then whitened over the whole batch
  (`advantages.whiten_advantages`, with `normalize_advantages`).
- `reinforce_plus_plus_baseline`: the same with the scalar reward replaced by
  `r_i − mean_g r` (the paper's REINFORCE++-baseline, as its authors' OpenRLHF
  computes it at 3c3be62, `experience_maker.py` `compute_advantages_and_returns`:
  the KL term still runs to the end of the response), with γ = 1: OpenRLHF sets γ
  to 1 for it and verl's `compute_reinforce_plus_plus_baseline_outcome_advantage`
  (b178a3c) has no γ, so `WorkerConfig` refuses another. verl gives every token the
  centred sum of the response's token rewards (its KL included) instead of a
  return-to-go: the same as ours without reward-level KL.

Ties: a group whose rewards are all equal gives exactly 0 to each of its
samples, never NaN (`tied_groups`; in floating point the mean of equal numbers
is not always that number, so ties are found by comparing, not by subtracting).
Everything here runs under `no_grad` on detached inputs, in float64 for the
group statistics.
"""

from __future__ import annotations

import torch

from tandem.megatron.algorithms.gae import Lambda, compute_gae, lambda_returns
from tandem.megatron.choices import ADVANTAGE_ESTIMATORS, AdvantageEstimator, Estimator
from tandem.megatron.choices import estimator as estimator_of

__all__ = [
    "GRPO_EPS",
    "discounted_returns",
    "group_centered_rewards",
    "grpo_advantages",
    "outcome_advantages",
    "rloo_advantages",
    "sample_signal",
    "tied_groups",
    "token_advantages",
    "whitens",
]

GRPO_EPS = 1e-6
"""Added to a group's std before dividing (verl's and slime's ε): a group whose
rewards barely differ is scaled up by at most 1/ε."""


def _groups(fn: str, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """`rewards` `(N,)` as float64 `(N / group_size, group_size)`; ValueError unless it divides."""
    if rewards.dim() != 1:
        raise ValueError(f"{fn}: `rewards` must have shape (num_samples,), got {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{fn}: `group_size` must be a positive integer, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"{fn}: {rewards.numel()} rewards do not split into groups of {group_size} "
            "(n_samples_per_prompt); a rollout holds whole groups of consecutive samples"
        )
    return rewards.detach().double().view(-1, group_size)


@torch.no_grad()
def tied_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Whether every reward of each group is the same (no learning signal). Shape `(N / group_size,)`, bool."""
    grouped = _groups("tied_groups", rewards, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def _untie(advantages: torch.Tensor, grouped: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`advantages` `(groups, G)` flattened, 0 for every sample of a tied group, in `like`'s dtype (≥ float32)."""
    tied = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    out = torch.where(tied, 0.0, advantages).reshape(-1)
    return out.to(torch.promote_types(like.dtype, torch.float32))


@torch.no_grad()
def group_centered_rewards(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """`r_i − mean_g r`: each reward less its group's mean (Dr.GRPO's advantage, REINFORCE++-baseline's reward).

    Shapes: `rewards` `(N,)`, groups of `group_size` consecutive samples; returns `(N,)`
    in at least float32. A tied group gives 0.
    """
    grouped = _groups("group_centered_rewards", rewards, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    return _untie(centered, grouped, rewards)


@torch.no_grad()
def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, std_normalization: bool = True, eps: float = GRPO_EPS
) -> torch.Tensor:
    """GRPO's per-sample advantage `(r_i − mean_g r) / (std_g r + eps)`; Dr.GRPO's `r_i − mean_g r` without the std.

    Args:
        rewards: one scalar reward per sample of the rollout, groups of `group_size`
            consecutive samples. Shape `(N,)`.
        group_size: samples per prompt (`n_samples_per_prompt`).
        std_normalization: divide by the group's unbiased std (+ `eps`); False: Dr.GRPO.
        eps: > 0.

    Returns:
        Shape `(N,)`, in at least float32; 0 for every sample of a tied group.
    """
    if not eps > 0:
        raise ValueError(f"grpo_advantages: `eps` must be > 0 (e.g. {GRPO_EPS}), got {eps}")
    grouped = _groups("grpo_advantages", rewards, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if std_normalization and group_size > 1:
        centered = centered / (grouped.std(dim=1, keepdim=True, unbiased=True) + eps)
    return _untie(centered, grouped, rewards)


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO's per-sample advantage `r_i − 1/(G−1) Σ_{j≠i} r_j`, for groups of `G = group_size ≥ 2`.

    Shapes: `rewards` `(N,)`; returns `(N,)` in at least float32; 0 for a tied group.
    """
    if isinstance(group_size, int) and not isinstance(group_size, bool) and group_size < 2:
        raise ValueError(
            f"rloo_advantages: `group_size` must be >= 2 (a sample's baseline is the other samples of its "
            f"prompt), got {group_size}"
        )
    grouped = _groups("rloo_advantages", rewards, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return _untie(grouped - others, grouped, rewards)


@torch.no_grad()
def sample_signal(
    estimator: AdvantageEstimator, rewards: torch.Tensor, group_size: int, *, std_normalization: bool = True
) -> torch.Tensor:
    """The per-sample scalar the estimator works on: the rollout's rewards with their baseline taken out.

    By the estimator's baseline (`choices.Estimator`): `group_std`, `grpo_advantages`;
    `leave_one_out`, `rloo_advantages`; `group_mean`, `group_centered_rewards`; `critic`
    and `none`, the rewards themselves. Shapes: `rewards` `(N,)` (the whole rollout, in
    order); returns `(N,)`.
    """
    baseline = _estimator("sample_signal", estimator).baseline
    if baseline == "group_std":
        return grpo_advantages(rewards, group_size, std_normalization=std_normalization)
    if baseline == "leave_one_out":
        return rloo_advantages(rewards, group_size)
    if baseline == "group_mean":
        return group_centered_rewards(rewards, group_size)
    return rewards.detach().clone()


@torch.no_grad()
def outcome_advantages(per_sample: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """One advantage per sample on each of its trainable tokens: `A_{i,t} = A_i` where `loss_mask`, else 0.

    Shapes: `per_sample` `(batch,)`, `loss_mask` `(batch, response_len)`; returns
    `(batch, response_len)` in at least float32.
    """
    if per_sample.dim() != 1 or loss_mask.dim() != 2 or loss_mask.shape[0] != per_sample.shape[0]:
        raise ValueError(
            f"outcome_advantages: `per_sample` {tuple(per_sample.shape)} must be (batch,) and `loss_mask` "
            f"{tuple(loss_mask.shape)} (batch, response_len)"
        )
    mask = loss_mask.detach() != 0
    dtype = torch.promote_types(per_sample.dtype, torch.float32)
    values = per_sample.detach().to(device=mask.device, dtype=dtype)[:, None].expand(mask.shape)
    return torch.where(mask, values, torch.zeros((), dtype=dtype, device=mask.device))


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++'s return-to-go `G_t = Σ_{s≥t} γ^{s−t} r_s` over the trainable tokens.

    `gae.lambda_returns` with no critic (`V = 0`) and `λ = 1`: masked tokens are
    skipped (a hole is not a step), and the return after the last trainable
    token is 0.

    Args:
        rewards: scalar rewards `(batch,)` (placed at the last trainable token), or
            token rewards `(batch, response_len)` (e.g. `kl.kl_penalized_rewards`).
        loss_mask: 1 for trainable tokens. Shape `(batch, response_len)`.
        gamma: the discount in [0, 1].

    Returns:
        Shape `(batch, response_len)` in `rewards`' dtype (at least float32), 0 at masked positions.
    """
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    zeros = torch.zeros(loss_mask.shape, dtype=dtype, device=loss_mask.device)
    return lambda_returns(rewards, zeros, loss_mask, gamma, 1.0)


def whitens(estimator: AdvantageEstimator, normalize_advantages: bool) -> bool:
    """Whether the estimator's advantages are whitened over the batch (`whiten_advantages`).

    GAE and the REINFORCE++ family, with `normalize_advantages`: REINFORCE++'s
    global normalisation is that whitening. Never an estimator of one advantage per
    sample (GRPO, RLOO): its normalisation is the group's (`grpo_std_normalization`),
    as in verl and OpenRLHF.
    """
    return normalize_advantages and not _estimator("whitens", estimator).per_sample


@torch.no_grad()
def token_advantages(
    estimator: AdvantageEstimator,
    rewards: torch.Tensor,
    values: torch.Tensor | None,
    loss_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lambd: Lambda = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages (before any whitening) and returns, for the actor's loss.

    Args:
        estimator: one of `ADVANTAGE_ESTIMATORS`.
        rewards: `gae` and the REINFORCE++ family: scalar rewards `(batch,)` or token
            rewards `(batch, response_len)` (KL folded in); for
            `reinforce_plus_plus_baseline` the scalar part is already
            `group_centered_rewards`. `grpo`, `rloo`: the per-sample advantages
            `sample_signal` gave, `(batch,)`.
        values: `gae` only: the critic's old values, `(batch, response_len)`; ignored otherwise.
        loss_mask: 1 for trainable tokens, `(batch, response_len)`.
        gamma, lambd: GAE's γ and λ (one per response, `(batch,)`, for length-adaptive GAE);
            the REINFORCE++ family discounts with `gamma`.

    Returns:
        `(advantages, returns)`, each `(batch, response_len)`, 0 at masked positions;
        `returns` is GAE's (`A + V`) or the discounted return, None for one advantage per sample.
    """
    kind = _estimator("token_advantages", estimator)
    if kind.needs_critic:
        if values is None:
            raise ValueError(f"token_advantages: `{estimator}` needs the critic's `values`")
        return compute_gae(rewards, values, loss_mask, gamma, lambd)
    if kind.per_sample:
        if rewards.dim() != 1:
            raise ValueError(
                f"token_advantages: {estimator} takes one advantage per sample, shape (batch,), got "
                f"{tuple(rewards.shape)}; reward-level KL (kl_coef) is not part of {estimator}"
            )
        return outcome_advantages(rewards, loss_mask), None
    returns = discounted_returns(rewards, loss_mask, gamma)
    return returns, returns


def _estimator(fn: str, name: str) -> Estimator:
    try:
        return estimator_of(name)
    except ValueError:
        raise ValueError(
            f"{fn}: unknown estimator {name!r}; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}"
        ) from None
