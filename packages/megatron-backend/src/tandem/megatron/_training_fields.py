"""The train worker's fields of the model, its parallel layout, its batches and its optimizer (unchecked).

The first of `WorkerFields`' groups (`_config_fields.py`), declared as a base class so that
each group reads on its own while `WorkerFields` keeps one order of fields: this class's
first (its three fields without a default lead), then `AlgorithmFields`', then its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.megatron.choices import LrDecayStyle, PackedAttention, ParamsDtype

__all__ = ["TrainingFields"]


@dataclass(frozen=True)
class TrainingFields:
    """Weights and checkpoints, parallelism, batches, the optimizer and its learning-rate schedule."""

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

    log_probs_micro_batch_size: int | None = None
    """Samples per forward-only pass on one rank (old and reference log-probs, old values;
    verl's `log_prob_micro_batch_size_per_gpu`) where micro-batches are cut by count. These
    passes keep no activations for a backward pass, so fewer, fuller ones pay wherever a pass
    costs the host more than the GPU (small models, short samples). None: twice
    `micro_batch_size`, whose logits take what a training micro-batch's logits and their
    gradient take together. With `use_dynamic_batch_size` see `log_probs_max_tokens_per_gpu`."""

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

    packed_attention: PackedAttention = "auto"
    """How a packed row's attention runs (with `use_sequence_packing`): `blocks`, one causal SDPA call
    per sample (flash or memory-efficient on CUDA, the exact math kernel on CPU); `varlen`, one call a
    layer over the whole row, PyTorch's varlen flash attention (`torch.nn.attention.varlen`, torch 2.10
    on), CUDA and bfloat16/float16 only, heads at most 256 wide (`models/attention.py`); `auto`, varlen
    wherever it can run, else blocks. The same attention either way; on one H200 the realistic-length
    0.5B step takes 8.24 s with varlen against 11.90 s with blocks (docs/benchmarks.md)."""

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
    larger budget pays; None: twice `max_tokens_per_gpu` (as `log_probs_micro_batch_size`)."""

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
