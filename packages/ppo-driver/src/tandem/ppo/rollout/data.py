"""Prompt data: records of a JSONL or Parquet file, tokenized once, drawn in a per-epoch shuffle that resumes exactly.

A prompt file has one JSON object per line (or one row per prompt: Parquet, a
Hugging Face datasets folder) with either a `prompt` (a string, or chat messages
as verl keeps them) or chat `messages` (a list of `{"role", "content"}`), an
optional `label` (else verl's `reward_model.ground_truth`), and any other fields,
which travel with the prompt to the reward function as `metadata` (`record_of`).

The order in which prompts are drawn depends only on `(seed, epoch)` and the
number of kept prompts, so `state_dict()` needs just the epoch and the cursor in
it: a resumed run draws the same next prompts as the run that was stopped.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.ppo.rollout.prompt_tables import ACCEPTED_FORMATS, file_kind, table_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_TOKENIZE_CHUNK = 1024
"""Prompts tokenized per call of the (batched, fast) tokenizer."""


@dataclass(frozen=True)
class PromptRecord:
    """One line of a prompt file, as read; exactly one of `prompt` and `messages` is set."""

    index: int
    """Position of the record in the file (0-based, blank lines not counted)."""
    prompt: str | None
    """The prompt as plain text, or None when the line gives chat `messages`."""
    messages: list[dict[str, str]] | None
    """Chat messages (`role`, `content`), or None when the line gives a plain `prompt`."""
    label: Any
    """The reference answer for the reward function (None when the line has none)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Every other field of the line, passed on to the reward function."""
    origin: str = field(default="", compare=False)
    """Where it came from, for messages: `FILE, line N` (JSONL) or `FILE, row N` (a table)."""


@dataclass(frozen=True)
class PromptSample:
    """A prompt ready for the rollout engine: its record, token ids and text as the model sees it."""

    record: PromptRecord
    prompt_ids: list[int]
    """Token ids of `prompt_text` (chat template applied where it applies)."""
    prompt_text: str
    """The prompt as the model sees it, chat template and generation prompt included."""


def _line_error(origin: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"{origin}: {problem}; {fix}")


def _check_messages(origin: str, key: str, messages: Any) -> list[dict[str, str]]:
    fix = f'give "{key}" as a list of {{"role": ..., "content": ...}} objects with string values'
    if not isinstance(messages, list) or not messages:
        raise _line_error(origin, f'"{key}" is {type(messages).__name__}, not a non-empty list', fix)
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise _line_error(origin, f'"{key}"[{i}] is not a message with string role and content', fix)
    # A table's struct column gives every message each field of the column: the ones it does not use are null.
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def read_prompts(
    path: str | os.PathLike[str],
    *,
    prompt_key: str = "prompt",
    messages_key: str = "messages",
    label_key: str = "label",
) -> list[PromptRecord]:
    """Read a prompt file into records, in file order: JSONL, Parquet, or a folder of tables.

    JSONL: one JSON object per line, blank lines skipped. Parquet (a `.parquet` file or a
    folder of them) and Hugging Face `datasets` folders (`save_to_disk`): one row per
    prompt, read with pyarrow (`prompt_tables`). Every row follows one rule (`record_of`).
    Raises ValueError naming the file, the line or row and the key for a line that is not
    UTF-8 or not a JSON object, a row that breaks the rule, or a value of the wrong type;
    for a missing or empty file; and for a binary file of another kind, naming the formats
    that are read.
    """
    path = Path(path)
    if path.is_dir():
        rows: Iterator[tuple[str, dict[str, Any]]] = table_rows(path)
    elif not path.is_file():
        raise ValueError(
            f"prompt file {path} does not exist (or is not a file); pass the path of a JSONL or Parquet file"
        )
    else:
        kind = file_kind(path)
        if kind == "parquet":
            rows = table_rows(path)
        elif kind == "text":
            rows = _jsonl_rows(path)
        else:
            raise ValueError(f"{path} is not a text file of prompts ({kind}); give {ACCEPTED_FORMATS}")
    records: list[PromptRecord] = []
    for origin, row in rows:
        records.append(
            record_of(
                row,
                origin,
                index=len(records),
                prompt_key=prompt_key,
                messages_key=messages_key,
                label_key=label_key,
            )
        )
    if not records:
        raise ValueError(f"prompt file {path} holds no prompts; write one JSON object per line")
    return records


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(origin, object) of each non-blank line of a JSONL file."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            origin = f"{path}, line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _line_error(
                    origin,
                    f"byte {raw[exc.start]:#04x} at column {exc.start + 1} is not UTF-8",
                    "save the file as UTF-8 text",
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _line_error(
                    origin, f"not valid JSON ({exc.msg})", "write one JSON object per line"
                ) from exc
            if not isinstance(row, dict):
                raise _line_error(
                    origin, f"a JSON {type(row).__name__}, not an object", "write one JSON object per line"
                )
            yield origin, row


def record_of(
    row: dict[str, Any],
    origin: str,
    *,
    index: int,
    prompt_key: str = "prompt",
    messages_key: str = "messages",
    label_key: str = "label",
) -> PromptRecord:
    """One row of any prompt file (a JSONL line, a Parquet row) as a record, by one rule.

    - The prompt is `prompt_key`'s value, a string (a plain prompt) or a list of chat
      messages (as verl's `prompt` column holds them), or else `messages_key`'s chat
      messages; exactly one of the two keys holds a value (a null counts as none).
    - The label is `label_key`'s value; a dotted key reaches into nested fields
      (`reward_model.ground_truth`); where the row has no such field, verl's
      `reward_model.ground_truth` is the label; else None.
    - Every other field is metadata, passed to the reward function.

    ValueError naming `origin` (file and line or row) and the key otherwise.
    """
    row = dict(row)
    has_prompt, has_messages = row.get(prompt_key) is not None, row.get(messages_key) is not None
    if has_prompt == has_messages:
        which = "both" if has_prompt else "neither"
        raise _line_error(
            origin,
            f'has {which} of "{prompt_key}" and "{messages_key}"',
            f'give exactly one: a prompt string or chat messages under "{prompt_key}", or chat messages under '
            f'"{messages_key}" (or name the field your file uses with --input-key)',
        )
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    if has_prompt:
        value = row.pop(prompt_key)
        row.pop(messages_key, None)
        if isinstance(value, str):
            prompt = value
        elif isinstance(value, list):
            messages = _check_messages(origin, prompt_key, value)
        else:
            raise _line_error(
                origin,
                f'"{prompt_key}" is {type(value).__name__}, not a string or a list of chat messages',
                f'give "{prompt_key}" as a string',
            )
    else:
        row.pop(prompt_key, None)
        messages = _check_messages(origin, messages_key, row.pop(messages_key))
    label = _label(row, label_key)
    return PromptRecord(index, prompt, messages, label, row, origin=origin)


def _label(row: dict[str, Any], label_key: str) -> Any:
    """The label by `record_of`'s rule; a top-level label field leaves the row (the rest is metadata)."""
    if label_key in row:
        return row.pop(label_key)
    for path in (label_key.split("."), ["reward_model", "ground_truth"]):
        value: Any = row
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if len(path) > 1 and value is not None:
            return value
    return None


class PromptDataset:
    """Tokenized prompts, drawn batch by batch in a per-epoch permutation seeded by `(seed, epoch)`.

    Each record is tokenized once, here. Chat `messages` always go through the
    tokenizer's chat template with the generation prompt; a plain `prompt` goes
    through it as one user message when `apply_chat_template` is set and the
    tokenizer has a template, and is tokenized as it is otherwise. Prompts longer
    than `max_prompt_len` tokens are dropped and counted in `num_dropped`.
    """

    def __init__(
        self,
        records: Sequence[PromptRecord],
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_prompt_len: int,
        seed: int,
        apply_chat_template: bool = True,
    ) -> None:
        if max_prompt_len < 1:
            raise ValueError(f"--max-prompt-len is {max_prompt_len}; give a positive number of tokens")
        self.seed = seed
        self.max_prompt_len = max_prompt_len
        has_template = bool(getattr(tokenizer, "chat_template", None))
        texts: list[str] = []
        add_special_tokens: list[bool] = []
        for record in records:
            if record.messages is not None or (apply_chat_template and has_template):
                if not has_template:
                    raise ValueError(
                        f"{record.origin or f'prompt #{record.index}'} gives chat messages but the tokenizer has "
                        "no chat template; "
                        "use a tokenizer with a chat template, or give plain prompt strings"
                    )
                messages = record.messages or [{"role": "user", "content": record.prompt or ""}]
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                assert isinstance(text, str), type(text)
                texts.append(text)
                # The template writes the special tokens itself (as apply_chat_template(tokenize=True) does).
                add_special_tokens.append(False)
            else:
                texts.append(record.prompt or "")
                add_special_tokens.append(True)
        ids = self._tokenize(tokenizer, texts, add_special_tokens)
        for record, prompt_ids in zip(records, ids, strict=True):
            if not prompt_ids:
                raise ValueError(
                    f"{record.origin or f'prompt #{record.index}'}: the prompt is empty (no tokens), and the "
                    "engine needs at least one; write the prompt, drop that line, or apply the chat template "
                    "(--apply-chat-template), which adds tokens of its own"
                )

        self.samples: list[PromptSample] = [
            PromptSample(record, prompt_ids, text)
            for record, prompt_ids, text in zip(records, ids, texts, strict=True)
            if len(prompt_ids) <= max_prompt_len
        ]
        """The kept prompts, in file order."""
        self.num_dropped = len(records) - len(self.samples)
        """Prompts dropped for being longer than `max_prompt_len` tokens."""
        self.first_dropped: tuple[PromptRecord, int] | None = next(
            ((r, len(i)) for r, i in zip(records, ids, strict=True) if len(i) > max_prompt_len), None
        )
        """The first dropped prompt's record and token count (None: none dropped)."""
        if not self.samples:
            raise ValueError(
                f"all {len(records)} prompts are longer than --max-prompt-len={max_prompt_len} tokens; "
                "raise --max-prompt-len or shorten the prompts"
            )
        self._epoch = 0
        self._cursor = 0
        self._order = self._permutation(0)

    @staticmethod
    def _tokenize(
        tokenizer: PreTrainedTokenizerBase, texts: list[str], add_special_tokens: list[bool]
    ) -> list[list[int]]:
        ids: list[list[int]] = [[] for _ in texts]
        for flag in (False, True):
            positions = [i for i, f in enumerate(add_special_tokens) if f is flag]
            for start in range(0, len(positions), _TOKENIZE_CHUNK):
                chunk = positions[start : start + _TOKENIZE_CHUNK]
                encoded = tokenizer([texts[i] for i in chunk], add_special_tokens=flag)["input_ids"]
                for i, prompt_ids in zip(chunk, encoded, strict=True):
                    ids[i] = list(prompt_ids)
        return ids

    def __len__(self) -> int:
        """Number of kept prompts (one epoch)."""
        return len(self.samples)

    @property
    def epoch(self) -> int:
        """The epoch that the next prompt drawn belongs to (0-based)."""
        return self._epoch

    def _permutation(self, epoch: int) -> list[int]:
        # A string seed hashes deterministically (sha512), unlike hash() of a tuple.
        order = list(range(len(self.samples)))
        random.Random(f"tandem.ppo.rollout.data:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptSample]:
        """Draw the next `n` prompts, continuing into the next epoch's permutation when this one ends."""
        if n < 0:
            raise ValueError(f"next_batch needs a batch size >= 0, got {n}")
        batch: list[PromptSample] = []
        while len(batch) < n:
            take = min(n - len(batch), len(self._order) - self._cursor)
            batch.extend(self.samples[i] for i in self._order[self._cursor : self._cursor + take])
            self._cursor += take
            if self._cursor == len(self._order):
                self._epoch += 1
                self._cursor = 0
                self._order = self._permutation(self._epoch)
        return batch

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands (JSON-serialisable); `load_state_dict` continues from it."""
        return {"epoch": self._epoch, "cursor": self._cursor, "num_prompts": len(self), "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream from `state_dict()`'s position; the same data and seed are required."""
        num_prompts = state.get("num_prompts", len(self))
        if num_prompts != len(self) or state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"the checkpoint's data state was saved with {num_prompts} kept prompts and seed "
                f"{state.get('seed')}, but this run has {len(self)} and seed {self.seed}; resume with the "
                "same prompt file, --max-prompt-len and --seed"
            )
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor < len(self):
            raise ValueError(
                f"data state out of range: epoch {epoch}, cursor {cursor} of {len(self)} prompts"
            )
        self._epoch, self._cursor = epoch, cursor
        self._order = self._permutation(epoch)
