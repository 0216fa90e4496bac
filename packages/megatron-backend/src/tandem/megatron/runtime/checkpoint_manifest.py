"""What a complete checkpoint held when its save completed: each file's size and xxh3 checksum (no torch).

`write_manifest(folder)` writes `tandem_manifest.json` into a checkpoint's staging
folder once every rank has written its shards (`checkpoint_folder.save_folder`,
rank 0); `verify_checkpoint(folder)` says in words what makes a folder unreadable
(a file gone, of another size, of another checksum), before anything loads it:
the driver checks the checkpoint a run resumes from before Ray starts, so that a
shard truncated to 0 bytes is named, and set aside, instead of failing a worker's
load half a minute later with `EOFError: Ran out of input`.

The checksum is xxh3_64 (the `xxhash` package): it hashes at memory speed, about
2.5 GB/s on one core of a small CPU machine (crc32 1.6 GB/s, sha256 0.4 GB/s),
so the save pays one pass over the shards it has just written, mostly from the
page cache (0.4 s a GB there), and a resume one read of the checkpoint it loads,
at disk speed, which the workers' load then finds in the page cache. Sizes cost a
`stat` per file and are checked always. A checkpoint saved before manifests
existed gets the checks that need none: no empty file, a `metadata.json` that is JSON.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["CHECKSUM", "MANIFEST", "checkpoint_bytes", "verify_checkpoint", "write_manifest"]

MANIFEST = "tandem_manifest.json"
"""The manifest's file name, inside the checkpoint's folder."""

CHECKSUM = "xxh3_64"
"""The checksum recorded for each file."""

_CHUNK = 8 << 20


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _checksum(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_64()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Record every file of `folder` (size, checksum) in its manifest, written atomically; the manifest."""
    folder = Path(folder)
    start = time.perf_counter()
    files: dict[str, dict[str, Any]] = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, CHECKSUM: _checksum(p)} for p in _files(folder)
    }
    manifest = {
        "checksum": CHECKSUM,
        "files": files,
        "bytes": sum(int(f["size"]) for f in files.values()),
        "hash_seconds": round(time.perf_counter() - start, 4),
    }
    tmp = folder / f"{MANIFEST}.tmp"
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    return manifest


def _manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        return None  # a torn manifest is no record: the checks that need none apply
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def verify_checkpoint(folder: str | os.PathLike[str], *, checksums: bool = True) -> str | None:
    """What makes the checkpoint in `folder` unreadable, naming the file; None when it reads as saved.

    With a manifest: every file it lists is there with its recorded size, and, with `checksums`,
    its recorded checksum. Without one: no file is empty and metadata.json is JSON.
    """
    folder = Path(folder)
    manifest = _manifest(folder)
    if manifest is None:
        for path in _files(folder):
            if path.stat().st_size == 0:
                return f"{path} is 0 bytes"
        metadata = folder / "metadata.json"
        try:
            json.loads(metadata.read_text())
        except (OSError, ValueError) as exc:
            return f"{metadata} does not read as JSON ({type(exc).__name__})"
        return None
    for name, recorded in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing; it had {recorded['size']} bytes when its save completed"
        size = path.stat().st_size
        if size != recorded["size"]:
            return f"{path} is {size} bytes; it had {recorded['size']} when its save completed"
    if checksums and manifest.get("checksum") == CHECKSUM:
        for name, recorded in manifest["files"].items():
            found = _checksum(folder / name)
            if found != recorded[CHECKSUM]:
                return (
                    f"{folder / name}: its {CHECKSUM} checksum is {found}, not the one recorded when its save "
                    "completed"
                )
    return None


def checkpoint_bytes(folder: str | os.PathLike[str]) -> int:
    """The bytes of the checkpoint in `folder`: its manifest's total, else the sizes of its files."""
    manifest = _manifest(Path(folder))
    if manifest is not None and isinstance(manifest.get("bytes"), int):
        return int(manifest["bytes"])
    return sum(p.stat().st_size for p in _files(Path(folder)))
