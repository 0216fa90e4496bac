"""What a reward-model folder must be, read from its files without loading the model.

A reward model is a Hugging Face sequence-classification folder (`save_pretrained` of
an `AutoModelForSequenceClassification`, e.g. `LlamaForSequenceClassification` or
`Qwen2ForSequenceClassification`) with one label: its `score` head maps the last
hidden state to one number. `read_reward_model_folder` checks exactly that, naming
the flag the folder came from, before any process starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.ppo.rollout.forward._folder import has_tokenizer, int_or_none, read_config, text_config

__all__ = [
    "RewardModelFolder",
    "has_tokenizer",
    "is_sequence_classification",
    "num_labels",
    "read_config",
    "read_reward_model_folder",
    "weight_names",
]

SEQUENCE_CLASSIFICATION = "ForSequenceClassification"
"""The suffix of a sequence-classification architecture's class name in config.json."""


@dataclass(frozen=True)
class RewardModelFolder:
    """The facts of a reward-model folder that the run checks against."""

    path: Path
    architecture: str
    """The sequence-classification class named in config.json (e.g. `Qwen2ForSequenceClassification`)."""
    model_type: str
    vocab_size: int | None
    max_position_embeddings: int | None
    pad_token_id: int | None
    """The id whose trailing run is skipped when the score's position is found (transformers' rule)."""
    has_tokenizer: bool


def is_sequence_classification(config: dict[str, Any] | None) -> bool:
    """Whether a config.json names a sequence-classification architecture."""
    architectures = (config or {}).get("architectures") or []
    return any(isinstance(a, str) and a.endswith(SEQUENCE_CLASSIFICATION) for a in architectures)


def num_labels(config: dict[str, Any]) -> int:
    """The number of labels as transformers reads it: `num_labels`, else `id2label`'s size, else 2."""
    if isinstance(config.get("num_labels"), int):
        return int(config["num_labels"])
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label)
    return 2


def weight_names(path: Path) -> set[str] | None:
    """The tensor names of the folder's safetensors weights; None when it holds only other formats.

    Raises ValueError when there are no weight files at all, or when a sharded index
    names a shard that is not there.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise ValueError(f"{path}: model.safetensors.index.json names shards that are missing: {missing}")
        return set(weight_map)
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        names: set[str] = set()
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                names.update(handle.keys())
        return names
    if any(path.glob("pytorch_model*.bin")):
        return None
    raise ValueError(f"{path}: no weights (no *.safetensors, no pytorch_model*.bin)")


def read_reward_model_folder(path: str | Path, flag: str) -> RewardModelFolder:
    """Check that `path` is a one-label sequence-classification folder; its facts.

    Raises ValueError naming `flag` and the fix when the folder or its config.json is
    missing, the architecture is not a sequence classifier, it has more than one label,
    or its weights (the `score` head included) are missing.
    """
    folder = Path(path)
    config = read_config(folder)
    if config is None:
        raise ValueError(
            f"{flag}: {str(path)!r} is not a Hugging Face model folder (no readable config.json); point it "
            "at a folder written by AutoModelForSequenceClassification.save_pretrained"
        )
    if not is_sequence_classification(config):
        raise ValueError(
            f"{flag}: {str(path)!r} holds a {config.get('architectures') or 'model without architectures'}, "
            "not a sequence-classification model; a reward model is an AutoModelForSequenceClassification "
            "(e.g. LlamaForSequenceClassification) with num_labels=1, saved with save_pretrained"
        )
    labels = num_labels(config)
    if labels != 1:
        raise ValueError(
            f"{flag}: {str(path)!r} is a classifier with {labels} labels; a reward model has exactly one "
            "(its score is a single number): give a folder saved with num_labels=1"
        )
    try:
        names = weight_names(folder)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}; save the model's weights with save_pretrained") from None
    if names is not None and not any(n == "score.weight" or n.endswith(".score.weight") for n in names):
        raise ValueError(
            f"{flag}: {str(path)!r} has no `score.weight` in its weights, so its score head would be "
            "random; give a reward model saved with its score head"
        )
    text = text_config(config)
    architecture = next(a for a in config["architectures"] if a.endswith(SEQUENCE_CLASSIFICATION))
    return RewardModelFolder(
        path=folder,
        architecture=architecture,
        model_type=str(config.get("model_type")),
        vocab_size=int_or_none(text.get("vocab_size")),
        max_position_embeddings=int_or_none(text.get("max_position_embeddings")),
        pad_token_id=int_or_none(text.get("pad_token_id", config.get("pad_token_id"))),
        has_tokenizer=has_tokenizer(folder),
    )
