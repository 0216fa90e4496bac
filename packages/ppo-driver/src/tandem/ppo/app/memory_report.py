"""`ppo-driver memory-plan RUN_DIR`: what a run's memory plan moves, on its GPU or on another.

A run with `--memory-plan fit` keeps the figures it measured and the schedules it planned in
`RUN_DIR/memory_plan.json`. This command plans those schedules again for the capacity and margin
given (by default the run's own), without Ray or torch, and prints for each schedule its turns
(what is asleep at each, and its peak), the GiB a step moves, and the range of GPU memory the plan
can use: the least with which it fits (every tag of the actor and the critic that a turn does not
touch asleep) and the most it can use (none of them asleep: from there on they stay resident). A
capacity below the least is refused with the turn and its numbers (exit 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import tyro

from tandem.ppo.loop.memory_figures import planned_roles, schedule_from_dict
from tandem.ppo.loop.memory_model import GpuBudget, MemoryModel, format_bytes
from tandem.ppo.loop.memory_plan import MemoryPlan, capacity_range
from tandem.ppo.loop.memory_planner import plan_memory

__all__ = ["MemoryPlanArgs", "memory_report"]

GIB = 2**30


@dataclass(frozen=True)
class MemoryPlanArgs:
    """Options of `ppo-driver memory-plan`."""

    run_dir: Annotated[str, tyro.conf.Positional]
    """A run of `--memory-plan fit` (its memory_plan.json, written once its first step measured)."""
    gpu_memory_gib: float | None = None
    """The GPU memory to plan for, in GiB; None: the run's own (its --gpu-memory-gib, else its GPU's)."""
    memory_margin_gib: float | None = None
    """GiB kept free of the figures; None: the run's own --memory-margin-gib."""


def memory_report(args: MemoryPlanArgs) -> str:
    """The report's text; ValueError naming the file or the flag where it cannot be made."""
    path = Path(args.run_dir) / "memory_plan.json"
    if not path.is_file():
        raise ValueError(
            f"{path}: no such file; a run writes it with --memory-plan fit once its first step has measured "
            "the memory (RUN_DIR is such a run's folder)"
        )
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        model = MemoryModel.from_dict(data["model"])
        schedules = [schedule_from_dict(s) for s in data["schedules"].values()]
        capacity = (
            data["budget"]["capacity"] if args.gpu_memory_gib is None else round(args.gpu_memory_gib * GIB)
        )
        margin = (
            data["budget"]["margin"]
            if args.memory_margin_gib is None
            else round(args.memory_margin_gib * GIB)
        )
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{path}: not a memory plan this version reads ({exc!r}); run the first step again"
        ) from None
    if margin >= capacity or capacity <= 0:
        raise ValueError(
            f"--memory-margin-gib: {format_bytes(margin)} leaves nothing of {format_bytes(capacity)}; give a "
            "larger --gpu-memory-gib or a smaller margin"
        )
    budget = GpuBudget(capacity, margin)
    lines = [f"{path}: planned for {format_bytes(capacity)} less a margin of {format_bytes(margin)}"]
    for schedule in schedules:
        roles = planned_roles(schedule)
        least, most = capacity_range(schedule, model, planned_roles=roles)
        lines += ["", schedule.describe()]
        plan = plan_memory(  # PlanError with the numbers
            schedule, model, budget, planned_roles=roles, prefetch=bool(data.get("prefetch_wakes", False))
        )
        lines += [f"  {line}" for line in plan.describe().splitlines()]
        moved = f"  moves {format_bytes(_moved(plan, model))} a step"
        woken = sum(model.nbytes(ref) for t in plan.turns for ref in t.at_step)
        if woken:
            moved += (
                f", and {format_bytes(woken)} each way for each optimizer step of the trains that wake it"
            )
        lines.append(moved)
        lines.append(
            f"  fits from {format_bytes(least + margin)}; from {format_bytes(most + margin)} "
            f"{'the actor, the critic and the engines' if 'engine' in roles else 'the actor and the critic'} "
            "stay resident"
        )
    return "\n".join(lines)


def _moved(plan: MemoryPlan, model: MemoryModel) -> int:
    """Bytes the planned roles' tags move in a step of `plan` once it repeats (sleeps and wakes)."""
    return sum(
        model.nbytes(ref)
        for index in range(len(plan.turns))
        for ref in set().union(*plan.moves(index))
        if plan.planned_roles is None or ref[0] in plan.planned_roles
    )
