"""A run's reward model from its config: the checks before Ray starts, its GPU share, and its start.

`check_reward_config(config)` runs inside `PPOConfig.validate()`: the reward terms
(`--rm-type`, `--reward-weights`, `--custom-rm-path`, `--reward-model`) agree with
each other, the reward-model folder is a one-label sequence classifier whose
context holds the run's samples, and what it is fed (`--reward-model-input`) fits
its tokenizer. `start_reward_model` starts its workers, one per rollout bundle,
each taking `--reward-model-gpu-share` of that bundle's engine share.
"""

from __future__ import annotations

from typing import Any

from tandem.ppo.rollout.forward import rollout_bundle_shares
from tandem.ppo.rollout.forward._folder import vocabulary_difference
from tandem.ppo.rollout.reward_mix import CUSTOM_TERM, MODEL_TERM, RULE_TERMS, reward_terms
from tandem.ppo.rollout.rewards import NO_REWARD

from ._folder import (
    RewardModelFolder,
    has_tokenizer,
    is_sequence_classification,
    read_config,
    read_reward_model_folder,
)
from ._group import create_reward_model_group
from ._options import RewardModelOptions
from ._role import EventRecorder, RewardModelInputs, RewardModelRole

RM_TYPES = (*RULE_TERMS, MODEL_TERM, NO_REWARD)
"""What `--rm-type` accepts: a built-in rule, `model` (the reward model of `--reward-model`), or `none` (no
reward: a teacher's signal alone, `--teacher-hf-checkpoint`)."""


def uses_reward_model(config: Any) -> bool:
    """Whether the run's reward has a `model` term (a reward model is started)."""
    return MODEL_TERM in reward_terms(config)


def check_reward_config(config: Any) -> None:
    """The reward flags agree and the reward model (if any) fits the run; ValueError naming the flag."""
    hf = read_config(config.hf_checkpoint)
    if is_sequence_classification(hf):
        raise ValueError(
            f"--hf-checkpoint: {config.hf_checkpoint!r} is a sequence-classification model (a reward model); "
            "the actor needs a causal LM (...ForCausalLM): give a reward model as --reward-model, or as "
            "--critic-hf-checkpoint for a critic started from it"
        )
    terms = reward_terms(config)  # parses --reward-weights
    uses_model = MODEL_TERM in terms
    if config.rm_type == MODEL_TERM and not uses_model:
        raise ValueError(
            "--rm-type: model, but the reward model is not among the run's rewards (--custom-rm-path replaces "
            "--rm-type, and --reward-weights lists the rewards): add model=WEIGHT to --reward-weights"
        )
    if uses_model and config.rm_type != MODEL_TERM:
        raise ValueError(
            f"--reward-weights: names the `model` term, but --rm-type is {config.rm_type!r}; pass --rm-type "
            "model (and --reward-model PATH)"
        )
    if uses_model and not config.reward_model:
        raise ValueError(
            "--reward-model: not set, but --rm-type model scores with a reward model; point it at a Hugging "
            "Face sequence-classification folder (num_labels=1)"
        )
    if config.reward_model and not uses_model:
        raise ValueError(
            "--reward-model: set, but no reward uses it; pass --rm-type model (or add model=WEIGHT to "
            "--reward-weights), or leave --reward-model unset"
        )
    if CUSTOM_TERM in terms and not config.custom_rm_path:
        raise ValueError(
            "--reward-weights: names the `custom` term, but --custom-rm-path is not set; give the function"
        )
    if config.custom_rm_path and CUSTOM_TERM not in terms:
        raise ValueError(
            "--custom-rm-path: set, but --reward-weights has no `custom` term; add custom=WEIGHT to it"
        )
    share = config.reward_model_gpu_share
    if not 0 < share < 1:
        raise ValueError(
            f"--reward-model-gpu-share: got {share}; it must lie in (0, 1) (the engine keeps the rest of "
            "its share)"
        )
    budget = config.reward_model_max_tokens_per_gpu
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"--reward-model-max-tokens-per-gpu: got {budget!r}; it must be a positive integer")
    if config.reward_model_input not in ("tokens", "chat"):
        raise ValueError(f"--reward-model-input: got {config.reward_model_input!r}; choose tokens or chat")
    if uses_model:
        folder = read_reward_model_folder(config.reward_model, "--reward-model")
        _check_context(config, folder)
        _check_input(config, folder, hf)


def _check_context(config: Any, folder: RewardModelFolder) -> None:
    longest = config.max_prompt_len + config.rollout_max_response_len
    limit = folder.max_position_embeddings
    if config.reward_model_input == "tokens" and limit is not None and limit < longest:
        raise ValueError(
            f"--reward-model: its max_position_embeddings ({limit}) is below the longest sample the run "
            f"can draw (--max-prompt-len + --rollout-max-response-len = {longest}); lower those or use a "
            "reward model with a longer context"
        )


def _check_input(config: Any, folder: RewardModelFolder, policy: dict[str, Any] | None) -> None:
    from transformers import AutoTokenizer

    if config.reward_model_input == "chat":
        if not folder.has_tokenizer:
            raise ValueError(
                f"--reward-model-input: chat needs the reward model's tokenizer, but {config.reward_model!r} "
                "has none; save its tokenizer in the folder, or use --reward-model-input tokens"
            )
        tokenizer = AutoTokenizer.from_pretrained(config.reward_model)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"--reward-model-input: chat, but the tokenizer of {config.reward_model!r} has no chat "
                "template; use --reward-model-input tokens (the policy's ids) or a tokenizer with one"
            )
        return
    policy_vocab = (policy or {}).get("vocab_size")
    if isinstance(policy_vocab, int) and folder.vocab_size is not None and folder.vocab_size < policy_vocab:
        raise ValueError(
            f"--reward-model-input: tokens feeds the policy's ids (up to {policy_vocab}), but the reward "
            f"model has only {folder.vocab_size}; use --reward-model-input chat (its own tokenizer) or a "
            "reward model on the policy's tokenizer"
        )
    if (
        folder.has_tokenizer
        and has_tokenizer(config.hf_checkpoint)
        and vocabulary_difference(config.hf_checkpoint, config.reward_model) is not None
    ):
        raise ValueError(
            f"--reward-model-input: tokens feeds the policy's token ids, but the tokenizer of "
            f"{config.reward_model!r} is another one; use --reward-model-input chat (the reward model's "
            "own tokenizer and chat template) or a reward model on the policy's tokenizer"
        )


def start_reward_model(config: Any, placements: Any, *, events: EventRecorder) -> RewardModelRole:
    """The run's reward-model role: one worker per rollout bundle, loaded and awake."""
    from transformers import AutoTokenizer

    slot = placements.rollout
    share = rollout_bundle_shares(config).reward_model
    assert share is not None
    options = RewardModelOptions(
        dtype=config.reward_model_dtype, max_tokens_per_batch=config.reward_model_max_tokens_per_gpu
    )
    group = create_reward_model_group(
        config.reward_model,
        slot.pg,
        slot.bundle_indices,
        num_gpus_per_worker=share,
        num_cpus_per_worker=share,
        options=options,
    )
    tokenizer = (
        AutoTokenizer.from_pretrained(config.reward_model) if config.reward_model_input == "chat" else None
    )
    inputs = RewardModelInputs(config.reward_model_input, tokenizer)
    return RewardModelRole(group, inputs, events=events)
