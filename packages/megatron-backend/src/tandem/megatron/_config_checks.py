"""The checks that `WorkerConfig` runs at construction; each raises a `FieldError`: the field, and the fix.
The PPO algorithm's (losses, estimators, KL, distillation) are `_algorithm_checks`'.

Each function takes the `WorkerConfig` being built (typed `Any`: config.py imports
this module, not the other way round). The checks that need the number of ranks or
the role are `WorkerConfig.check_world` and `WorkerConfig.check_role`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from tandem.megatron._field_error import FieldError
from tandem.megatron.choices import (
    ADVANTAGE_ESTIMATORS,
    DEVICES,
    KL_KINDS,
    LOSS_AGGREGATIONS,
    LOSS_TYPES,
    LR_DECAY_STYLES,
    OFFLOAD_BACKENDS,
    OPD_MODES,
    PACKED_ATTENTIONS,
    PARAMS_DTYPES,
    TIS_MODES,
)

MAX_OPTIMIZER_PIECES = 64
"""The most pieces `optimizer_pieces` may split each optimizer tag in (each piece is a tag to move)."""


def check_positive_ints(config: Any) -> None:
    """Sizes and counts are positive integers; the warm-up and decay steps fit together."""
    for name in (
        "rollout_batch_size",
        "global_batch_size",
        "ppo_epochs",
        "n_samples_per_prompt",
        "micro_batch_size",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "update_weights_chunk_bytes",
        "make_vocab_size_divisible_by",
        "critic_updates_per_step",
        "kl_horizon",
    ):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FieldError(name, f"got {value!r}; it must be a positive integer")
    for name in (
        "critic_tensor_model_parallel_size",
        "critic_pipeline_model_parallel_size",
        "max_tokens_per_gpu",
        "log_probs_max_tokens_per_gpu",
        "log_probs_micro_batch_size",
        "cpu_threads",
        "loss_norm_tokens",
    ):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise FieldError(name, f"got {value!r}; it must be a positive integer or None")
    value = config.log_probs_chunk_tokens
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FieldError(
            "log_probs_chunk_tokens",
            f"got {value!r}; it must be an integer >= 0 "
            "(rows of logits at a time, e.g. 4096; 0: the whole micro-batch through plain autograd)",
        )
    value = config.load_rollout_id
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise FieldError(
            "load_rollout_id", f"got {value!r}; it must be a rollout id (an integer >= 0) or None"
        )
    if config.lr_warmup_steps < 0:
        raise FieldError("lr_warmup_steps", f"got {config.lr_warmup_steps}; it must be >= 0")
    if config.lr_decay_steps is not None and config.lr_decay_steps <= config.lr_warmup_steps:
        raise FieldError(
            "lr_decay_steps",
            f"got {config.lr_decay_steps}, which must exceed lr_warmup_steps "
            f"({config.lr_warmup_steps}); raise it or set it to None for no decay",
        )


def check_choices(config: Any) -> None:
    """Every closed-set field holds one of its choices, flags are booleans; the CPU admits the backend and dtype."""
    choices: dict[str, tuple[str, ...]] = {
        "lr_decay_style": LR_DECAY_STYLES,
        "params_dtype": PARAMS_DTYPES,
        "kl_loss_type": KL_KINDS,
        "kl_penalty_type": KL_KINDS,
        "loss_aggregation": LOSS_AGGREGATIONS,
        "device": DEVICES,
        "offload_backend": OFFLOAD_BACKENDS,
        "advantage_estimator": ADVANTAGE_ESTIMATORS,
        "loss_type": LOSS_TYPES,
        "tis_mode": TIS_MODES,
        "opd_mode": OPD_MODES,
        "packed_attention": PACKED_ATTENTIONS,
    }
    for name, allowed in choices.items():
        value = getattr(config, name)
        if value not in allowed:
            raise FieldError(name, f"got {value!r}; choose one of {', '.join(allowed)}")
    for name in (
        "shuffle_minibatches",
        "use_sequence_packing",
        "use_dynamic_batch_size",
        "offload_grads",
        "background_optimizer_wake",
        "grpo_std_normalization",
        "jit_fusions",
        "lora_base_offload",
    ):
        if not isinstance(getattr(config, name), bool):
            raise FieldError(name, f"got {getattr(config, name)!r}; it must be True or False")
    for name in ("fused_rope", "fused_swiglu", "fused_log_probs", "lora_base_share"):
        value = getattr(config, name)
        if value is not None and not isinstance(value, bool):
            raise FieldError(name, f"got {value!r}; it must be True, False or None (auto)")
    if config.device == "cpu" and config.fused_log_probs is True:
        raise FieldError(
            "fused_log_probs",
            "True needs CUDA (Triton kernels) but device is 'cpu'; leave it unset (auto) or False",
        )
    pieces = config.optimizer_pieces
    if pieces is not None:
        if isinstance(pieces, bool) or not isinstance(pieces, int) or not 1 <= pieces <= MAX_OPTIMIZER_PIECES:
            raise FieldError(
                "optimizer_pieces", f"got {pieces!r}; give a whole number from 1 to {MAX_OPTIMIZER_PIECES}"
            )
        if pieces > 1 and config.offload_backend != "pinned_host":
            raise FieldError(
                "optimizer_pieces",
                f"{pieces} splits the pinned_host backend's optimizer tags, but offload_backend is "
                f"{config.offload_backend!r} (torch_memory_saver keeps the optimizer in one region); use "
                "offload_backend pinned_host, or leave it unset",
            )
    if config.packed_attention == "varlen":
        if not config.use_sequence_packing:
            raise FieldError(
                "packed_attention",
                "'varlen' runs packed rows, but `use_sequence_packing` is off; turn it on, or leave "
                "packed_attention at 'blocks'",
                "use_sequence_packing",
            )
        if config.device == "cpu" or config.params_dtype == "float32":
            raise FieldError(
                "packed_attention",
                f"'varlen' is flash attention, CUDA with bfloat16 or float16 only (`device` {config.device!r}, "
                f"`params_dtype` {config.params_dtype!r}); use 'blocks' there",
                "device",
                "params_dtype",
            )
    if config.device == "cpu" and config.offload_backend == "torch_memory_saver":
        raise FieldError(
            "offload_backend",
            "torch_memory_saver needs CUDA but device is 'cpu'; use pinned_host or none on the CPU",
        )
    if config.device == "cpu" and config.params_dtype != "float32":
        raise FieldError(
            "params_dtype",
            "the CPU path trains in float32 (Megatron's mixed-precision optimizer "
            "is GPU-only); set it to float32 with `device` cpu",
            "device",
        )


def check_lora(config: Any) -> None:
    """Each role's LoRA fields: a positive rank, a positive alpha, a dropout in [0, 1), layers the model has;
    none of them without a rank; the flags LoRA cannot work with."""
    from tandem.megatron.models.lora_spec import resolve_targets

    for prefix in ("", "critic_"):
        rank, alpha = getattr(config, f"{prefix}lora_rank"), getattr(config, f"{prefix}lora_alpha")
        dropout, targets = (
            getattr(config, f"{prefix}lora_dropout"),
            getattr(config, f"{prefix}lora_target_modules"),
        )
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise FieldError(
                f"{prefix}lora_rank",
                f"got {rank!r}; it must be a positive integer (the adapters' rank, e.g. 8), or unset for full "
                "fine-tuning",
            )
        if alpha is not None and (
            isinstance(alpha, bool)
            or not isinstance(alpha, int | float)
            or not math.isfinite(alpha)
            or alpha <= 0
        ):
            raise FieldError(
                f"{prefix}lora_alpha",
                f"got {alpha!r}; it must be a finite number > 0 (adapters are scaled by alpha / rank), or unset "
                "for alpha = rank",
            )
        if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
            raise FieldError(f"{prefix}lora_dropout", f"got {dropout!r}; it must lie in [0, 1)")
        if targets is not None:
            try:
                resolve_targets(targets)
            except ValueError as exc:
                raise FieldError(f"{prefix}lora_target_modules", str(exc)) from None
        if rank is None:
            given = [
                name
                for name, value in (
                    ("lora_alpha", alpha),
                    ("lora_dropout", dropout or None),
                    ("lora_target_modules", targets),
                )
                if value is not None
            ]
            if given:
                field, rank_field = f"{prefix}{given[0]}", f"{prefix}lora_rank"
                raise FieldError(
                    field,
                    f"set, but `{rank_field}` is unset (full fine-tuning); set `{rank_field}` to train adapters, "
                    f"or leave `{field}` unset",
                    rank_field,
                    field,
                )
    if (
        config.lora_rank is not None
        and config.ref_load is not None
        and not same_path(config.ref_load, config.hf_checkpoint)
    ):
        raise FieldError(
            "ref_load",
            f"{config.ref_load!r} with `lora_rank`; a LoRA actor's reference is its own base model "
            "(`hf_checkpoint`) with the adapters switched off, so no other reference is loaded; leave "
            "`ref_load` unset",
            "lora_rank",
            "hf_checkpoint",
            "ref_load",
        )
    uses_lora = config.lora_rank is not None or config.critic_lora_rank is not None
    if uses_lora and config.offload_backend == "torch_memory_saver" and config.lora_base_offload:
        raise FieldError(
            "offload_backend",
            "torch_memory_saver copies the frozen LoRA base to the host at every sleep; use pinned_host "
            "(which keeps one host copy of the base and copies it back only), or keep the base on the GPU with "
            "`lora_base_offload` False",
            "lora_base_offload",
        )
    if config.lora_base_share is True and not config.shares_lora_base:
        raise FieldError(
            "lora_base_share",
            "shares the host copy of the actor's and the critic's frozen LoRA bases: it needs both "
            "`lora_rank` and `critic_lora_rank`, `lora_base_offload` True and `offload_backend` pinned_host; "
            "set those, or leave `lora_base_share` unset (on wherever they hold) or False",
            "lora_rank",
            "critic_lora_rank",
        )


def check_batches(config: Any) -> None:
    """A rollout is a whole number of global batches, each at least one micro-batch."""
    if config.samples_per_rollout % config.global_batch_size:
        raise FieldError(
            "global_batch_size",
            f"{config.global_batch_size} does not divide the "
            f"{config.samples_per_rollout} samples of a rollout (`rollout_batch_size` * "
            "`n_samples_per_prompt`); pick a divisor so each rollout is a whole number of steps",
            "rollout_batch_size",
            "n_samples_per_prompt",
        )
    if config.use_dynamic_batch_size and config.max_tokens_per_gpu is None:
        raise FieldError(
            "max_tokens_per_gpu",
            "not set, but `use_dynamic_batch_size` cuts micro-batches by tokens; give "
            "the tokens one micro-batch may hold on one GPU (e.g. the longest prompt + response)",
            "use_dynamic_batch_size",
        )
    if not config.use_dynamic_batch_size and config.max_tokens_per_gpu is not None:
        raise FieldError(
            "max_tokens_per_gpu",
            "set, but micro-batches are cut by `micro_batch_size`; turn on "
            "`use_dynamic_batch_size` to cut them by tokens, or leave it unset",
            "micro_batch_size",
            "use_dynamic_batch_size",
        )
    if config.use_dynamic_batch_size and config.log_probs_micro_batch_size is not None:
        raise FieldError(
            "log_probs_micro_batch_size",
            "set, but `use_dynamic_batch_size` cuts micro-batches by tokens; give the forward-only "
            "passes' budget as `log_probs_max_tokens_per_gpu`, or leave it unset",
            "use_dynamic_batch_size",
            "log_probs_max_tokens_per_gpu",
        )
    if config.micro_batch_size > config.global_batch_size:
        raise FieldError(
            "micro_batch_size",
            f"{config.micro_batch_size} exceeds `global_batch_size` ({config.global_batch_size}); lower it",
            "global_batch_size",
        )


def check_folders(config: Any) -> None:
    """Hugging Face folders hold a config.json (a reward model starting the critic has one label); load
    folders exist (or are the save folder); the critic's are its own."""
    for name in ("hf_checkpoint", "critic_hf_checkpoint", "ref_load"):
        path = getattr(config, name)
        if path is None:
            continue
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FieldError(
                name,
                f"{path!r} is not a Hugging Face checkpoint folder (no config.json); "
                "point it at a folder written by save_pretrained",
            )
    check_critic_start(config.critic_hf_checkpoint)
    pairs = (("load", "save"), ("critic_load", "critic_save"))
    for load_name, save_name in pairs:
        load, save = getattr(config, load_name), getattr(config, save_name)
        if load is None:
            continue
        if os.path.exists(load) and not os.path.isdir(load):
            raise FieldError(load_name, f"{load!r} is a file; it must be a checkpoint folder")
        if not os.path.exists(load) and not same_path(load, save):
            raise FieldError(
                load_name,
                f"folder {load!r} does not exist; fix the path, or set it equal to "
                f"`{save_name}` for the first run of a resumable job",
                save_name,
            )
    for actor_name, critic_name in (("load", "critic_load"), ("save", "critic_save")):
        actor_path, critic_path = getattr(config, actor_name), getattr(config, critic_name)
        if actor_path is not None and critic_path is not None and same_path(actor_path, critic_path):
            raise FieldError(
                critic_name,
                f"{critic_path!r} is the actor's `{actor_name}` folder; give the critic a folder of its own",
                actor_name,
            )


def check_critic_start(path: str | None) -> None:
    """A sequence-classification folder may start the critic only with one label (its score is the value)."""
    if path is None:
        return
    try:
        hf = json.loads(Path(path, "config.json").read_text())
    except (OSError, ValueError):
        return  # a folder that cannot be read fails where it is loaded, naming the file
    architectures = hf.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return
    # transformers' reading: num_labels, else the size of id2label, else 2.
    labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2
    if labels != 1:
        raise FieldError(
            "critic_hf_checkpoint",
            f"{path!r} is a classifier with {labels} labels; the critic's value head is "
            "one number, so start it from a reward model with num_labels=1 (its score head becomes the value "
            "head) or from a causal LM",
        )


def same_path(a: str | None, b: str | None) -> bool:
    """Whether `a` and `b` are both set and name the same path."""
    if a is None or b is None:
        return False
    return os.path.abspath(a) == os.path.abspath(b)


def check_model_layout(config: Any, role: str) -> None:
    """`role`'s model (its Hugging Face config.json) splits over the role's tensor- and pipeline-parallel sizes.

    Heads and key/value heads must divide by the TP size (each rank holds whole
    heads), layers by the PP size; the vocabulary never needs to (it is padded).
    Raises a FieldError naming the size field (`critic_...` for the critic) and the fix.
    """
    from tandem.megatron.models.hf_config import ModelSpec  # torch: `--help` and the seam's import load none

    field = "critic_hf_checkpoint" if role == "critic" and config.critic_hf_checkpoint else "hf_checkpoint"
    try:
        spec = ModelSpec.from_hf(config.hf_checkpoint_of(role))
    except ValueError as exc:
        raise FieldError(field, str(exc)) from None
    tp, pp = config.topology(role)
    prefix = "critic_" if role == "critic" else ""
    for what, count in (
        ("attention heads", spec.num_attention_heads),
        ("key/value heads", spec.num_kv_heads),
    ):
        if count % tp:
            fits = [
                d
                for d in range(1, count + 1)
                if spec.num_attention_heads % d == 0 and spec.num_kv_heads % d == 0
            ]
            raise FieldError(
                f"{prefix}tensor_model_parallel_size",
                f"{tp} does not divide the {role}'s {count} {what} "
                f"({config.hf_checkpoint_of(role)}: num_attention_heads={spec.num_attention_heads}, "
                f"num_key_value_heads={spec.num_kv_heads}); each tensor-parallel rank holds whole heads, so "
                f"use one of {', '.join(map(str, fits))}",
            )
    if spec.num_layers % pp:
        fits = [d for d in range(1, spec.num_layers + 1) if spec.num_layers % d == 0]
        raise FieldError(
            f"{prefix}pipeline_model_parallel_size",
            f"{pp} does not divide the {role}'s {spec.num_layers} layers; use one of {', '.join(map(str, fits))}",
        )
