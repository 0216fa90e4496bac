"""The train worker's fields, grouped by purpose and free of checks: what `WorkerConfig` validates.

`WorkerFields` is the one declaration of every field (with its docstring, which
`ppo-driver`'s `--help` shows), in three groups: the model, layout, batches and optimizer
(`TrainingFields`, `_training_fields.py`), the PPO update (`AlgorithmFields`,
`_algorithm_fields.py`), then its own, LoRA and the device, memory and system, in that
order of fields. Two classes build on it: `WorkerConfig`, which
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

from tandem.megatron._algorithm_fields import AlgorithmFields
from tandem.megatron._training_fields import TrainingFields
from tandem.megatron.choices import Device, Estimator, OffloadBackend, Role, check_role
from tandem.megatron.choices import (
    estimator as estimator_of,
)

__all__ = ["WorkerFields"]


@dataclass(frozen=True)
class WorkerFields(AlgorithmFields, TrainingFields):
    """Hyper-parameters and paths of the actor and critic train workers, unchecked.

    The role-independent derived sizes are here: `samples_per_rollout`, `topology`,
    `data_parallel_size`; the sizes that depend on the data-parallel size are computed
    by the train step (`train_step.minibatch_size`), the one place that uses them.
    """

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

    lora_base_share: bool | None = None
    """With LoRA for the actor and the critic, the bases asleep on the host (`lora_base_offload`) and the
    pinned_host backend: the two models' workers on one machine keep one host copy of their frozen base
    between them where their shards hold the same bytes (both from one checkpoint, the same TP and PP;
    compared once, at the first sleep; `tandem.lifecycle.SharedFrozen`), instead of one each: a 7B base
    is 14 GiB of host memory less. None (the default): on wherever those hold, off elsewhere
    (`shares_lora_base`); True: the same, and refused where they do not hold; False: each model keeps a
    copy of its own. Measured on one H200 (docs/benchmarks.md), the step the same either way and the
    host the lighter: 14.0 against 17.4 GiB in use at 1.5B, 69.7 against 95.8 at 14B (another call)."""

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
    """Apply RoPE with our kernels (`rope.py`; on CUDA one Triton kernel a call) through Megatron's
    `apply_rope_fusion` instead of Megatron's unfused chain of kernels, with the same results bit for
    bit. None: on where the model is on CUDA, at every size and micro-batch shape
    (`models.networks.uses_fused_rope`): a 0.5B actor's `train()` took 1.48 s instead of 1.61 s with
    Megatron's eager RoPE on one H100, and packed 2.03 s instead of 2.19 s (the mean of three calls)
    with the compiled functions; off on CPU, where ours are `torch.compile`d (~20 s of compiling)."""

    fused_swiglu: bool | None = None
    """The MLP's SwiGLU as one Triton kernel forward and one backward (`models/swiglu.py`) instead
    of Megatron's eager SiLU, multiply and concatenation; autograd then keeps the MLP's input alone,
    not the SiLU's output beside it (a third of the MLP's activations a layer). The forward equals
    Megatron's bit for bit in bf16, the backward within its last bit. None: on where the model is
    on CUDA with Triton (`models.networks.uses_fused_swiglu`), for calls of at least
    `models.swiglu.MIN_ELEMENTS` (about 16,400 tokens at 0.5B; smaller ones, where the host sets the
    pace, ran slower with the kernels and run eager): on one H100 a 0.5B critic's `train()` at micro
    batch 64 took 0.95 s against 1.16 s eager, the actor's at 32 1.24 s against 1.42, and the actor
    fit at micro batch 64 only with the kernels (1.20 s); eager on CPU. True: the kernels at every size."""

    jit_fusions: bool = False
    """Megatron's `torch.compile`d fusions of the SwiGLU activation and of the residual add
    (`bias_activation_fusion`, `bias_dropout_fusion`) on CUDA. Off by default: each call of a
    compiled function costs the host about a tenth of a millisecond (dynamo's guards, its
    runtime wrappers, its autograd node), several a layer and micro-batch, while with no bias
    and no dropout the eager residual add is the same one kernel and the eager SwiGLU two
    small element-wise kernels (`bench/train_profile.py --cprofile` shows the host's share).
    With `fused_swiglu` the SwiGLU is ours whatever this says."""

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
    def shares_lora_base(self) -> bool:
        """Whether the actor's and the critic's workers keep one host copy of their frozen LoRA base
        (`lora_base_share`; None: wherever both models have LoRA, their bases sleep on the host and the
        backend is pinned_host)."""
        if self.lora_base_share is False:
            return False
        return (
            self.lora_rank is not None
            and self.critic_lora_rank is not None
            and self.lora_base_offload
            and self.offload_backend == "pinned_host"
        )

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
