"""Prompt files that are tables, read with pyarrow: Parquet files, folders of them, Hugging Face `datasets` folders.

verl keeps its data as Parquet (a `prompt` column of chat messages, the label in
`reward_model.ground_truth`); a dataset downloaded from the hub is a folder of
Parquet shards; `datasets.Dataset.save_to_disk` writes a folder of Arrow IPC
stream files named in its `state.json`. Each comes out as rows (nested columns as
dicts and lists), in file and row order, each with where it came from
(`FILE, row N`), for `data.record_of` to check as it checks a JSONL line.
`file_kind` tells the files that `data.read_prompts` reads apart from the binary
ones it refuses.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["ACCEPTED_FORMATS", "file_kind", "table_rows"]

ACCEPTED_FORMATS = (
    "JSONL (one JSON object per line), Parquet (a .parquet file, or a folder of them) or a Hugging Face "
    "datasets folder (Dataset.save_to_disk)"
)
"""What a prompt file may be, as the refusals name it."""

_PARQUET_MAGIC = b"PAR1"

_BINARY_MAGIC = {
    b"\x1f\x8b": "gzip-compressed: decompress it first",
    b"PK\x03\x04": "a zip archive: extract it first",
    b"BZh": "bzip2-compressed: decompress it first",
    b"\x28\xb5\x2f\xfd": "zstd-compressed: decompress it first",
    b"\xfd7zXZ\x00": "xz-compressed: decompress it first",
    b"ARROW1": "an Arrow IPC file",
}
"""The starts of binary files a prompt file is often mistaken for, and what each is."""

_SNIFF_BYTES = 8192


def file_kind(path: Path) -> str:
    """`"parquet"`, `"text"` (read as JSONL), or what a binary file is (`"binary"`, `"gzip-compressed: ..."`)."""
    with path.open("rb") as f:
        head = f.read(_SNIFF_BYTES)
    if head.startswith(_PARQUET_MAGIC) or path.suffix == ".parquet":
        return "parquet"
    for magic, kind in _BINARY_MAGIC.items():
        if head.startswith(magic):
            return kind
    # A text file of any encoding holds no NUL byte (UTF-16 aside, which JSONL is not).
    return "binary" if b"\x00" in head else "text"


def table_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(origin, row) of every row of a Parquet file or a folder of tables (see the module docstring).

    ValueError naming the path for a folder that holds no tables, or the splits of a DatasetDict.
    """
    for file, table in _tables(path):
        for i, row in enumerate(table.to_pylist(), start=1):
            yield f"{file}, row {i}", row


def _tables(path: Path) -> Iterator[tuple[Path, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.is_file():
        yield path, _read(path, pq.read_table)
        return
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise ValueError(
            f"{path} holds the splits {', '.join(splits)} of a DatasetDict; point at one of them "
            f"({path / (splits[0] if splits else 'train')})"
        )
    if (path / "state.json").is_file():
        state = json.loads((path / "state.json").read_text())
        names = [f["filename"] for f in state.get("_data_files", [])] or sorted(
            p.name for p in path.glob("*.arrow")
        )
        for name in names:
            yield path / name, _read(path / name, _arrow_stream(pa))
        return
    parquet = sorted(path.glob("*.parquet"))
    if not parquet:
        raise ValueError(
            f"{path} holds no Parquet files and is no datasets folder (no state.json); give "
            f"{ACCEPTED_FORMATS}"
        )
    for file in parquet:
        yield file, _read(file, pq.read_table)


def _arrow_stream(pa: Any) -> Any:
    def read(path: Path) -> Any:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all()

    return read


def _read(path: Path, reader: Any) -> Any:
    try:
        return reader(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        problem = " ".join(str(exc).split())[:300]
        raise ValueError(
            f"{path} does not read as a table ({type(exc).__name__}: {problem}); give {ACCEPTED_FORMATS}"
        ) from None
