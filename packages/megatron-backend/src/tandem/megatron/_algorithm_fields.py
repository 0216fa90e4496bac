"""The train worker's PPO fields: the losses, the advantage estimators, KL, importance sampling (unchecked).

The second of `WorkerFields`' groups (`_config_fields.py`): what the update computes, read by
the checks of `_algorithm_checks.py` and by `algorithms/`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.megatron.choices import AdvantageEstimator, KlKind, LossAggregation, LossType, OpdMode, TisMode

__all__ = ["AlgorithmFields"]


@dataclass(frozen=True)
class AlgorithmFields:
    """The PPO update's clip ranges, value loss, estimators, KL terms, importance weights and distillation."""

    # --- PPO ------------------------------------------------------------------
    eps_clip: float = 0.2
    """Lower (and, without `eps_clip_high`, upper) clip range of the policy ratio."""

    eps_clip_high: float | None = None
    """Upper clip range of the policy ratio; None: `eps_clip`."""

    eps_clip_c: float | None = None
    """Dual-clip constant c > 1 for negative advantages; None: off."""

    value_clip: float | None = 0.5
    """Clip range (> 0) of the new values around the old values in the value loss, in reward units
    (0.5 as verl's `cliprange_value` and OpenRLHF's `value_clip`); None: no clipping."""

    gamma: float = 1.0
    """GAE discount."""

    lambd: float = 1.0
    """GAE lambda of the actor's advantages, and of the critic's targets unless `critic_lambd` is set."""

    critic_lambd: float | None = None
    """GAE lambda of the critic's targets (its λ-returns) apart from the actor's `lambd`: VAPO's
    decoupled GAE (Yue et al. 2025, arXiv:2504.05118) trains the value on unbiased λ = 1 returns
    while the actor's advantages use a lower λ (0.95 there), which speeds it up. None: `lambd`
    (one λ for both, as verl and OpenRLHF have). Only with a critic (`advantage_estimator` gae)."""

    length_adaptive_gae_alpha: float | None = None
    """VAPO's length-adaptive GAE (arXiv:2504.05118; α = 0.05 there): each response's
    advantages use `λ = 1 − 1/(α · l)` with `l` its trainable tokens (clamped to [0, 1]: responses
    under 1/α tokens get λ = 0), so that a long response's reward is not discounted away by λ^l
    before it reaches its first tokens. `lambd` then serves only as the critic's default
    (`critic_lambd`). None: off, every response uses `lambd`. Only with `advantage_estimator` gae."""

    critic_updates_per_step: int = 1
    """Full passes of the critic's update over each rollout for one of the actor's (SAO's faster value
    update, K = 2 in arXiv:2607.07508): the critic takes `ppo_epochs * critic_updates_per_step` passes
    of `samples_per_rollout / global_batch_size` optimizer steps each, all against the same old values
    and targets, within its one wake (the step's schedule is unchanged). The actor still gets the old
    values (the baseline the critic trained against). 1: the critic and the actor take the same passes."""

    kl_coef: float = 0.0
    """Weight of reward-level KL (finite, >= 0): each trainable token's reward pays
    `kl_coef * KL_t` (estimator `kl_penalty_type`) against the reference weights, folded into
    the rewards of both the critic's returns and the actor's advantages. Whenever it is not 0
    the driver runs the KL-first plan: the actor computes old and reference log-probs
    (`TrainWorker.compute_log_probs`) before the critic trains, and both roles get them as
    `log_probs` (`ActorLogProbs`). The actor then keeps the reference weights on the host."""

    kl_penalty_type: KlKind = "k1"
    """KL estimator of the reward-level KL (`kl_coef`): k1 (the plain log-ratio, as InstructGPT and
    verl fold it; OpenRLHF's k1 is the same clamped to ±10), k2, k3 (not clamped), low_var_kl (k3
    clamped to ±10: verl's k3), abs; a `+` kind gives its base kind's value here (`kl.py`)."""

    kl_target: float | None = None
    """Adaptive KL controller (Ziegler et al. 2019, arXiv:1909.08593, §2.2; verl's `kl_ctrl.type:
    adaptive`, OpenRLHF's `--algo.kl.target`): the reward-level KL coefficient starts at `kl_coef` and
    after each step is multiplied by `1 + clip(KL / kl_target − 1, ±0.2) · samples_per_rollout /
    kl_horizon`, with KL the step's mean per-token KL of the reward (`reward_kl`); the driver passes
    each step's coefficient to both roles and logs it as `kl_coef`. None: `kl_coef` stays fixed."""

    kl_horizon: int = 10000
    """With `kl_target`: the controller's horizon in samples (verl's and OpenRLHF's default 10000); it
    must exceed a fifth of the samples of a rollout so that one step's factor stays above 0."""

    use_kl_loss: bool = False
    """Add a KL penalty against the reference weights to the policy loss (computes
    reference log-probs each step; reference weights stay on the host)."""

    kl_loss_coef: float = 0.001
    """Weight of the KL penalty in the policy loss (with `use_kl_loss`; 0.001 as verl's `kl_loss_coef`)."""

    kl_loss_type: KlKind = "low_var_kl"
    """KL estimator of the KL loss: k1, k2, k3 (not clamped), low_var_kl (k3 clamped to ±10, verl's
    k3), abs, or k3+ / low_var_kl+ (that value, k2's gradient: an unbiased gradient of the KL)."""

    opd_coef: float = 0.0
    """Weight of on-policy distillation (finite, >= 0; 0: off). A teacher (`ppo-driver`'s
    `--teacher-hf-checkpoint`) scores the student's own samples, and each trainable token's reverse KL
    to it, `log π(y_t) − log π_teacher(y_t)` on the sampled token (both under `temperature`), trains
    the student towards the teacher as `opd_mode` says. With a reward of its own the two signals add;
    with none (`--rm-type none`) the student learns from the teacher alone."""

    opd_mode: OpdMode = "reward"
    """How the reverse KL to the teacher trains the student (with `opd_coef`). `reward`: each trainable
    token's reward pays `opd_coef * KL_t`, folded into the returns and advantages (GAE, REINFORCE++),
    so that a token is credited with the reverse KL of the tokens after it: the policy gradient of the
    whole response's reverse KL (slime's and Thinking Machines' on-policy distillation; verl's with
    `use_policy_gradient`); with a critic the driver runs the KL-first plan (the critic's returns need
    the student's log-probs). `loss`: the policy loss gains `opd_coef * ½ (log π − log π_teacher)²` per
    token, whose gradient on the student's own samples is each token's own reverse KL's (no credit to
    the tokens before it; verl's distillation loss): every estimator takes it (GRPO and RLOO too),
    the critic never sees it, and no actor wakes for it."""

    entropy_coef: float = 0.0
    """Weight of the entropy bonus subtracted from the policy loss; 0: entropy is not computed."""

    normalize_advantages: bool = True
    """Whiten the advantages (mean 0, std 1 over the trainable tokens of the whole data-parallel
    group) before the policy loss: GAE's, and the REINFORCE++ family's (its global batch
    normalisation); never GRPO's or RLOO's, whose normalisation is the group's
    (`grpo_std_normalization`). On by default, as in verl (`masked_whiten` in its GAE) and cleanrl
    (`norm_adv=True`): raw advantages of a pretrained model's rewards are small and uneven from step
    to step, and a run on them barely moves; `--no-normalize-advantages` keeps them raw."""

    advantage_estimator: AdvantageEstimator = "gae"
    """How the actor's advantages are estimated (`estimators`): `gae` on the critic's values;
    critic-free (no critic trains): `grpo` (group-normalised outcome reward), `rloo` (leave-one-out
    baseline), `reinforce_plus_plus` (discounted return of the token rewards, `kl_coef` folded in),
    `reinforce_plus_plus_baseline` (the same on the group-centred reward). The group is a prompt's
    `n_samples_per_prompt` samples."""

    grpo_std_normalization: bool = True
    """`grpo`: divide each sample's group-centred reward by its group's std (+1e-6); False gives
    Dr.GRPO (`r − mean` only), which does not weigh prompts with a small reward spread up."""

    loss_type: LossType = "ppo"
    """The actor's policy loss: `ppo`, the clipped ratio per token; `gspo`, GSPO's clipped
    sequence ratio (the geometric mean of a response's token ratios; `gspo.py`), whose clip
    ranges are usually far smaller (e.g. `eps_clip` 3e-4, `eps_clip_high` 4e-4); `cispo`, MiniMax-M1's
    clipped importance weight on a REINFORCE loss, `−sg[clip(r, 1 − eps_clip, 1 + eps_clip_high)] ·
    A · log π`, which keeps every token's gradient (`cispo.py`; not with `eps_clip_c`)."""

    loss_aggregation: LossAggregation = "sample_mean"
    """How both roles' per-token losses become one scalar (`aggregation.py`): `sample_mean`, token
    mean per sample, then mean over samples; `token_mean`, token mean over the whole global batch;
    `seq_mean_token_sum`, token sum per sample, then mean over samples; `seq_mean_token_sum_norm`,
    that divided by the constant `loss_norm_tokens` (Dr.GRPO's loss, with
    `--no-grpo-std-normalization` its advantage)."""

    loss_norm_tokens: int | None = None
    """`seq_mean_token_sum_norm`'s constant divisor of each sample's token sum (Dr.GRPO's generation
    budget; verl's `loss_scale_factor`). None: `ppo-driver` takes `rollout_max_response_len`."""

    reward_clip: float | None = None
    """Clip each sample's scalar reward to [−reward_clip, reward_clip] before anything else uses it
    (the group baselines, the KL, GAE; both roles alike; an episode's rewards per turn each, at their
    tokens); the `reward/` metrics stay unclipped.
    OpenRLHF's `--reward.clip_range` (default ±10) clips after its group baseline; for `gae` and
    `reinforce_plus_plus` the two are the same. None: off (verl has no such option)."""

    use_tis: bool = False
    """Truncated importance sampling for off-policy rollouts (engine log-probs differ from the
    trainer's, or the rollout is a step stale): the actor's per-token policy loss is multiplied
    by `min(exp(old_log_probs - rollout_log_probs), tis_cap)`, detached. Needs
    `RolloutBatch.rollout_log_probs` from the engine."""

    tis_cap: float = 2.0
    """Upper bound of the truncated importance weight (with `use_tis`); finite, >= 1 so that an
    on-policy token (weight 1) is never down-weighted."""

    tis_cap_low: float = 0.0
    """Lower bound of the truncated importance weight (with `use_tis`; slime's `--tis-clip-low`, OpenRLHF's
    0.5 of `--algo.advantage.is_correction_threshold`), in [0, 1]; 0: none, as verl's token-level IS."""

    tis_mode: TisMode = "token"
    """With `use_tis`: `token`, each token weighed by its truncated ratio; `seq_mask`, the same, and every
    token of a response whose geometric-mean ratio lies outside [`tis_cap_low`, `tis_cap`] left out
    (OpenRLHF's `seq-mask-tis`; `importance.py`)."""

    reuse_old_log_probs: bool | None = None
    """Take the actor's old log-probs from its update's own forward pass (detached) instead of
    a forward pass of their own before it. With one PPO epoch and one optimizer step per
    rollout, the old log-probs are the trainer's log-probs under the very weights the update's
    forward runs with, so the ratio is exactly 1 either way and the loss and gradients are the
    same; one forward pass of the whole rollout less. Not with `kl_coef` (the KL-folded rewards
    need them before the update) or `use_tis` (which weighs by them against the sampler's).
    None: wherever that holds (`old_log_probs_redundant`); True: required (refused elsewhere,
    with the reason); False: always computed. The rollout figure `log_prob` is then not
    reported."""

    reuse_old_values: bool | None = None
    """Take the critic's old values from its update's own forward pass (detached) instead of a
    forward pass of their own before it, and compute its returns from them micro-batch by
    micro-batch. With one PPO epoch and one optimizer step per rollout, that forward runs with
    the very weights the old values are those of, so the value clipping is inactive either way
    and the loss and gradients are the same; one forward pass of the whole rollout less. The
    actor's GAE gets those same values. None: wherever that holds (`old_values_redundant`);
    True: required (refused elsewhere, with the reason); False: always computed."""

    temperature: float = 1.0
    """Sampling temperature: log-probs are computed from logits divided by it (values never are)."""
