"""A run's inputs read and checked before Ray starts: model folders, tokenizer, reward function, prompts.

Each check raises a ValueError naming the flag, the file and the fix, so that a
bad input costs a second instead of minutes of Ray and worker start-up followed
by a remote traceback. `check_model_folder` looks at a local folder only: a hub
id is resolved to its local folder first, by whoever resolves it.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.ppo.rollout.data import PromptDataset, read_prompts
from tandem.ppo.rollout.episodes.chat import ChatRenderer
from tandem.ppo.rollout.episodes.endpoint import endpoint_options
from tandem.ppo.rollout.episodes.failures import EnvFailures
from tandem.ppo.rollout.episodes.generation import EpisodeSetup
from tandem.ppo.rollout.episodes.loading import load_custom_generate, load_env_factory
from tandem.ppo.rollout.episodes.runner import EpisodeLimits
from tandem.ppo.rollout.model_folder import missing_folder
from tandem.ppo.rollout.reward_mix import RewardMix, build_reward, reward_terms
from tandem.ppo.rollout.rewards import RewardFunction, load_reward

__all__ = [
    "LABEL_REWARDS",
    "announce_dropped",
    "check_model_folder",
    "check_prompt_labels",
    "check_prompts_fit",
    "check_reward_signature",
    "load_tokenizer",
    "model_context",
    "read_inputs",
]

# The name its lines show on the terminal, kept from before the layers.
logger = logging.getLogger("tandem.ppo.preflight")

WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin")
"""What a Hugging Face folder's weights are called (any one of them)."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
"""What a Hugging Face folder's tokenizer is made of (any one of them)."""

LABEL_REWARDS = frozenset({"exact_match", "math"})
"""Built-in rewards that compare each response with its prompt's label."""


def check_model_folder(folder: str | Path, flag: str, *, tokenizer: bool = True) -> None:
    """`folder` (local) holds a config, weights and, when asked, a tokenizer; ValueError naming `flag` otherwise."""
    path = Path(folder)
    if not path.exists():
        raise missing_folder(str(folder), flag)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{flag}: {str(folder)!r} is not a Hugging Face model folder (no config.json); point it at a "
            "folder written by save_pretrained"
        )
    if not any(next(path.glob(pattern), None) is not None for pattern in WEIGHT_FILES):
        raise ValueError(
            f"{flag}: {str(folder)!r} has a config.json but no weights (no *.safetensors or "
            "pytorch_model*.bin); save the model there with save_pretrained, or point the flag at a folder "
            "that has its weights"
        )
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{flag}: {str(folder)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the "
            "tokenizer there too (tokenizer.save_pretrained), or copy its files from the model's source"
        )


def load_tokenizer(folder: str | Path, flag: str) -> Any:
    """The folder's tokenizer (transformers' AutoTokenizer); ValueError naming `flag` when it does not load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        problem = " ".join(str(exc).split())
        raise ValueError(
            f"{flag}: the tokenizer in {str(folder)!r} does not load ({type(exc).__name__}: {problem[:300]}); "
            "save a tokenizer that transformers can read there (tokenizer.save_pretrained)"
        ) from None


def check_reward_signature(fn: Any, flag: str, spec: str) -> None:
    """`fn` can be called with one argument, the list of samples; ValueError naming `flag` otherwise."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a callable without a signature to read (a builtin): its first call will tell
    try:
        signature.bind([])
    except TypeError:
        raise ValueError(
            f"{flag} {spec!r}: the function's signature is {getattr(fn, '__name__', 'reward')}{signature}, but a "
            "reward takes one argument, the list of samples; write it as "
            "def reward(samples: list[RewardInput]) -> list[float] (async def works too)"
        ) from None


def check_prompt_labels(
    records: Sequence[Any],
    path: str,
    *,
    reward: str,
    custom: bool,
    label_key: str,
    flag: str = "--prompt-data",
) -> None:
    """Refuse prompts without a label under a built-in reward that compares with labels; warn once
    with the count under a custom reward (it may not need them)."""
    missing = [r for r in records if r.label is None]
    if not missing:
        return
    first = missing[0].index + 1
    counted = f"{len(missing)} of its {len(records)} prompts have no {label_key!r} field (the first: prompt {first})"
    if not custom and reward in LABEL_REWARDS:
        raise ValueError(
            f"{flag}: {path}: {counted}, but --rm-type {reward} compares each response with its label, so they "
            f"would train to reward 0; add the labels, point --label-key at the field that holds them, or give "
            "--custom-rm-path with a reward that needs none"
        )
    logger.warning("%s: %s: %s; the reward function gets label None for them", flag, path, counted)


def model_context(folder: str | Path) -> tuple[int, Path] | None:
    """The model's context in tokens (`max_position_embeddings` of its config.json, or of its
    `text_config`) and that file; None when the config gives none."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # check_model_folder names a missing or broken config
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value, path
    return None


def check_prompts_fit(dataset: PromptDataset, context: tuple[int, Path], *, response_len: int) -> None:
    """Every kept prompt leaves the engine room for a response within the model's context; ValueError
    naming --max-prompt-len, the first prompt that does not fit (file and line) and the limit."""
    positions, config_file = context
    too_long = next((s for s in dataset.samples if len(s.prompt_ids) >= positions), None)
    if too_long is None:
        return
    fitting = positions - response_len
    advice = (
        f"lower --max-prompt-len to at most {fitting} (room for --rollout-max-response-len {response_len})"
        if fitting >= 1
        else f"lower --max-prompt-len and --rollout-max-response-len ({response_len}) to add up to at most {positions}"
    )
    raise ValueError(
        f"--max-prompt-len: {too_long.record.origin or f'prompt #{too_long.record.index}'}: the prompt has "
        f"{len(too_long.prompt_ids)} tokens, but the model's context is {positions} (max_position_embeddings in "
        f"{config_file}), and --max-prompt-len {dataset.max_prompt_len} keeps it; {advice} to drop such "
        "prompts, or shorten them"
    )


def announce_dropped(dataset: PromptDataset, path: str, total: int, flag: str) -> None:
    """One log line with the prompts dropped for their length (`PromptDataset.num_dropped`), if any."""
    first = dataset.first_dropped
    if not dataset.num_dropped or first is None:
        return
    logger.warning(
        "%s: %s: %d of its %d prompts are longer than --max-prompt-len %d tokens and are dropped (the first: "
        "%s, %d tokens); raise --max-prompt-len to keep them",
        flag,
        path,
        dataset.num_dropped,
        total,
        dataset.max_prompt_len,
        first[0].origin or f"prompt #{first[0].index}",
        first[1],
    )


@dataclass
class RunInputs:
    """What a run reads before Ray starts, each part checked."""

    tokenizer: Any
    """The policy's tokenizer (transformers')."""
    reward_fn: RewardFunction | RewardMix
    dataset: PromptDataset
    """The training prompts."""
    eval_dataset: PromptDataset | None
    episodes: EpisodeSetup | None = None
    """How the rollout's episodes are played (`--env-path`, `--custom-generate-function-path`); None:
    single-turn samples."""


def episode_setup(config: Any, tokenizer: Any) -> EpisodeSetup | None:
    """The run's episodes, their environment factory or custom generate function loaded and checked
    (before Ray starts); None for a single-turn run."""
    if config.env_path is None and config.custom_generate_function_path is None:
        return None
    try:
        ChatRenderer(tokenizer)
    except ValueError as exc:
        raise ValueError(f"--hf-checkpoint: {exc}") from None
    limits = EpisodeLimits(
        max_turns=config.max_turns,
        max_turn_tokens=config.rollout_max_response_len,
        max_episode_tokens=config.max_episode_tokens,
        env_timeout_s=config.env_timeout,
        tool_timeout_s=config.tool_timeout,
    )
    name = config.env_path or config.custom_generate_function_path
    failures = EnvFailures(
        environment=name,
        limit=config.max_env_failures,
        log_dir=Path(config.run_dir) / "logs" / "episodes",
        flag="--env-path" if config.env_path is not None else "--custom-generate-function-path",
    )
    keep_kv = config.keep_episode_kv
    if config.env_path is not None:
        return EpisodeSetup(
            name, limits, failures, factory=load_env_factory(config.env_path), keep_kv=keep_kv
        )
    custom = load_custom_generate(config.custom_generate_function_path)
    endpoint = endpoint_options(config.endpoint_host, config.endpoint_port)
    return EpisodeSetup(name, limits, failures, custom=custom, endpoint=endpoint, keep_kv=keep_kv)


def read_inputs(config: Any) -> RunInputs:
    """Check the model folders, load the tokenizer and the reward, read and check the prompt files.

    A reward-model term (`--rm-type model`, `--reward-weights`) is the reward model's score,
    which the step's `score` turn computes; the reward here combines it with the rules.
    """

    check_model_folder(config.hf_checkpoint, "--hf-checkpoint")
    for name, folder in (
        ("--critic-hf-checkpoint", config.critic_hf_checkpoint),
        ("--ref-load", config.ref_load),
        ("--teacher-hf-checkpoint", config.teacher_hf_checkpoint),
    ):
        if folder is not None:
            check_model_folder(folder, name, tokenizer=False)
    tokenizer = load_tokenizer(config.hf_checkpoint, "--hf-checkpoint")
    episodes = episode_setup(config, tokenizer)
    if config.custom_rm_path is not None:
        check_reward_signature(load_reward(config.custom_rm_path), "--custom-rm-path", config.custom_rm_path)
    reward_fn = build_reward(config)
    terms = reward_terms(config)
    label_reward = next((t for t in terms if t in LABEL_REWARDS), config.rm_type)

    context = model_context(config.hf_checkpoint)

    def prompts(path: str, flag: str) -> PromptDataset:
        try:
            records = read_prompts(path, prompt_key=config.input_key, label_key=config.label_key)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
        if episodes is None:  # an environment reads the labels, if it needs any
            check_prompt_labels(
                records,
                path,
                reward=label_reward,
                custom=config.custom_rm_path is not None and label_reward not in LABEL_REWARDS,
                label_key=config.label_key,
                flag=flag,
            )
        try:
            dataset = PromptDataset(
                records,
                tokenizer,
                max_prompt_len=config.max_prompt_len,
                seed=config.seed,
                apply_chat_template=config.apply_chat_template,
            )
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
        if context is not None:
            check_prompts_fit(dataset, context, response_len=config.rollout_max_response_len)
        announce_dropped(dataset, path, len(records), flag)
        return dataset

    dataset = prompts(str(config.prompt_data), "--prompt-data")
    eval_dataset = None
    if config.eval_prompt_data is not None:
        eval_dataset = prompts(config.eval_prompt_data, "--eval-prompt-data")
    return RunInputs(tokenizer, reward_fn, dataset, eval_dataset, episodes)
