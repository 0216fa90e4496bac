"""The on-disk layout of a model's checkpoints and their crash-safe save protocol (no torch).

Layout of a checkpoint folder (`save` / `critic_save`)::

    iter_0000007/                      one complete checkpoint per saved rollout
    latest_checkpointed_iteration.txt  the rollout id of the newest complete one

A save writes every rank's shards into a staging folder `iter_X.partial`; only
when all ranks are done does rank 0 move it to `iter_X` and then replace the
marker (write a temporary file, fsync, `os.replace`). A crash at any point of a
save therefore leaves the marker on the previous complete checkpoint; a re-save
of the marker's own rollout moves the old folder aside (`iter_X.old`) first, and
a reader falls back to that folder if the crash hit between the two renames.

`save_folder` runs that protocol around any writer of the shards (`checkpoint`'s
Megatron `dist_checkpointing.save`); `complete_rollouts` and `incomplete_parts`
read a folder without changing it. Importing this module imports no torch, so the
driver checks a run's folders before anything heavy starts.
Each stage of a save is a `fault_points` point (`checkpoint.staged`,
`checkpoint.written`, `checkpoint.moved_aside`, `checkpoint.published`,
`checkpoint.marked`), where the tests kill the process.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.megatron.runtime.checkpoint_manifest import checkpoint_bytes, write_manifest
from tandem.megatron.runtime.fault_points import fault_point

logger = logging.getLogger(__name__)

MARKER = "latest_checkpointed_iteration.txt"
"""Name of the marker file (Megatron's own name, so its tools find our checkpoints)."""

_COMPLETE_FILE = "metadata.json"  # dist_checkpointing writes it last, after every shard


def iteration_dir(root: str | os.PathLike[str], rollout_id: int) -> Path:
    """The folder of rollout `rollout_id`'s checkpoint under `root`."""
    return Path(root) / f"iter_{rollout_id:07d}"


def _staging_dir(root: str | os.PathLike[str], rollout_id: int) -> Path:
    return iteration_dir(root, rollout_id).with_suffix(".partial")


def _aside_dir(root: str | os.PathLike[str], rollout_id: int) -> Path:
    return iteration_dir(root, rollout_id).with_suffix(".old")


def read_latest(root: str | os.PathLike[str] | None) -> int | None:
    """Rollout id of the newest complete checkpoint under `root`; None when there is none."""
    if root is None:
        return None
    marker = Path(root) / MARKER
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(f"checkpoint marker {marker} holds {text!r}, not a rollout id") from None


def latest_dir(root: str | os.PathLike[str] | None) -> tuple[int, Path] | None:
    """(rollout id, folder) of the newest complete checkpoint under `root`, or None."""
    rollout_id = read_latest(root)
    if rollout_id is None or root is None:
        return None
    for folder in (iteration_dir(root, rollout_id), _aside_dir(root, rollout_id)):
        if (folder / _COMPLETE_FILE).is_file():
            return rollout_id, folder
    raise RuntimeError(
        f"checkpoint marker in {root} names rollout {rollout_id} but {iteration_dir(root, rollout_id)} "
        "is missing or incomplete; the folder was changed by hand"
    )


def _is_complete(folder: Path) -> bool:
    return (folder / _COMPLETE_FILE).is_file()


def _rollout_of(name: str) -> int | None:
    """The rollout id of a folder named `iter_XXXXXXX` (with any suffix), else None."""
    stem = name.split(".", 1)[0]
    if not stem.startswith("iter_") or not stem[5:].isdigit():
        return None
    return int(stem[5:])


def complete_rollouts(root: str | os.PathLike[str] | None) -> dict[int, Path]:
    """The complete checkpoints under `root`, rollout id -> folder (read only; {} when there is none).

    A rollout's folder is `iter_X` when complete, else `iter_X.old` when that is complete
    (a re-save of X that crashed between its two renames).
    """
    if root is None or not Path(root).is_dir():
        return {}
    found: dict[int, Path] = {}
    for child in sorted(Path(root).iterdir()):
        rollout_id = _rollout_of(child.name)
        if rollout_id is None or child.suffix not in ("", ".old") or not _is_complete(child):
            continue
        if child.suffix == "" or rollout_id not in found:
            found[rollout_id] = child
    return found


def incomplete_parts(root: str | os.PathLike[str] | None) -> list[Path]:
    """Folders under `root` that a crashed save left and no load reads: staging (`.partial`)
    folders, incomplete `iter_X`, and `iter_X.old` beside a complete `iter_X`."""
    if root is None or not Path(root).is_dir():
        return []
    complete = complete_rollouts(root)
    parts = []
    for child in sorted(Path(root).iterdir()):
        rollout_id = _rollout_of(child.name)
        if rollout_id is None or not child.is_dir():
            continue
        if complete.get(rollout_id) != child:
            parts.append(child)
    return parts


def point_marker_at(root: str | os.PathLike[str], rollout_id: int | None) -> None:
    """Make `rollout_id` the newest checkpoint under `root` (None: remove the marker), atomically."""
    root = Path(root)
    if rollout_id is None:
        (root / MARKER).unlink(missing_ok=True)
        _fsync_dir(root)
        return
    if not _is_complete(iteration_dir(root, rollout_id)):
        raise RuntimeError(f"{iteration_dir(root, rollout_id)} is not a complete checkpoint")
    _write_marker(root, rollout_id)


def begin_save(root: str | os.PathLike[str], rollout_id: int) -> Path:
    """Create an empty staging folder for rollout `rollout_id` (rank 0 only) and return it."""
    staging = _staging_dir(root, rollout_id)
    if staging.exists():
        shutil.rmtree(staging)  # left by a save that crashed
    staging.mkdir(parents=True)
    return staging


def commit_save(root: str | os.PathLike[str], rollout_id: int) -> Path:
    """Publish the complete staging folder of `rollout_id` and point the marker at it (rank 0 only)."""
    staging, final, aside = (
        _staging_dir(root, rollout_id),
        iteration_dir(root, rollout_id),
        _aside_dir(root, rollout_id),
    )
    if not (staging / _COMPLETE_FILE).is_file():
        raise RuntimeError(f"{staging} is not a complete checkpoint (no {_COMPLETE_FILE})")
    if final.exists():
        # Re-saving a rollout: the marker may point at `final`; keep it readable as `aside`.
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
        fault_point("checkpoint.moved_aside", rollout_id=rollout_id)
    os.replace(staging, final)
    _fsync_dir(Path(root))
    fault_point("checkpoint.published", rollout_id=rollout_id)
    _write_marker(Path(root), rollout_id)
    fault_point("checkpoint.marked", rollout_id=rollout_id)
    if aside.exists():
        shutil.rmtree(aside)
    return final


def _write_marker(root: Path, rollout_id: int) -> None:
    tmp = root / f"{MARKER}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{rollout_id}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MARKER)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_folder(
    root: str | os.PathLike[str],
    rollout_id: int,
    write: Callable[[Path], None],
    *,
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """The save protocol around `write(staging)` (every rank calls it): stage, write, publish, mark.

    Rank 0 makes the staging folder, every rank's `write` fills it (the shards, then
    `metadata.json` last), and rank 0 records each file's size and checksum
    (`checkpoint_manifest.write_manifest`), publishes it and moves the marker (`commit_save`).
    `barrier` synchronises the ranks between those stages. Returns the published folder.
    """
    if rank == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        begin_save(root, rollout_id)
        fault_point("checkpoint.staged", rollout_id=rollout_id)
    barrier()
    try:
        fault_point("checkpoint.writing", rollout_id=rollout_id)
        write(_staging_dir(root, rollout_id))
    except Exception as exc:
        full = disk_full(exc, root, rollout_id)
        if full is None:
            raise
        raise full from exc
    barrier()
    if rank == 0:
        fault_point("checkpoint.written", rollout_id=rollout_id)
        write_manifest(_staging_dir(root, rollout_id))  # every rank's files are in: their sizes and checksums
        commit_save(root, rollout_id)
        logger.info("saved checkpoint of rollout %d to %s", rollout_id, iteration_dir(root, rollout_id))
    barrier()
    return iteration_dir(root, rollout_id)


# --- a full disk ---------------------------------------------------------------------------------

FULL_BELOW_BYTES = 16 << 20
"""Free space under which a failed write is taken for a full disk, whatever its error says (torch's
writer on a full disk raises `unexpected pos 704 vs 598`, with no errno)."""


class DiskFull(RuntimeError):
    """A save found no space left on its device; the message says where, what it needs and what is free."""

    def __init__(self, path: Path, needed: int, free: int, kept: int | None, *, estimate: bool) -> None:
        need = f"about {_size(needed)}" if estimate else f"more than the {_size(needed)} it had written"
        kept_text = (
            f"the last complete checkpoint (rollout {kept}) is kept"
            if kept is not None
            else "no checkpoint yet"
        )
        super().__init__(
            f"no space left on device at {path}: the save needs {need}, {_size(free)} free; {kept_text}; free "
            "some space, then the same command resumes the run"
        )
        self.path, self.needed, self.free, self.kept, self.estimate = path, needed, free, kept, estimate

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in a worker, it reaches the driver pickled (Ray): rebuilt from its fields, not its message.
        return _disk_full, (self.path, self.needed, self.free, self.kept, self.estimate)


def _disk_full(path: Path, needed: int, free: int, kept: int | None, estimate: bool) -> DiskFull:
    return DiskFull(path, needed, free, kept, estimate=estimate)


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _full_disk_error(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _bytes_under(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def disk_full(exc: BaseException, root: str | os.PathLike[str], rollout_id: int) -> DiskFull | None:
    """The `DiskFull` for a write of rollout `rollout_id`'s checkpoint under `root` that raised `exc`, when
    the disk is full (ENOSPC or EDQUOT in its chain, or less than `FULL_BELOW_BYTES` free): its staging
    folder is removed first, so that what it held is free again. None for any other failure."""
    root = Path(root)
    if not _full_disk_error(exc) and shutil.disk_usage(root).free >= FULL_BELOW_BYTES:
        return None
    staging = _staging_dir(root, rollout_id)
    written = _bytes_under(staging)
    shutil.rmtree(staging, ignore_errors=True)
    kept = read_latest(root)
    if kept is not None:
        return DiskFull(
            root,
            checkpoint_bytes(iteration_dir(root, kept)),
            shutil.disk_usage(root).free,
            kept,
            estimate=True,
        )
    return DiskFull(root, written, shutil.disk_usage(root).free, None, estimate=False)
