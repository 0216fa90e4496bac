"""What a forward-only role's Hugging Face folder holds, read from its files without loading a model (pure).

The reward model's and the teacher's checks read a folder's config.json, whether it
holds a tokenizer, and whether that tokenizer is the policy's (`vocabulary_difference`),
before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_config(path: str | Path) -> dict[str, Any] | None:
    """The folder's config.json as a dict; None when there is none (or it is not a JSON object)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config.json: its `text_config` where it nests one, else itself."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def has_tokenizer(path: str | Path) -> bool:
    """Whether a Hugging Face folder holds a tokenizer's files."""
    return any((Path(path) / f).is_file() for f in _TOKENIZER_FILES)


def vocabulary_difference(
    policy: str | Path, other: str | Path, names: tuple[str, str] = ("the policy's", "the other's")
) -> str | None:
    """None when the tokenizers of two folders map the same tokens to the same ids; else what differs, in words
    (`names`: how the message calls each).

    Both folders must hold a tokenizer (`has_tokenizer`); transformers reads each
    (`AutoTokenizer`), its added tokens included.
    """
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(policy)).get_vocab()
    theirs = AutoTokenizer.from_pretrained(str(other)).get_vocab()
    if ours == theirs:
        return None
    moved = sorted(t for t in ours.keys() & theirs.keys() if ours[t] != theirs[t])
    only_ours, only_theirs = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    parts = [f"{len(ours)} against {len(theirs)} tokens"]
    if moved:
        parts.append(
            f"{len(moved)} with other ids (e.g. {moved[0]!r}: {ours[moved[0]]} against {theirs[moved[0]]})"
        )
    if only_ours:
        parts.append(f"{len(only_ours)} only in {names[0]} (e.g. {only_ours[0]!r})")
    if only_theirs:
        parts.append(f"{len(only_theirs)} only in {names[1]} (e.g. {only_theirs[0]!r})")
    return ", ".join(parts)


def int_or_none(value: Any) -> int | None:
    """`value` when it is an int (not a bool), else None."""
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
