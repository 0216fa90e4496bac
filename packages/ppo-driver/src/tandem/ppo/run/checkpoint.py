"""A run's checkpoint is a step of the whole run: the driver's state and every model's checkpoint of one rollout.

A save of rollout k writes, in this order, the driver's state
(`RUN_DIR/driver/iter_k.json`: the data cursor, RNG, metrics), then each model's
checkpoint (`critic/iter_k`, then `actor/iter_k`, each atomic on its own:
`tandem.megatron.runtime.checkpoint_folder`). A crash (kill -9, a dead node) may stop it between
any two of those, so the parts can disagree: the critic at rollout 5, the actor at
rollout 3. Rollout k is *complete* when all of its parts are. A start resumes
from the newest complete rollout whose parts read (each file of the size and
checksum its save recorded, a driver state that is JSON: `find_resume_point`, read
only, before Ray starts); once the run is under way, the parts that are newer,
incomplete or unreadable are moved to `RUN_DIR/set_aside/<time>/` and named in one
log line with what does not read (`set_aside`), never deleted, and each model's
marker points at the resumed rollout.

Only this run's own folders are changed: the models' save folders and
`RUN_DIR/driver`. A `--load` folder of another run is read, never touched.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem.megatron.runtime.checkpoint_folder import (
    DiskFull,
    complete_rollouts,
    incomplete_parts,
    iteration_dir,
    point_marker_at,
)
from tandem.megatron.runtime.checkpoint_manifest import checkpoint_bytes, verify_checkpoint
from tandem.megatron.runtime.fault_points import fault_point
from tandem.ppo.run.state import DriverState, save_state, state_dir

__all__ = [
    "ModelFolders",
    "ResumePoint",
    "check_free_space",
    "find_resume_point",
    "prune_checkpoints",
    "save_run_checkpoint",
    "set_aside",
]

# The name its lines show on the terminal, kept from before the layers.
logger = logging.getLogger("tandem.ppo.run_checkpoint")

SET_ASIDE_DIR = "set_aside"
"""Folder of RUN_DIR where parts of checkpoints that no resume uses are moved."""


@dataclass(frozen=True)
class ModelFolders:
    """Where one model resumes from and saves to."""

    role: str
    load: Path | None
    """Its load folder (`--load` / `--critic-load`, by default its save folder); None: none."""
    save: Path | None
    """Its save folder (this run's: parts there may be set aside)."""

    @property
    def own(self) -> bool:
        """Whether it loads from its own save folder (the run resumes itself)."""
        return self.load is not None and self.save is not None and _same(self.load, self.save)


@dataclass(frozen=True)
class ResumePoint:
    """Where a start resumes: the newest rollout that every part completed, and what no load uses.

    Attributes:
        rollout_id: the rollout to resume after; None: start from the Hugging Face weights.
        complete: each part's complete rollouts (`actor`, `critic`, `driver`).
        set_aside: parts in this run's folders that are newer than `rollout_id` or incomplete.
        unreadable: complete parts newer than `rollout_id` that do not read, and why (a file of
            another size or checksum than its save recorded, a driver state that is not JSON).
    """

    rollout_id: int | None
    complete: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    set_aside: tuple[Path, ...] = ()
    unreadable: Mapping[Path, str] = field(default_factory=dict)

    @property
    def next_rollout_id(self) -> int:
        """The first rollout the start trains."""
        return 0 if self.rollout_id is None else self.rollout_id + 1


def _same(a: Path, b: Path) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _driver_states(run_dir: Path) -> tuple[dict[int, Path], list[Path]]:
    """Complete driver states (rollout -> file) and incomplete ones (temporary files of a crashed write)."""
    folder = state_dir(run_dir)
    complete: dict[int, Path] = {}
    partial: list[Path] = []
    if not folder.is_dir():
        return complete, partial
    for child in sorted(folder.iterdir()):
        stem = child.name.split(".", 1)[0]
        if not child.is_file() or not stem.startswith("iter_") or not stem[5:].isdigit():
            continue
        if child.name == f"{stem}.json":
            complete[int(stem[5:])] = child
        else:
            partial.append(child)
    return complete, partial


def find_resume_point(
    run_dir: str | os.PathLike[str],
    models: Sequence[ModelFolders],
    *,
    requested: int | None = None,
    checksums: bool = True,
) -> ResumePoint:
    """The newest rollout complete for every model and the driver state, whose every part reads (or
    `requested`); read only.

    A part reads when its files have the sizes (and, with `checksums`, the checksums) that its
    save recorded (`checkpoint_manifest.verify_checkpoint`) and a driver state is JSON; rollouts
    are tried from the newest down, and the ones that do not read are kept in `unreadable`.
    ValueError naming `--load-rollout-id` when `requested` is not complete for all or does not
    read (with the rollout that would), `--run-dir` when complete rollouts exist but none reads
    (naming each file), or `--load` / `--critic-load` when a folder of another run holds
    checkpoints that this run's driver state cannot continue.
    """
    run_dir = Path(run_dir)
    states, partial_states = _driver_states(run_dir)
    complete = {"driver": set(states)}
    folders = {model.role: complete_rollouts(model.load) for model in models}
    for model in models:
        complete[model.role] = set(folders[model.role])
    common = set.intersection(*complete.values())
    problems: dict[int, tuple[Path, str]] = {}

    def reads(k: int) -> bool:
        # The driver's state, then every model's sizes (a stat per file), then their checksums.
        checks = [(states[k], lambda: _state_problem(states[k]))]
        checks += [
            (folders[r][k], functools.partial(verify_checkpoint, folders[r][k], checksums=False))
            for r in folders
        ]
        if checksums:
            checks += [(folders[r][k], functools.partial(verify_checkpoint, folders[r][k])) for r in folders]
        for path, check in checks:
            problem = check()
            if problem is not None:
                problems[k] = (path, problem)
                return False
        return True

    def newest_that_reads(candidates: set[int]) -> int | None:
        return next((k for k in sorted(candidates, reverse=True) if reads(k)), None)

    if requested is not None:
        if requested not in common:
            raise ValueError(
                f"--load-rollout-id: rollout {requested} is not complete for every model and the driver "
                f"state ({_describe(complete)}); pick one of {sorted(common) or 'none'}, or leave it unset"
            )
        if not reads(requested):
            working = newest_that_reads(common - {requested})
            instead = (
                f"--load-rollout-id {working} would work (the newest that reads), or leave it unset to resume "
                "from there"
                if working is not None
                else "no other rollout reads either: restore that file"
            )
            raise ValueError(
                f"--load-rollout-id: rollout {requested} does not read ({problems[requested][1]}); {instead}"
            )
        rollout_id: int | None = requested
    else:
        rollout_id = newest_that_reads(common)
        if rollout_id is None and problems:
            listed = "; ".join(f"rollout {k}: {problem}" for k, (_, problem) in sorted(problems.items()))
            raise ValueError(
                f"--run-dir: no checkpoint in {run_dir} reads, so no --load-rollout-id would work: {listed}; "
                "restore those files, or move the checkpoints away (or give another --run-dir) to start from "
                "the Hugging Face weights"
            )
    for model in models:
        if not model.own and complete[model.role] and rollout_id is None:
            flag = "--critic-load" if model.role == "critic" else "--load"
            raise ValueError(
                f"{flag}: {model.load} holds checkpoints of rollouts {sorted(complete[model.role])}, but "
                f"no rollout is complete for every model and the driver state in {run_dir} "
                f"({_describe(complete)}); resume with the --run-dir of the run that wrote it"
            )
    newer = (lambda k: True) if rollout_id is None else (lambda k: k > rollout_id)
    parts: list[Path] = [p for k, p in states.items() if newer(k)] + partial_states
    for model in models:
        if model.save is None:
            continue
        parts += [p for k, p in complete_rollouts(model.save).items() if newer(k)]
        parts += incomplete_parts(model.save)
    frozen = {k: tuple(sorted(v)) for k, v in complete.items()}
    unreadable = dict(problems.values())
    return ResumePoint(rollout_id, frozen, tuple(dict.fromkeys(parts)), unreadable)


def _state_problem(path: Path) -> str | None:
    """Why the driver state at `path` does not read (None: it does)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"{path} does not read as the driver's state (not JSON: {exc})"
    if not isinstance(state, dict) or not {"rollout_id", "data"} <= state.keys():
        return f"{path} does not read as the driver's state (no rollout_id and data)"
    return None


def _describe(complete: Mapping[str, set[int]]) -> str:
    def newest(v: set[int]) -> str:
        return f"up to rollout {max(v)}" if v else "none"

    return ", ".join(f"{part}: {newest(v)}" for part, v in complete.items())


def set_aside(
    run_dir: str | os.PathLike[str], point: ResumePoint, models: Sequence[ModelFolders]
) -> Path | None:
    """Move `point.set_aside` to `RUN_DIR/set_aside/<time>/`, point each own model's marker at the resumed
    rollout (its newest remaining checkpoint), and say so in one log line; the folder the parts went
    to (None: nothing to move)."""
    run_dir = Path(run_dir)
    if point.set_aside:
        target = run_dir / SET_ASIDE_DIR / time.strftime("%Y%m%dT%H%M%S")
        suffix = 0
        while target.exists():
            suffix += 1
            target = target.with_name(f"{target.name.split('-')[0]}-{suffix}")
        moved = []
        for part in point.set_aside:
            label = _label(run_dir, part, models)
            dest = target / label / part.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(part, dest)
            moved.append(f"{label}/{part.name}")
        unreadable = "".join(f"; does not read: {problem}" for problem in point.unreadable.values())
        logger.warning(
            "resuming %s; set aside in %s (newer than that, left incomplete by a crash, or not readable): %s%s",
            "from the start" if point.rollout_id is None else f"after rollout {point.rollout_id}",
            target,
            ", ".join(sorted(moved)),
            unreadable,
        )
    else:
        target = None
    for model in models:
        if model.save is None or not model.save.is_dir():
            continue
        # A rollout complete only as `iter_X.old` (a re-save that crashed between renames) is renamed back.
        for rollout_id, folder in complete_rollouts(model.save).items():
            if folder.suffix == ".old":
                os.replace(folder, iteration_dir(model.save, rollout_id))
        remaining = complete_rollouts(model.save)
        point_marker_at(model.save, max(remaining) if remaining else None)
    return target


def _label(run_dir: Path, part: Path, models: Sequence[ModelFolders]) -> str:
    if part.parent == state_dir(run_dir):
        return "driver"
    for model in models:
        if model.save is not None and _same(part.parent, model.save):
            return model.role
    return part.parent.name


def check_free_space(folders: Sequence[Path]) -> None:
    """Before a save: each device holding `folders` (the models' save folders, the driver's states) has
    room for a checkpoint as large as each folder's latest (nothing is known before the first save);
    `DiskFull` naming the first folder of a device that has not, before anything is written."""
    needs: dict[int, list[tuple[Path, int, int | None]]] = {}
    for folder in folders:
        if not folder.is_dir():
            continue
        saved = complete_rollouts(folder)
        if saved:
            kept = max(saved)
            size = checkpoint_bytes(saved[kept])
        else:
            states = _driver_states(folder.parent)[0] if folder == state_dir(folder.parent) else {}
            if not states:
                continue
            kept = max(states)
            size = states[kept].stat().st_size
        needs.setdefault(os.stat(folder).st_dev, []).append((folder, size, kept))
    for entries in needs.values():
        needed = sum(size for _, size, _ in entries)
        free = shutil.disk_usage(entries[0][0]).free
        if free < needed:
            raise DiskFull(entries[0][0], needed, free, entries[0][2], estimate=True)


def prune_checkpoints(
    run_dir: str | os.PathLike[str], models: Sequence[ModelFolders], *, keep: int | None
) -> list[Path]:
    """After a save: remove the run's complete rollouts older than its newest `keep` (every part: the models'
    checkpoints in this run's save folders, the driver's states), in one log line; what was removed.

    `keep` None: nothing. A load folder of another run is never touched, nor a part a crash left.
    """
    if keep is None:
        return []
    run_dir = Path(run_dir)
    states = _driver_states(run_dir)[0]
    saved = {m.role: complete_rollouts(m.save) for m in models if m.save is not None}
    complete = set(states).intersection(*(set(v) for v in saved.values()))
    if len(complete) <= keep:
        return []
    cutoff = sorted(complete)[-keep]
    removed = [p for k, p in states.items() if k < cutoff]
    removed += [p for folders in saved.values() for k, p in folders.items() if k < cutoff]
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if removed:
        logger.info("removed the checkpoints of the rollouts before %d (--keep-checkpoints %d)", cutoff, keep)
    return removed


def save_run_checkpoint(
    run_dir: str | os.PathLike[str], state: DriverState, saves: Sequence[tuple[str, Callable[[], None]]]
) -> None:
    """Save rollout `state.rollout_id` of the whole run: the driver's state, then each model's save, in order.

    `saves`: (role, save) pairs; each `save()` writes that model's checkpoint atomically.
    A fault point follows each part (`run_save.driver_state`, `run_save.model` with `role`).
    """
    try:
        save_state(run_dir, state)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        states, partial = _driver_states(Path(run_dir))
        for path in partial:  # the half-written state: its space is free again
            path.unlink(missing_ok=True)
        needed = len(json.dumps(dataclasses.asdict(state)).encode())
        folder = state_dir(run_dir)
        raise DiskFull(
            folder, needed, shutil.disk_usage(folder).free, max(states, default=None), estimate=True
        ) from exc
    fault_point("run_save.driver_state", rollout_id=state.rollout_id)
    for role, save in saves:
        save()
        fault_point("run_save.model", role=role, rollout_id=state.rollout_id)
