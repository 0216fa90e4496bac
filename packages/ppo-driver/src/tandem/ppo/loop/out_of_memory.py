"""A step's out-of-memory error: telling it from others (`out_of_memory`) and what the driver adds to its
message (`out_of_memory_note`): the turn it struck, the memory plan's figures for that turn where a plan ran
it, and the flags that give the turn room. docs/design.md, "The memory plan".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.ppo.loop.memory_model import format_bytes
from tandem.ppo.loop.memory_plan import MemoryPlan
from tandem.ppo.loop.schedule import Turn

if TYPE_CHECKING:
    from tandem.ppo.loop.memory_figures import MemoryFigures

__all__ = ["LIGHTER", "out_of_memory", "out_of_memory_note"]


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is a GPU out-of-memory error, raised here or in a worker (Ray's `RayTaskError` keeps the
    worker's exception as its `cause`, and is of its class where it can be)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if type(e).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(e):
            return True
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return False


LIGHTER = (
    "or give each phase less to hold: --micro-batch-size (or --max-tokens-per-gpu with "
    "--use-dynamic-batch-size), --rollout-kv-cache-memory-fraction"
)


def out_of_memory_note(
    index: int,
    turn: Turn,
    *,
    plan: MemoryPlan | None,
    figures: MemoryFigures | None,
    memory_plan: str,
    offload_train: bool,
    measuring: bool | None = None,
) -> str:
    """What a step's out-of-memory error in turn `index` adds to the worker's message: the turn, the memory
    plan's figures for it where a plan ran it, and the flags that give the turn room. `memory_plan`: the flag's
    value; `measuring`: whether the run takes a plan once its first step has measured (None: where the flag
    is `fit`)."""
    if measuring is None:
        measuring = memory_plan == "fit"
    where = f"out of GPU memory in turn {index} of the step ({turn.describe()})"
    if plan is not None and figures is not None and index < len(plan.turns):
        planned = plan.turns[index]
        peak = max(planned.peaks.values(), default=0)
        asleep = ", ".join(f"{r}/{g}" for r, g in sorted(planned.asleep)) or "nothing"
        budget = figures.budget
        return (
            f"{where}, which the memory plan put at {format_bytes(peak)} with {asleep} asleep, of the "
            f"{format_bytes(budget.available)} it may fill ({format_bytes(budget.capacity)} less --memory-margin-gib "
            f"{budget.margin / 2**30:g}): the turn held more than the plan's figures, by more than the margin. "
            f"Raise --memory-margin-gib (the plan then sleeps more) or lower --gpu-memory-gib, {LIGHTER}; "
            "the figures and each plan: RUN_DIR/memory_plan.json"
        )
    if measuring and offload_train:
        return (
            f"{where}, in the memory plan's first step, which sleeps whole roles and measures "
            f"(--memory-plan {memory_plan}): the models do not fit even taking turns; {LIGHTER.removeprefix('or ')}"
        )
    if offload_train:
        return (
            f"{where}, each model asleep outside its turns (--offload-train): {LIGHTER.removeprefix('or ')}"
        )
    return (
        f"{where}, every model resident (--no-offload-train): --offload-train puts each to sleep outside "
        f"its turns, --memory-plan fit only what a turn needs room for, {LIGHTER}"
    )
