"""Prompt data: the JSONL reader, the tokenized dataset's shuffle and resume, and the tiny tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.ppo._tiny import CHARACTERS, build_tiny_tokenizer
from tandem.ppo.rollout.data import PromptDataset, PromptRecord, read_prompts


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def make_records(n: int) -> list[PromptRecord]:
    return [PromptRecord(i, f"what is {i}+1?", None, str(i + 1), {}) for i in range(n)]


# --- the tiny tokenizer ---------------------------------------------------------------------------


def test_tiny_tokenizer_round_trips_and_digits_are_single_tokens(tokenizer: Any, tmp_path: Path) -> None:
    assert len(tokenizer) <= 64
    text = "what is 12+7? answer: 19, not 20. (a-b)*c/d = \\boxed{x}\n"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text
    for digit in "0123456789":
        assert len(tokenizer(digit)["input_ids"]) == 1
    assert {tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token} == {
        "<pad>",
        "<s>",
        "</s>",
        "<unk>",
    }
    assert tokenizer("Q")["input_ids"] == [tokenizer.unk_token_id]

    # Saved and loaded back as any Hugging Face tokenizer folder: same ids, same template.
    from transformers import AutoTokenizer

    build_tiny_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == ids
    assert loaded.chat_template == tokenizer.chat_template


def test_tiny_tokenizer_chat_template_decodes_readably(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "what is 2+3?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s>user: what is 2+3?</s>\n<s>assistant: "
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 2  # the special tokens are single tokens, not characters
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user: what is 2+3?\nassistant: "
    answer = tokenizer("5")["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(answer, skip_special_tokens=True) == "5"
    assert set(CHARACTERS) >= set("0123456789abcdefghijklmnopqrstuvwxyz +-=?:,.")


# --- read_prompts ---------------------------------------------------------------------------------


def test_read_prompts_keeps_prompt_messages_label_and_metadata(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "1+1?", "label": "2", "source": "gsm", "level": 3},
            {"messages": messages, "label": 4},
            {"prompt": "no label"},
        ],
    )
    path.write_text(path.read_text() + "\n  \n", encoding="utf-8")  # trailing blank lines are skipped
    records = read_prompts(path)
    assert records == [
        PromptRecord(0, "1+1?", None, "2", {"source": "gsm", "level": 3}),
        PromptRecord(1, None, messages, 4, {}),
        PromptRecord(2, "no label", None, None, {}),
    ]


def test_read_prompts_custom_keys(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "1+1?", "answer": "2", "prompt": "kept"}])
    (record,) = read_prompts(path, prompt_key="question", label_key="answer")
    assert (record.prompt, record.label, record.metadata) == ("1+1?", "2", {"prompt": "kept"})


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a JSON list, not an object"),
        ('{"label": 1}', 'has neither of "prompt" and "messages"'),
        ('{"prompt": "a", "messages": []}', 'has both of "prompt" and "messages"'),
        ('{"prompt": 3}', '"prompt" is int, not a string'),
        ('{"messages": "hi"}', '"messages" is str, not a non-empty list'),
        ('{"messages": [{"role": "user"}]}', '"messages"[0] is not a message'),
    ],
)
def test_read_prompts_errors_name_file_line_and_key(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 3") as info:
        read_prompts(path)
    assert str(path) in str(info.value)
    assert expected in str(info.value)


def test_read_prompts_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"nope\.jsonl does not exist"):
        read_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no prompts"):
        read_prompts(tmp_path / "empty.jsonl")


# --- Parquet and datasets folders, and the files that are refused ---------------------------------

VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"What is {d} + {d}? Think step by step."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * d)},
        "extra_info": {"split": "train", "index": d},
    }
    for d in range(3)
]
"""Rows in verl's schema (its examples/data_preprocess/gsm8k.py): chat messages under `prompt`, the label
in `reward_model.ground_truth`."""


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_in_verls_schema_is_read_by_the_documented_rule(tmp_path: Path) -> None:
    """A `prompt` list of messages is a chat; with no `label` column, `reward_model.ground_truth` is the
    label; every other column travels as metadata."""
    path = write_parquet(tmp_path / "train.parquet", VERL_ROWS)
    records = read_prompts(path)
    assert [(r.prompt, r.messages, r.label) for r in records] == [
        (None, row["prompt"], row["reward_model"]["ground_truth"]) for row in VERL_ROWS
    ]
    assert records[1].metadata == {
        k: VERL_ROWS[1][k] for k in ("data_source", "ability", "reward_model", "extra_info")
    }
    assert records[2].origin == f"{path}, row 3"
    (dotted,) = read_prompts(
        write_parquet(tmp_path / "one.parquet", VERL_ROWS[:1]), label_key="extra_info.index"
    )
    assert dotted.label == 0


def test_parquet_columns_are_chosen_by_input_and_label_key(tmp_path: Path) -> None:
    rows = [{"question": "1+1?", "answer": "2", "id": 7}, {"question": "2+2?", "answer": "4", "id": 8}]
    path = write_parquet(tmp_path / "qa.parquet", rows)
    records = read_prompts(path, prompt_key="question", label_key="answer")
    assert [(r.prompt, r.label, r.metadata) for r in records] == [
        ("1+1?", "2", {"id": 7}),
        ("2+2?", "4", {"id": 8}),
    ]
    with pytest.raises(ValueError, match=r"qa\.parquet, row 1: has neither of \"prompt\" and \"messages\""):
        read_prompts(path)


def test_folders_of_parquet_files_and_datasets_folders_are_read(tmp_path: Path) -> None:
    import pyarrow as pa

    shards = tmp_path / "hub" / "data"
    shards.mkdir(parents=True)
    write_parquet(shards / "train-00001-of-00002.parquet", VERL_ROWS[2:])
    write_parquet(shards / "train-00000-of-00002.parquet", VERL_ROWS[:2])
    assert [r.label for r in read_prompts(shards)] == ["0", "2", "4"]  # the shards in name order

    # Dataset.save_to_disk's layout: Arrow IPC stream files named in state.json.
    saved = tmp_path / "saved"
    saved.mkdir()
    table = pa.Table.from_pylist([{"prompt": "1+1?", "label": "2"}, {"prompt": "2+2?", "label": "4"}])
    with pa.ipc.new_stream(saved / "data-00000-of-00001.arrow", table.schema) as writer:
        writer.write_table(table)
    (saved / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (saved / "dataset_info.json").write_text("{}")
    records = read_prompts(saved)
    assert [(r.prompt, r.label, r.origin) for r in records] == [
        ("1+1?", "2", f"{saved / 'data-00000-of-00001.arrow'}, row 1"),
        ("2+2?", "4", f"{saved / 'data-00000-of-00001.arrow'}, row 2"),
    ]

    splits = tmp_path / "dict"
    (splits / "train").mkdir(parents=True)
    (splits / "test").mkdir()
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(
        ValueError, match="holds the splits test, train of a DatasetDict; point at one of them"
    ):
        read_prompts(splits)
    with pytest.raises(ValueError, match="holds no Parquet files and is no datasets folder"):
        read_prompts(tmp_path / "hub")  # the shards are one level down


@pytest.mark.parametrize(
    ("content", "kind"),
    [
        (b"\x1f\x8b\x08\x00" + bytes(40), "gzip-compressed"),
        (b"PK\x03\x04" + bytes(40), "a zip archive"),
        (b"\x89PNG\r\n\x1a\n" + bytes(40), "binary"),
        (b'{"prompt": "a"}\n\x00\x00\x00', "binary"),
    ],
    ids=["gzip", "zip", "png", "nul"],
)
def test_other_binary_files_are_refused_naming_the_formats(tmp_path: Path, content: bytes, kind: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        read_prompts(path)
    message = str(info.value)
    assert message.startswith(f"{path} is not a text file of prompts ({kind}")
    assert "JSONL (one JSON object per line), Parquet" in message and "datasets folder" in message


def test_an_empty_prompt_is_refused_naming_file_and_line(tokenizer: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1"}, {"prompt": "2+2"}, {"prompt": ""}])
    records = read_prompts(path)
    with pytest.raises(ValueError, match=rf"^{path}, line 3: the prompt is empty \(no tokens\)"):
        PromptDataset(records, tokenizer, max_prompt_len=100, seed=0, apply_chat_template=False)
    # Through the chat template the same line is a prompt of its own tokens: kept.
    assert len(PromptDataset(records, tokenizer, max_prompt_len=100, seed=0)) == 3


# --- PromptDataset: tokenization ------------------------------------------------------------------


def test_dataset_applies_the_chat_template(tokenizer: Any) -> None:
    records = [
        PromptRecord(0, "1+1?", None, "2", {}),
        PromptRecord(1, None, [{"role": "user", "content": "2+2?"}], "4", {}),
    ]
    dataset = PromptDataset(records, tokenizer, max_prompt_len=100, seed=0)
    texts = {s.record.index: s.prompt_text for s in dataset.samples}
    assert texts == {0: "<s>user: 1+1?</s>\n<s>assistant: ", 1: "<s>user: 2+2?</s>\n<s>assistant: "}
    for sample in dataset.samples:
        assert sample.prompt_ids == tokenizer(sample.prompt_text, add_special_tokens=False)["input_ids"]
        expected = tokenizer.apply_chat_template(
            sample.record.messages or [{"role": "user", "content": sample.record.prompt or ""}],
            add_generation_prompt=True,
        )
        assert sample.prompt_ids == list(expected["input_ids"])

    raw = PromptDataset(records, tokenizer, max_prompt_len=100, seed=0, apply_chat_template=False)
    plain, chat = raw.samples
    assert (plain.prompt_text, plain.prompt_ids) == ("1+1?", tokenizer("1+1?")["input_ids"])
    assert chat.prompt_text == texts[1]  # messages always go through the template


def test_dataset_without_a_chat_template_takes_raw_prompts_only(tokenizer: Any) -> None:
    bare = build_tiny_tokenizer()
    bare.chat_template = None
    (sample,) = PromptDataset(make_records(1), bare, max_prompt_len=100, seed=0).samples
    assert sample.prompt_text == "what is 0+1?"
    messages = [PromptRecord(0, None, [{"role": "user", "content": "hi"}], None, {})]
    with pytest.raises(ValueError, match="no chat template"):
        PromptDataset(messages, bare, max_prompt_len=100, seed=0)


def test_dataset_drops_and_counts_long_prompts(tokenizer: Any) -> None:
    records = [PromptRecord(i, "x" * length, None, None, {}) for i, length in enumerate([1, 50, 2, 60])]
    dataset = PromptDataset(records, tokenizer, max_prompt_len=40, seed=0, apply_chat_template=False)
    assert dataset.num_dropped == 2
    assert [s.record.index for s in dataset.samples] == [0, 2]
    assert sorted(s.record.index for s in dataset.next_batch(2)) == [0, 2]
    with pytest.raises(ValueError, match="--max-prompt-len"):
        PromptDataset(records, tokenizer, max_prompt_len=0, seed=0)
    with pytest.raises(ValueError, match="--max-prompt-len=10"):
        PromptDataset(records[1::2], tokenizer, max_prompt_len=10, seed=0)


# --- PromptDataset: the stream --------------------------------------------------------------------


@pytest.fixture(scope="module")
def records_by_size() -> dict[int, list[PromptRecord]]:
    return {n: make_records(n) for n in range(1, 13)}


def stream(dataset: PromptDataset, sizes: list[int]) -> list[int]:
    return [s.record.index for n in sizes for s in dataset.next_batch(n)]


@settings(max_examples=60, deadline=None)
@given(
    num_prompts=st.integers(1, 12),
    seed=st.integers(0, 2**32),
    sizes=st.lists(st.integers(0, 30), max_size=8),
)
def test_any_batch_sizes_give_the_same_stream_as_one_draw(
    tokenizer: Any,
    records_by_size: dict[int, list[PromptRecord]],
    num_prompts: int,
    seed: int,
    sizes: list[int],
) -> None:
    records = records_by_size[num_prompts]
    batched = PromptDataset(records, tokenizer, max_prompt_len=100, seed=seed)
    whole = PromptDataset(records, tokenizer, max_prompt_len=100, seed=seed)
    assert stream(batched, sizes) == stream(whole, [sum(sizes)])
    assert batched.state_dict() == whole.state_dict()


@settings(max_examples=60, deadline=None)
@given(
    num_prompts=st.integers(1, 12),
    seed=st.integers(0, 2**32),
    before=st.lists(st.integers(0, 30), max_size=5),
    after=st.lists(st.integers(0, 30), min_size=1, max_size=5),
)
def test_save_and_load_mid_stream_continues_identically(
    tokenizer: Any,
    records_by_size: dict[int, list[PromptRecord]],
    num_prompts: int,
    seed: int,
    before: list[int],
    after: list[int],
) -> None:
    records = records_by_size[num_prompts]
    original = PromptDataset(records, tokenizer, max_prompt_len=100, seed=seed)
    stream(original, before)
    state = json.loads(json.dumps(original.state_dict()))  # survives a checkpoint on disk
    resumed = PromptDataset(records, tokenizer, max_prompt_len=100, seed=seed)
    resumed.load_state_dict(state)
    assert resumed.epoch == original.epoch
    assert stream(resumed, after) == stream(original, after)


@settings(max_examples=40, deadline=None)
@given(num_prompts=st.integers(1, 12), seed=st.integers(0, 2**32), epochs=st.integers(1, 4))
def test_each_epoch_is_a_permutation_of_the_kept_prompts(
    tokenizer: Any, records_by_size: dict[int, list[PromptRecord]], num_prompts: int, seed: int, epochs: int
) -> None:
    dataset = PromptDataset(records_by_size[num_prompts], tokenizer, max_prompt_len=100, seed=seed)
    for epoch in range(epochs):
        assert dataset.epoch == epoch
        assert sorted(stream(dataset, [num_prompts])) == list(range(num_prompts))
    assert dataset.epoch == epochs


def test_the_shuffle_depends_on_seed_and_epoch(tokenizer: Any) -> None:
    records = make_records(12)
    a = PromptDataset(records, tokenizer, max_prompt_len=100, seed=1)
    b = PromptDataset(records, tokenizer, max_prompt_len=100, seed=2)
    a_epochs = [stream(a, [12]) for _ in range(3)]
    assert a_epochs[0] != stream(b, [12])
    assert len({tuple(order) for order in a_epochs}) == 3
    # Deterministic across processes too: a string seed, not hash(), drives the shuffle.
    assert a_epochs[0] == stream(PromptDataset(records, tokenizer, max_prompt_len=100, seed=1), [12])


def test_load_state_dict_refuses_other_data(tokenizer: Any) -> None:
    dataset = PromptDataset(make_records(5), tokenizer, max_prompt_len=100, seed=0)
    dataset.next_batch(3)
    state = dataset.state_dict()
    assert state["cursor"] == 3
    with pytest.raises(ValueError, match="--max-prompt-len"):
        PromptDataset(make_records(6), tokenizer, max_prompt_len=100, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="--seed"):
        PromptDataset(make_records(5), tokenizer, max_prompt_len=100, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        dataset.load_state_dict({"epoch": 0, "cursor": 5})
    with pytest.raises(ValueError, match=">= 0"):
        dataset.next_batch(-1)
