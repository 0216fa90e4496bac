"""A run's checkpoint is a step of the whole run: the driver's state and every model's checkpoint of one rollout.

A save of rollout k writes, in this order, the driver's state
(`RUN_DIR/driver/iter_k.json`: the data cursor, RNG, metrics), then each model's
checkpoint (`critic/iter_k`, then `actor/iter_k`, each atomic on its own:
`tandem.megatron.runtime.checkpoint_folder`). A crash (kill -9, a dead node) may stop it between
any two of those, so the parts can disagree: the critic at rollout 5, the actor at
rollout 3. Rollout k is *complete* when all of its parts are. A start resumes
from the newest complete rollout (`find_resume_point`, read only, before Ray
starts); once the run is under way, the parts that are newer or incomplete are
moved to `RUN_DIR/set_aside/<time>/` and named in one log line
(`set_aside`), never deleted, and each model's marker points at the resumed rollout.

Only this run's own folders are changed: the models' save folders and
`RUN_DIR/driver`. A `--load` folder of another run is read, never touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem.megatron.runtime.checkpoint_folder import (
    complete_rollouts,
    incomplete_parts,
    iteration_dir,
    point_marker_at,
)
from tandem.megatron.runtime.fault_points import fault_point
from tandem.ppo.run.state import DriverState, save_state, state_dir

__all__ = ["ModelFolders", "ResumePoint", "find_resume_point", "save_run_checkpoint", "set_aside"]

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
    """

    rollout_id: int | None
    complete: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    set_aside: tuple[Path, ...] = ()

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
    run_dir: str | os.PathLike[str], models: Sequence[ModelFolders], *, requested: int | None = None
) -> ResumePoint:
    """The newest rollout complete for every model and the driver state (or `requested`); read only.

    ValueError naming `--load-rollout-id` when `requested` is not complete for all, or
    `--load` / `--critic-load` when a folder of another run holds checkpoints that this
    run's driver state cannot continue.
    """
    run_dir = Path(run_dir)
    states, partial_states = _driver_states(run_dir)
    complete = {"driver": set(states)}
    for model in models:
        complete[model.role] = set(complete_rollouts(model.load))
    common = set.intersection(*complete.values())
    if requested is not None:
        if requested not in common:
            raise ValueError(
                f"--load-rollout-id: rollout {requested} is not complete for every model and the driver "
                f"state ({_describe(complete)}); pick one of {sorted(common) or 'none'}, or leave it unset"
            )
        rollout_id: int | None = requested
    else:
        rollout_id = max(common) if common else None
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
    return ResumePoint(rollout_id, frozen, tuple(dict.fromkeys(parts)))


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
        logger.warning(
            "resuming %s; set aside in %s (newer than that, or left incomplete by a crash): %s",
            "from the start" if point.rollout_id is None else f"after rollout {point.rollout_id}",
            target,
            ", ".join(sorted(moved)),
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


def save_run_checkpoint(
    run_dir: str | os.PathLike[str], state: DriverState, saves: Sequence[tuple[str, Callable[[], None]]]
) -> None:
    """Save rollout `state.rollout_id` of the whole run: the driver's state, then each model's save, in order.

    `saves`: (role, save) pairs; each `save()` writes that model's checkpoint atomically.
    A fault point follows each part (`run_save.driver_state`, `run_save.model` with `role`).
    """
    save_state(run_dir, state)
    fault_point("run_save.driver_state", rollout_id=state.rollout_id)
    for role, save in saves:
        save()
        fault_point("run_save.model", role=role, rollout_id=state.rollout_id)
