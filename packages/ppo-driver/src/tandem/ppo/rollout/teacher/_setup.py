"""A run's teacher from its config: the checks before Ray starts, and its start.

`check_teacher_config(config)` runs inside `PPOConfig.validate()`: a distillation
coefficient has its teacher and a teacher its coefficient, a run without a reward
(`--rm-type none`) has a teacher to learn from, and the teacher's folder is a causal
LM on the student's tokenizer whose context holds the run's samples. `start_teacher`
starts its workers, one per rollout bundle, each taking `--teacher-gpu-share` of that
bundle's engine share.
"""

from __future__ import annotations

from typing import Any

from tandem.ppo.rollout.forward import EventRecorder, rollout_bundle_shares
from tandem.ppo.rollout.forward._folder import (
    has_tokenizer,
    int_or_none,
    read_config,
    text_config,
    vocabulary_difference,
)
from tandem.ppo.rollout.reward_mix import reward_terms
from tandem.ppo.rollout.rewards import NO_REWARD

from ._group import create_teacher_group
from ._options import TeacherOptions
from ._role import TeacherRole

FLAG = "--teacher-hf-checkpoint"
CAUSAL_LM = "ForCausalLM"
"""The suffix of a causal LM's architecture class name in config.json (`LlamaForCausalLM`)."""


def uses_teacher(config: Any) -> bool:
    """Whether the run distills from a teacher (one is started on the rollout GPUs)."""
    return bool(config.teacher_hf_checkpoint)


def check_teacher_config(config: Any) -> None:
    """The distillation flags agree and the teacher fits the student; ValueError naming the flag and the fix."""
    teacher, coef = config.teacher_hf_checkpoint, config.opd_coef
    if coef != 0 and not teacher:
        raise ValueError(
            f"--opd-coef: {coef} distills the student from a teacher, but {FLAG} is not set; point it at the "
            "teacher's Hugging Face folder (a causal LM on the student's tokenizer), or set --opd-coef 0"
        )
    if teacher and coef == 0:
        raise ValueError(
            f"{FLAG}: set, but --opd-coef is 0, so nothing learns from the teacher; give --opd-coef "
            f"(e.g. 1.0), or leave {FLAG} unset"
        )
    if NO_REWARD in reward_terms(config) and not teacher:
        raise ValueError(
            f"--rm-type: {NO_REWARD} gives every sample the reward 0, and there is no teacher to learn from; "
            f"give {FLAG} and --opd-coef (on-policy distillation alone), or choose a reward"
        )
    share = config.teacher_gpu_share
    if not 0 < share < 1:
        raise ValueError(
            f"--teacher-gpu-share: got {share}; it must lie in (0, 1) (the engine keeps the rest of its share)"
        )
    budget = config.teacher_max_tokens_per_gpu
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"--teacher-max-tokens-per-gpu: got {budget!r}; it must be a positive integer")
    if not teacher:
        return
    if rollout_bundle_shares(config).engine <= 0:
        raise ValueError(
            f"--teacher-gpu-share: {share} with --reward-model-gpu-share {config.reward_model_gpu_share} leaves "
            "the engine no share of its GPU; lower them so that they add up to less than 1"
        )
    _check_folder(config, teacher)


def _check_folder(config: Any, teacher: str) -> None:
    hf = read_config(teacher)
    if hf is None:
        raise ValueError(
            f"{FLAG}: {teacher!r} is not a Hugging Face model folder (no readable config.json); point it at "
            "a folder written by AutoModelForCausalLM.save_pretrained"
        )
    architectures = hf.get("architectures") or []
    if not any(isinstance(a, str) and a.endswith(CAUSAL_LM) for a in architectures):
        raise ValueError(
            f"{FLAG}: {teacher!r} holds a {architectures or 'model without architectures'}, not a causal LM; "
            "a teacher gives each token's log-prob, so give an AutoModelForCausalLM folder (e.g. "
            "Qwen2ForCausalLM)"
        )
    student = config.hf_checkpoint
    if not has_tokenizer(teacher):
        raise ValueError(
            f"{FLAG}: {teacher!r} has no tokenizer, so it cannot be checked against the student's "
            f"(--hf-checkpoint {student!r}); save the tokenizer the teacher was trained with in its folder"
        )
    difference = vocabulary_difference(student, teacher, names=("the student's", "the teacher's"))
    if difference is not None:
        raise ValueError(
            f"{FLAG}: the tokenizer of {teacher!r} is not the student's (--hf-checkpoint {student!r}): "
            f"{difference}; the teacher scores the student's own token ids, so give a teacher on the "
            "student's tokenizer (of its family)"
        )
    text = text_config(hf)
    student_vocab = (text_config(read_config(student) or {})).get("vocab_size")
    teacher_vocab = int_or_none(text.get("vocab_size"))
    if isinstance(student_vocab, int) and teacher_vocab is not None and teacher_vocab < student_vocab:
        raise ValueError(
            f"{FLAG}: {teacher!r} has {teacher_vocab} rows of output head, fewer than the student's "
            f"{student_vocab} (--hf-checkpoint {student!r}), so some of the student's ids have no log-prob; "
            "give a teacher with at least the student's vocabulary"
        )
    longest = config.max_prompt_len + config.rollout_max_response_len
    limit = int_or_none(text.get("max_position_embeddings"))
    if limit is not None and limit < longest:
        raise ValueError(
            f"{FLAG}: its max_position_embeddings ({limit}) is below the longest sample the run can draw "
            f"(--max-prompt-len + --rollout-max-response-len = {longest}); lower those or use a teacher with "
            "a longer context"
        )


def start_teacher(config: Any, placements: Any, *, events: EventRecorder) -> TeacherRole:
    """The run's teacher: one worker per rollout bundle, loaded and awake."""
    slot = placements.rollout
    share = rollout_bundle_shares(config).teacher
    assert share is not None
    options = TeacherOptions(
        dtype=config.teacher_dtype, max_tokens_per_batch=config.teacher_max_tokens_per_gpu
    )
    group = create_teacher_group(
        config.teacher_hf_checkpoint,
        slot.pg,
        slot.bundle_indices,
        num_gpus_per_worker=share,
        num_cpus_per_worker=share,
        options=options,
    )
    return TeacherRole(group, temperature=config.temperature, events=events)
