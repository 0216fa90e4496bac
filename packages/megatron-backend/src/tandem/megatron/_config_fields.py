"""The train worker's fields, grouped by purpose and free of checks: what `WorkerConfig` validates.

`WorkerFields` is the one declaration of every field (with its docstring, which
`ppo-driver`'s `--help` shows). Two classes build on it: `WorkerConfig`, which
adds the construction-time checks and the role helpers (`config.py`), and the
driver's `PPOConfig`, which adds the run's fields and builds one validated
`WorkerConfig` per role. The class is frozen and never checks anything itself,
so a YAML file and flags can be merged into a `PPOConfig` before `validate()`.

Only derived sizes and decisions that mean the same on every class built on it live
here (the estimator, the reference weights, the KL-first plan: decided once, read by
the driver's plan and by the worker); anything that reads a role's folders or
learning rate is `WorkerConfig`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.megatron.choices import (
    AdvantageEstimator,
    Device,
    Estimator,
    KlKind,
    LossAggregation,
    LossType,
    LrDecayStyle,
    OffloadBackend,
    OpdMode,
    PackedAttention,
    ParamsDtype,
    Role,
    TisMode,
    check_role,
)
from tandem.megatron.choices import (
    estimator as estimator_of,
)

__all__ = ["WorkerFields"]


@dataclass(frozen=True)
class WorkerFields:
    """Hyper-parameters and paths of the actor and critic train workers, unchecked.

    The role-independent derived sizes are here: `samples_per_rollout`, `topology`,
    `data_parallel_size`; the sizes that depend on the data-parallel size are computed
    by the train step (`train_step.minibatch_size`), the one place that uses them.
    """

    # --- weights and checkpoints -------------------------------------------------
    hf_checkpoint: str
    """Hugging Face folder (config.json + safetensors): the model's architecture, the
    actor's and critic's initial weights and, by default, the reference weights."""

    rollout_batch_size: int
    """Prompts per rollout (over all data-parallel ranks)."""

    global_batch_size: int
    """Samples per optimizer step, over all data-parallel ranks."""

    critic_hf_checkpoint: str | None = None
    """Hugging Face folder with the critic's initial backbone weights and architecture; None:
    `hf_checkpoint`. It may be another size (hidden size, layers, heads) than the actor, e.g. a
    smaller critic; its tokenizer (vocabulary) must be the actor's, since it reads the same token ids.
    It may be a reward model (a sequence-classification folder with num_labels=1, as OpenRLHF starts
    its critic): its score head becomes the value head (bias 0 where it has none)."""

    ref_load: str | None = None
    """Hugging Face folder with the reference weights of the KL loss; None: `hf_checkpoint`."""

    load: str | None = None
    """Actor's Megatron checkpoint folder to resume from (its latest complete checkpoint).
    None, or a folder with no checkpoint yet: start from `hf_checkpoint`. A folder that
    does not exist is an error unless it is `save` (the first run of a resumable job)."""

    save: str | None = None
    """Actor's Megatron checkpoint folder that `save_model` writes to; None: saving is off."""

    critic_load: str | None = None
    """The critic's own checkpoint folder to resume from (never the actor's); same rules as `load`."""

    critic_save: str | None = None
    """The critic's own checkpoint folder that `save_model` writes to (never the actor's)."""

    load_rollout_id: int | None = None
    """Resume every model from its checkpoint of this rollout (complete in `load` and `critic_load`)
    instead of the newest complete one; None: the newest. `ppo-driver train` picks the newest
    rollout that every model and the driver's own state completed, and sets aside newer parts."""

    # --- parallelism ------------------------------------------------------------
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size of the actor."""

    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size of the actor."""

    critic_tensor_model_parallel_size: int | None = None
    """Tensor-parallel size of the critic; None: the actor's. It may differ from the actor's:
    the critic runs on the actor's bundles (the same ranks), so TP * PP must divide the number
    of ranks for each role (`check_world`); the critic's data-parallel size is then its own, and
    its values reach the actor's ranks by sample (`TrainGroup.train(..., sample_indices=...)`)."""

    critic_pipeline_model_parallel_size: int | None = None
    """Pipeline-parallel size of the critic; None: the actor's. May differ (see
    `critic_tensor_model_parallel_size`)."""

    # --- batches ----------------------------------------------------------------
    n_samples_per_prompt: int = 1
    """Responses sampled per prompt; a rollout holds `rollout_batch_size * n_samples_per_prompt` samples."""

    micro_batch_size: int = 1
    """Samples per forward/backward pass on one rank; gradients accumulate over
    `global_batch_size / (micro_batch_size * data_parallel_size)` micro-batches."""

    ppo_epochs: int = 1
    """Passes over each rollout (cleanrl's `update_epochs`): every pass takes
    `samples_per_rollout / global_batch_size` optimizer steps against the same old
    log-probs, old values and targets, computed once before the first pass."""

    shuffle_minibatches: bool = False
    """Shuffle each rank's samples before each pass, so that each optimizer step sees
    another mix of them; the order is seeded by `seed`, the rollout id and the pass,
    so a resumed or repeated step shuffles the same way. False: one pass in rollout order."""

    use_sequence_packing: bool = False
    """Pack each micro-batch's samples into one row with no padding between them
    (Megatron's THD layout; positions restart and attention stops at every sample)
    for every forward and backward pass of both roles, instead of padding every
    sample to the micro-batch's longest one. Same outputs and losses, fewer tokens."""

    packed_attention: PackedAttention = "blocks"
    """How a packed row's attention runs (with `use_sequence_packing`): `blocks`, one causal SDPA call
    per sample (flash or memory-efficient on CUDA, the exact math kernel on CPU); `varlen`, one call a
    layer over the whole row, PyTorch's varlen flash attention (`torch.nn.attention.varlen`, torch 2.10
    on), CUDA and bfloat16/float16 only (`models/attention.py`). The same attention either way."""

    use_dynamic_batch_size: bool = False
    """Cut micro-batches by tokens instead of samples (slime's flag): consecutive samples
    go into one micro-batch while it holds at most `max_tokens_per_gpu` tokens (the
    packed row's length with `use_sequence_packing`, else samples x the longest one);
    `micro_batch_size` is then not used. Fewer, fuller passes for short samples, and a
    bounded activation memory for long ones; the same losses and gradients (the step's
    loss is an exact mean over any cut)."""

    max_tokens_per_gpu: int | None = None
    """Tokens of one training micro-batch on one rank with `use_dynamic_batch_size`
    (required there); a sample longer than this gets a micro-batch of its own."""

    log_probs_max_tokens_per_gpu: int | None = None
    """Tokens of one forward-only micro-batch (old and reference log-probs, old values)
    with `use_dynamic_batch_size`: these keep no activations for a backward pass, so a
    larger budget pays; None: `max_tokens_per_gpu`."""

    log_probs_chunk_tokens: int = 0
    """Rows of the response logits processed at once by the log-prob/entropy kernel
    (`worker/log_probs.py`), which keeps no fp32 copy of a whole micro-batch's logits
    (each is ~20 GB for 35k tokens of a 152k vocabulary), e.g. 4096; 0: the whole
    micro-batch at once through plain autograd. 0 by default: on the H200 (docs/benchmarks.md,
    "Chunked log-probs") 4096 saved 5.2 GiB of peak memory and cost 0.48 s a forward of
    the 0.5B bench's work; a memory lever for long responses or large micro-batches.
    Not used where `fused_log_probs` is on."""

    fused_log_probs: bool | None = None
    """Log-probs and entropies of the response logits through two Triton kernels
    (`worker/fused_log_probs.py`): one read of the logits forward, one read and one write
    backward, no fp32 copy of them, instead of plain autograd's ~eight fp32 passes each way.
    The same values to fp32 rounding. None: on where the model is on CUDA and Triton is
    installed (it comes with PyTorch's CUDA builds), else off; True needs both."""

    head_at_responses: bool = True
    """The actor's vocabulary head computes logits only at the positions that predict a response
    token, not over the prompts and the padding (`models/head_rows.py`): the same log-probs,
    entropies and gradients, for `2 · hidden · vocabulary` FLOPs less each way at every other
    position and a logits tensor of the responses alone. False: the whole micro-batch's logits
    (the A/B's reference)."""

    # --- optimizer and learning-rate schedule --------------------------------------
    lr: float = 1e-6
    """Actor's peak learning rate."""

    critic_lr: float = 1e-5
    """Critic's peak learning rate: ten times the actor's by default, as in verl (1e-5) and OpenRLHF
    (9e-6), since its value head starts from scratch (docs/design.md, "Defaults")."""

    min_lr: float = 0.0
    """Learning rate at the end of the decay (both roles, capped at the role's peak)."""

    lr_decay_style: LrDecayStyle = "constant"
    """Shape of the decay after warm-up (Megatron's OptimizerParamScheduler)."""

    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to the peak learning rate."""

    lr_decay_steps: int | None = None
    """Optimizer steps over which the rate decays to `min_lr`; None: no decay ends (constant after warm-up)."""

    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""

    adam_beta1: float = 0.9
    """Adam's first-moment decay."""

    adam_beta2: float = 0.98
    """Adam's second-moment decay."""

    adam_eps: float = 1e-8
    """Adam's epsilon."""

    clip_grad: float = 1.0
    """Global gradient-norm clip (over all ranks of the model); 0 turns clipping off."""

    params_dtype: ParamsDtype = "bfloat16"
    """Dtype of every model weight (norms and the critic head included); bfloat16 keeps
    fp32 main weights in the optimizer (GPU only). The critic head computes and
    outputs fp32 either way."""

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

    # --- LoRA -------------------------------------------------------------------
    lora_rank: int | None = None
    """The actor's LoRA rank: train low-rank adapters (`alpha / rank · B A x`, Hu et al. 2021) on
    `lora_target_modules` of every decoder layer, split over tensor parallelism as their layers are,
    and freeze the rest of the model in `params_dtype` (no fp32 main copy, no gradient, no optimizer
    state). The reference policy of the KL loss or of reward-level KL is then the model with its
    adapters switched off: no reference copy is kept. None: full fine-tuning."""

    lora_alpha: float | None = None
    """The actor's LoRA scaling numerator: each adapter's output is multiplied by `lora_alpha /
    lora_rank`; None: `lora_rank` (scaling 1, as PEFT's default alpha 8 at rank 8)."""

    lora_dropout: float = 0.0
    """Probability, in [0, 1), that an element of an actor adapter's input is zeroed in an update's
    forward pass (PEFT's `lora_dropout`); never in a forward-only pass."""

    lora_target_modules: tuple[str, ...] | None = None
    """The actor's adapted linear layers, by Hugging Face name (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
    `gate_proj`, `up_proj`, `down_proj`) or by Megatron's fused name (`linear_qkv` is q, k and v,
    `linear_proj` o, `linear_fc1` gate and up, `linear_fc2` down); None or `all-linear`: all seven."""

    critic_lora_rank: int | None = None
    """The critic's own LoRA rank (`lora_rank`'s rules; its value head always trains in full);
    None: the critic trains in full, whatever the actor does."""

    critic_lora_alpha: float | None = None
    """The critic's LoRA scaling numerator; None: `critic_lora_rank` (scaling 1)."""

    critic_lora_dropout: float = 0.0
    """The critic's LoRA input dropout, in [0, 1) (`lora_dropout`'s rules)."""

    critic_lora_target_modules: tuple[str, ...] | None = None
    """The critic's adapted linear layers (`lora_target_modules`' names); None: all seven."""

    lora_base_offload: bool = True
    """With LoRA and the pinned_host offload backend, what a sleep does with the frozen base: True,
    its GPU memory is dropped and a wake copies it back from a page-locked host copy made at the first
    sleep and kept (the base never changes, so no device-to-host copy after that first one); False,
    it stays on the GPU and only the adapters, their gradients and their optimizer state move."""

    # --- device, memory, system -------------------------------------------------
    device: Device = "auto"
    """Where the model trains; `auto`: CUDA when the worker sees a GPU, else CPU (gloo)."""

    cpu_threads: int | None = None
    """Threads of torch's CPU kernels (`torch.set_num_threads`) in each train worker and embedded
    engine that runs on the CPU; GPU workers ignore it. None: the PPO driver picks the machine's
    cores where the models take turns on it (the sync loop) and the model's hidden size is at least
    512 (`tandem.ppo.config.CPU_THREADS_MIN_HIDDEN_SIZE`), else one thread (what Ray gives a worker
    of a fractional CPU). On two cores a SmolLM2-135M forward and backward took 4.1 s on two
    threads against 7.7 s on one; the demo's hidden size of 64 ran slower on two. A worker started
    without the driver keeps the process's setting where this is None."""

    fused_rope: bool | None = None
    """Apply RoPE with our `torch.compile`d kernels (`rope.py`) through Megatron's
    `apply_rope_fusion` instead of Megatron's unfused chain of kernels: the same bf16 results bit
    for bit, for ~5 s of compiling once per process. It saves GPU time and costs host time (each
    compiled call about a tenth of a millisecond): a `train()` of the 1.2 B probe took 3.00 s
    instead of 3.33 s on an H200, one of a 0.5B critic 3.02 s instead of 2.40 s. None: on where
    the model is on CUDA and either micro-batches are packed or cut by tokens
    (`use_sequence_packing`, `use_dynamic_batch_size`: Megatron's eager RoPE loops over a packed
    row's samples on the host: 27.7 s against 10.3 s a shared step of the 0.5B bench's
    realistic lengths) or its hidden size is at least 2048 (`models.networks.FUSED_ROPE_MIN_HIDDEN_SIZE`),
    else off (always off on CPU, where compiling needs a C++ compiler and takes ~20 s)."""

    jit_fusions: bool = False
    """Megatron's `torch.compile`d fusions of the SwiGLU activation and of the residual add
    (`bias_activation_fusion`, `bias_dropout_fusion`) on CUDA. Off by default: each call of a
    compiled function costs the host about a tenth of a millisecond (dynamo's guards, its
    runtime wrappers, its autograd node), several a layer and micro-batch, while with no bias
    and no dropout the eager residual add is the same one kernel and the eager SwiGLU two
    small element-wise kernels (`bench/train_profile.py --cprofile` shows the host's share)."""

    offload_backend: OffloadBackend = "pinned_host"
    """How `sleep()` hands GPU memory back: torch_memory_saver or pinned host buffers on
    the GPU; pinned_host or none on the CPU."""

    offload_grads: bool = False
    """pinned_host: copy the gradient buffers to the host at a sleep and back at a wake. False:
    they are freed without a copy and come back as zeros (they are zeroed before every
    minibatch anyway), which moves 2 bytes less per parameter each way (fp32 `main_grad`)."""

    background_optimizer_wake: bool = True
    """pinned_host on CUDA: a wake brings the weights back and returns while the optimizer state
    (fp32 main weights, Adam moments: most of the bytes) is still being copied back on a side
    stream; the optimizer step (and any checkpoint) waits for it on the GPU, so the copy
    overlaps the forward and backward passes before it. False: a wake returns with every byte
    back."""

    optimizer_pieces: int | None = None
    """pinned_host: each of the optimizer's two memory tags (`main_params`, `optimizer_moments`) as this
    many tags of about equal bytes (`optimizer_moments.0` …, whole tensors each), so that a memory plan
    can put to sleep only the part of them a turn needs room for. None: 1 here; tandem-ppo-driver takes
    4 under `--memory-plan fit`."""

    local_single_rank_groups: bool = True
    """Answer the collectives of process groups of one rank in the process (a reduction over
    one rank is the identity, a gather a copy), so that NCCL never builds their
    communicators: nothing held, nothing torn down at a sleep or built at a wake (on one GPU
    every Megatron group has one rank). False: they get communicators like any other group
    (`reloadable_groups(local_single_rank=False)`), torn down at each sleep unless
    `keep_single_rank_groups`."""

    keep_single_rank_groups: bool = False
    """With `local_single_rank_groups=False`: leave the process groups of one rank alive while
    asleep (`destroy_all(keep_single_rank=True)`). Faster sleeps and first collectives after a
    wake, at the price of the one-rank NCCL communicators' device memory while asleep: about
    0.25 GiB a worker at DP 2 on two H200s, 1.9 GiB on one H200 (docs/benchmarks.md). False:
    every group is torn down, for the smallest sleeping worker."""

    make_vocab_size_divisible_by: int = 128
    """Megatron's embedding and output head get the vocabulary rounded up to a multiple of this
    times the tensor-parallel size (as Megatron's flag of that name): every TP rank holds an equal
    slice whatever the tokenizer's size. The padding rows never reach a softmax and are not exported."""

    update_weights_chunk_bytes: int = 512 * 1024**2
    """Bytes of HF-named tensors per chunk sent to the rollout engine by `update_weights`."""

    seed: int = 1234
    """Seed of torch and of Megatron's RNG tracker (each rank derives its own)."""

    # --- derived sizes -------------------------------------------------------------
    @property
    def samples_per_rollout(self) -> int:
        """Samples in one rollout, over all data-parallel ranks."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    def topology(self, role: Role) -> tuple[int, int]:
        """(tensor-parallel size, pipeline-parallel size) of `role`."""
        check_role(role)
        if role == "critic":
            return (
                self.critic_tensor_model_parallel_size or self.tensor_model_parallel_size,
                self.critic_pipeline_model_parallel_size or self.pipeline_model_parallel_size,
            )
        return self.tensor_model_parallel_size, self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int, role: Role) -> int:
        """`role`'s data-parallel size on `world_size` ranks (after `WorkerConfig.check_world`)."""
        tp, pp = self.topology(role)
        return world_size // (tp * pp)

    # --- what the fields decide, once for the driver and the worker ---------------
    @property
    def estimator(self) -> Estimator:
        """The advantage estimator's definition (`choices.ESTIMATORS`): its baseline and advantages' shape."""
        return estimator_of(self.advantage_estimator)

    @property
    def uses_critic(self) -> bool:
        """Whether the advantage estimator needs a critic's values (only `gae` does)."""
        return self.estimator.needs_critic

    @property
    def needs_reference(self) -> bool:
        """Whether the actor computes reference log-probs (for the KL loss or reward-level KL): from
        reference weights kept on the host, or with LoRA from its base with the adapters off."""
        return self.use_kl_loss or self.kl_coef != 0

    @property
    def opd_in_rewards(self) -> bool:
        """Whether the reverse KL to the teacher is folded into the token rewards (`opd_mode` reward)."""
        return self.opd_coef != 0 and self.opd_mode == "reward"

    @property
    def kl_first(self) -> bool:
        """The KL-first plan: with a KL in the rewards (to the reference, `kl_coef`, or to the teacher,
        `opd_mode` reward) and a critic, the actor's old (and reference) log-probs come before the critic
        trains, so that both fold the very same per-token KL into their rewards."""
        return (self.kl_coef != 0 or self.opd_in_rewards) and self.uses_critic
