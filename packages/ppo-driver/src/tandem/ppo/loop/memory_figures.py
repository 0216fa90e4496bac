"""The memory plan's inputs, read off the run's own roles after its first step (`--memory-plan fit`).

`measure_memory` asks the train workers for each memory tag's bytes (`state_nbytes`, recorded
by their last train), their CUDA context (`gpu_memory`) and each phase's allocator peak
(`phase_peaks`: train, log-probs, weight export), a reward model's or a teacher's workers for
their weights (`weight_bytes`), context and forward peak (`phase_peak`), and takes the engines'
`memory_stats` as
`SharedGpus` kept them when they released their memory after the first rollout (their KV
cache built), and takes from the GPU's capacity what processes outside the run hold on it
(`foreign_bytes`). `planner` then plans each schedule the run takes once (`plan_memory`, the actor's
and the critic's tags), `write_plans` keeps the figures and every plan as JSON in the run
folder (`loop/step_plans.py` decides which steps take a plan), and after each step `replan_if_grown` plans again where a phase's peak grew (a step's
out-of-memory error is told apart and explained by `out_of_memory`). docs/design.md, "The memory plan".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, get_args

from tandem.megatron.choices import TRAIN_PARTS as WORKER_TRAIN_PARTS
from tandem.megatron.runtime.gpu_memory import CACHED, PART_SEPARATOR
from tandem.ppo.loop.memory_model import (
    GpuBudget,
    MemoryModel,
    RoleMemory,
    TrainSplit,
    fixed_from_gpu_memory,
)
from tandem.ppo.loop.memory_plan import MemoryPlan
from tandem.ppo.loop.memory_planner import plan_memory
from tandem.ppo.loop.schedule import TRAIN_ROLES, Role, StepSchedule, Turn, Work

if TYPE_CHECKING:
    from tandem.ppo.loop.shared_gpus import SharedGpus

__all__ = [
    "MemoryFigures",
    "Peaks",
    "adopt_plans",
    "measure_memory",
    "measure_phases",
    "measured_figures",
    "planned_roles",
    "planner",
    "read_peaks",
    "replan_if_grown",
    "use_figures",
    "write_plans",
]

logger = logging.getLogger(__name__)

PHASE_OF_WORKER: Mapping[str, tuple[Role | None, Work]] = {
    "train": (None, "train"),
    "log_probs": ("actor", "log_probs"),
    "weights": ("engine", "weights"),
}
"""A train worker's phase (`phase_peaks`' keys) as the (role, work) of the turn that takes it: its own
train and log-probs, and the actor's weight export during the engines' `weights` turn (the export's
buckets sit on the engines' GPU beside them, colocated)."""


TRAIN_PARTS: Mapping[str, str] = {
    f"train{PART_SEPARATOR}{part}": field
    for part, field in zip(WORKER_TRAIN_PARTS, ("passes", "step"), strict=True)
}
"""A train worker's parts of its `train` phase (`phase_peaks`' keys) as the fields of the role's `TrainSplit`."""


FORWARD_WORK: Mapping[Role, Work] = {"reward_model": "score", "teacher": "log_probs"}
"""The work of each forward-only role's turn (its workers' `phase_peak`)."""


class MemoryFigures:
    """What `measure_memory` read: the model, the budget and each train role's memory tags in order; and
    whether the plans bring wakes forward into the background of the turn before (`prefetch`,
    `--prefetch-wakes`)."""

    def __init__(
        self, model: MemoryModel, budget: GpuBudget, tags: dict[Role, list[str]], *, prefetch: bool = True
    ) -> None:
        self.model, self.budget, self.tags, self.prefetch = model, budget, tags, prefetch

    def tag_bytes(self) -> dict[tuple[Role, str], int]:
        """Each (role, tag)'s bytes."""
        return {ref: self.model.nbytes(ref) for ref in self.model.tags()}


def engine_memory(stats: Sequence[Mapping[str, float]]) -> RoleMemory:
    """The engines' figures from their `memory_stats`: on a GPU `RoleMemory.from_engine_stats`; on a CPU,
    where no allocator reports, their KV cache and kept sessions alone."""
    if all("allocated_gib" in s for s in stats):
        return RoleMemory.from_engine_stats(stats)
    kv = max(
        (round((s.get("kv_cache_gib", 0.0) + s.get("sessions_gib", 0.0)) * 2**30) for s in stats), default=0
    )
    return RoleMemory({"kv_cache": kv})


def measure_memory(
    gpus: SharedGpus,
    *,
    engine_stats: Sequence[Mapping[str, float]] | None,
    gpu_memory_gib: float | None,
    margin_gib: float,
) -> MemoryFigures:
    """The memory model of the run's roles on one GPU (each figure its largest rank's), the budget, the tags.

    `engine_stats`: the engines' `memory_stats` taken while their KV cache was built (None: ask them now).
    `gpu_memory_gib`: the capacity (None: the GPU's whole memory, as the engines report it); either way at
    most the GPU's memory less what processes outside the run hold on it (`foreign_bytes`), where known.
    """
    stats = list(engine_stats) if engine_stats is not None else gpus.engines.all("memory_stats")
    roles: dict[Role, RoleMemory] = {"engine": engine_memory(stats)}
    tags: dict[Role, list[str]] = {}
    phases, caches, splits = read_peaks(gpus)
    for group in gpus.models():
        role: Role = group.role
        tags[role] = list(group.run("memory_tags")[0])
        nbytes = group.run("state_nbytes")
        fixed = fixed_from_gpu_memory(group.run("gpu_memory"))
        held = RoleMemory.from_ranks(({t: r.get(t, 0) for t in tags[role]} for r in nbytes), fixed)
        roles[role] = replace(held, cache=caches.get(role, 0))
    for role, present in _forward_roles(gpus).items():
        weights = max(int(n) for n in present.group.run("weight_bytes"))
        roles[role] = RoleMemory({"weights": weights}, fixed_from_gpu_memory(present.group.run("gpu_memory")))
    # A phase no worker measured (a CPU run, the engines' own work) holds nothing above its tags.
    for role in roles:
        for work in get_args(Work):
            phases.setdefault((role, work), 0)
    totals = [s["total_gib"] for s in stats if "total_gib" in s]
    if gpu_memory_gib is None and not totals:
        raise ValueError(
            "--memory-plan: fit needs the GPU's memory, and the engines report none (a CPU run, or "
            "SGLang servers); give --gpu-memory-gib"
        )
    # What the run may use of the GPU: its whole memory less what processes outside the run hold there.
    foreign = foreign_bytes(gpus, stats)
    room = round(min(totals) * 2**30) - foreign if totals else None
    if room is not None and room <= 0:
        raise ValueError(
            f"--memory-plan fit: other processes hold {foreign / 2**30:.1f} GiB, the GPU's whole memory; "
            "free the GPU for the run"
        )
    if foreign:
        logger.info("memory plan: processes outside the run hold %.2f GiB of the GPU", foreign / 2**30)
    if gpu_memory_gib is None:
        assert room is not None
        capacity = room
    else:
        capacity = round(gpu_memory_gib * 2**30)
        if room is not None and capacity > room:
            logger.warning(
                "memory plan: --gpu-memory-gib %g is more than the %.1f GiB the run has of the GPU; planning "
                "for %.1f GiB",
                gpu_memory_gib,
                room / 2**30,
                room / 2**30,
            )
            capacity = room
    margin = round(margin_gib * 2**30)
    if margin >= capacity:
        raise ValueError(
            f"--memory-margin-gib: {margin_gib:g} GiB leaves nothing of the GPU's {capacity / 2**30:.1f} GiB; "
            "give a smaller margin"
        )
    return MemoryFigures(MemoryModel(roles, phases, splits), GpuBudget(capacity, margin), tags)


def run_pids(gpus: SharedGpus, engine_stats: Sequence[Mapping[str, float]]) -> list[int] | None:
    """The pids of the run's processes on the GPUs: the engines' (`memory_stats`), every train and forward
    worker's (`gpu_memory`); None where one of them reports none (a CPU engine, SGLang servers)."""
    pids = []
    for stats in engine_stats:
        if "pid" not in stats:
            return None
        pids.append(int(stats["pid"]))
    groups = [*gpus.models(), *(present.group for present in _forward_roles(gpus).values())]
    for group in groups:
        for report in group.run("gpu_memory"):
            if report.get("pid") is None:
                return None
            pids.append(int(report["pid"]))
    return pids


def foreign_bytes(gpus: SharedGpus, engine_stats: Sequence[Mapping[str, float]]) -> int:
    """The most memory that processes outside the run hold on one of its GPUs, as its train workers see it
    (`foreign_gpu_bytes`): the plan's capacity less it; 0 where nothing can tell (a CPU run, a container's
    pid namespace, engines that report no pid)."""
    pids = run_pids(gpus, engine_stats)
    if pids is None:
        return 0
    answers = [n for group in gpus.models() for n in group.run("foreign_gpu_bytes", pids) if n is not None]
    return max(answers, default=0)


def _forward_roles(gpus: SharedGpus) -> dict[Role, Any]:
    present: dict[Role, Any] = {"reward_model": gpus.reward_model, "teacher": gpus.teacher}
    return {role: r for role, r in present.items() if r is not None}


def measure_phases(gpus: SharedGpus) -> dict[tuple[Role, Work], int]:
    """Each measured phase's allocator peak above what was allocated as it began (`read_peaks`)."""
    return read_peaks(gpus).phases


class Peaks(NamedTuple):
    """`read_peaks`' figures."""

    phases: dict[tuple[Role, Work], int]
    """Each measured phase's allocator peak above what was allocated as it began."""
    caches: dict[Role, int]
    """Each train role's bytes its allocator kept cached after a phase."""
    splits: dict[Role, TrainSplit]
    """Each train role's train in its passes' and its optimizer steps' parts, where its workers measured them."""


def read_peaks(gpus: SharedGpus) -> Peaks:
    """The phases' peaks, the train roles' kept caches and their trains' splits, the largest rank's and the
    largest so far: the train workers' `phase_peaks()` (one call a role; `train/passes` and
    `train/optimizer_step` the split) and a reward model's or a teacher's `phase_peak()` (nothing on a CPU)."""
    phases: dict[tuple[Role, Work], int] = {}
    caches: dict[Role, int] = {}
    parts: dict[Role, dict[str, int]] = {}
    for group in gpus.models():
        for per_rank in group.run("phase_peaks"):
            for phase, peak in per_rank.items():
                if phase == CACHED:
                    caches[group.role] = max(caches.get(group.role, 0), int(peak))
                    continue
                if phase in TRAIN_PARTS:
                    mine = parts.setdefault(group.role, {})
                    mine[TRAIN_PARTS[phase]] = max(mine.get(TRAIN_PARTS[phase], 0), int(peak))
                    continue
                owner, work = PHASE_OF_WORKER[phase]
                key: tuple[Role, Work] = (owner or group.role, work)
                phases[key] = max(phases.get(key, 0), int(peak))
    for role, present in _forward_roles(gpus).items():
        peaks = [p for p in present.group.run("phase_peak") if p is not None]
        if peaks:
            phases[(role, FORWARD_WORK[role])] = max(int(p) for p in peaks)
    splits = {
        role: TrainSplit(p["passes"], p["step"]) for role, p in parts.items() if set(p) == {"passes", "step"}
    }
    return Peaks(phases, caches, splits)


def planned_roles(schedule: StepSchedule) -> frozenset[Role]:
    """The roles whose tags a run's plan of `schedule` chooses: the actor's and the critic's, and on shared
    GPUs the engines' (the turns move them in order there; on GPUs of their own the async loop's rollout,
    drawn on another thread, keeps them as the schedule has them)."""
    return TRAIN_ROLES | {"engine"} if schedule.colocated else TRAIN_ROLES


def planner(
    figures: MemoryFigures, record: Callable[[StepSchedule, MemoryPlan], None]
) -> Callable[[StepSchedule], MemoryPlan]:
    """Each schedule's plan of the actor's and the critic's tags, and on shared GPUs the engines'
    (`planned_roles`), made once (`record` told of it); PlanError with the numbers for a schedule that does
    not fit, before its step moves anything."""
    plans: dict[StepSchedule, MemoryPlan] = {}

    def plan_of(schedule: StepSchedule) -> MemoryPlan:
        if schedule not in plans:
            planned = planned_roles(schedule)
            plans[schedule] = plan_memory(
                schedule, figures.model, figures.budget, planned_roles=planned, prefetch=figures.prefetch
            )
            record(schedule, plans[schedule])
        return plans[schedule]

    return plan_of


def write_plans(path: Path, figures: MemoryFigures, plans: Mapping[str, MemoryPlan]) -> None:
    """The figures and every plan so far as JSON at `path`: {"model", "budget", "tags", "schedules": {schedule:
    its turns as data, `schedule_from_dict`'s}, "plans": {schedule: turns}}; a turn's "moves_at_once" says
    whether entering it moves two roles' tags at once, "handover_peaks" what each set of GPUs holds then,
    "prefetch" what wakes in its background for the next turn, "at_step" what of its train role's state stays
    asleep through the passes and wakes for each optimizer step alone;
    "caches_kept": {schedule: the train roles that keep their allocator's cache (`MemoryPlan.keeps_cache`)}."""
    data: dict[str, Any] = {
        "model": figures.model.to_dict(),
        "budget": {"capacity": figures.budget.capacity, "margin": figures.budget.margin},
        "tags": figures.tags,
        "schedules": {described: schedule_to_dict(plan.schedule) for described, plan in plans.items()},
        "plans": {
            described: [
                {
                    "turn": t.turn.describe(),
                    "asleep": sorted(f"{r}/{g}" for r, g in t.asleep),
                    "peaks": dict(t.peaks),
                    "moves_at_once": plan.together(index),
                    "handover_peaks": dict(t.handover),
                    "prefetch": sorted(f"{r}/{g}" for r, g in t.prefetch),
                    "at_step": sorted(f"{r}/{g}" for r, g in t.at_step),
                }
                for index, t in enumerate(plan.turns)
            ]
            for described, plan in plans.items()
        },
        "caches_kept": {described: sorted(plan.keeps_cache) for described, plan in plans.items()},
        "prefetch_wakes": figures.prefetch,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def adopt_plans(gpus: SharedGpus, config: Any, run_dir: Path) -> MemoryFigures:
    """Measure the run's memory (`measure_memory`) and have `gpus` take each step's plan from it; every plan
    is logged once and kept with the figures in RUN_DIR/memory_plan.json."""
    figures = measured_figures(gpus, config)
    use_figures(gpus, figures, run_dir)
    return figures


def measured_figures(gpus: SharedGpus, config: Any) -> MemoryFigures:
    """`measure_memory` with the run's flags (capacity, margin, background wakes)."""
    figures = measure_memory(
        gpus,
        engine_stats=gpus.engine_stats,
        gpu_memory_gib=config.gpu_memory_gib,
        margin_gib=config.memory_margin_gib,
    )
    figures.prefetch = config.prefetch_wakes
    return figures


def replan_if_grown(gpus: SharedGpus, figures: MemoryFigures, run_dir: Path) -> MemoryFigures:
    """After a step: where a phase's allocator peak grew past its figure (a longer rollout, a larger packed
    micro-batch), the figures with the new peaks and every schedule planned again from them, said once in
    the log; `figures` as they are otherwise. The next step's plan, checked before it moves anything, then
    counts what this step needed."""
    phases, caches, splits = read_peaks(gpus)
    roles = figures.model.roles
    grown = {k: v for k, v in phases.items() if v > figures.model.phases.get(k, 0)}
    grown_caches = {r: v for r, v in caches.items() if r in roles and v > roles[r].cache}
    known = figures.model.train_splits
    grown_splits = {
        r: TrainSplit(max(s.passes, known[r].passes), max(s.step, known[r].step)) if r in known else s
        for r, s in splits.items()
        if r not in known or s.passes > known[r].passes or s.step > known[r].step
    }
    if not grown and not grown_caches and not grown_splits:
        return figures
    said = ", ".join(
        [
            f"{role}/{work} {figures.model.phases.get((role, work), 0) / 2**30:.2f} -> {v / 2**30:.2f} GiB"
            for (role, work), v in sorted(grown.items())
        ]
        + [
            f"{r}'s cache {roles[r].cache / 2**30:.2f} -> {v / 2**30:.2f} GiB"
            for r, v in sorted(grown_caches.items())
        ]
        + [
            f"{r}'s train passes/step {s.passes / 2**30:.2f}/{s.step / 2**30:.2f} GiB"
            for r, s in sorted(grown_splits.items())
        ]
    )
    logger.info("memory plan: phase peaks grew (%s); planning again", said)
    roles = {r: replace(m, cache=grown_caches.get(r, m.cache)) for r, m in roles.items()}
    model = MemoryModel(roles, {**figures.model.phases, **grown}, {**known, **grown_splits})
    figures = MemoryFigures(model, figures.budget, figures.tags, prefetch=figures.prefetch)
    use_figures(gpus, figures, run_dir)
    return figures


def use_figures(gpus: SharedGpus, figures: MemoryFigures, run_dir: Path) -> None:
    """`gpus` takes each schedule's plan from `figures` from its next step on (`planner`), each plan logged
    once and kept with the figures in RUN_DIR/memory_plan.json."""
    made: dict[str, MemoryPlan] = {}

    def record(schedule: StepSchedule, plan: MemoryPlan) -> None:
        made[schedule.describe()] = plan
        moved = ", ".join(f"{r}/{t}" for r, t in sorted(plan.moved())) or "nothing"
        logger.info("memory plan for %s: moves %s\n%s", schedule.describe(), moved, plan.describe())
        write_plans(run_dir / "memory_plan.json", figures, made)

    tags = {**figures.tags, "engine": list(figures.model.roles["engine"].tags)}
    gpus.use_plans(planner(figures, record), tags, figures.tag_bytes())


def schedule_to_dict(schedule: StepSchedule) -> dict[str, Any]:
    """A schedule as JSON-ready data: {"colocated": bool, "turns": [[role, work, wake_before, sleep_after]]}."""
    turns = [[t.role, t.work, t.wake_before, t.sleep_after] for t in schedule.turns]
    return {"colocated": schedule.colocated, "turns": turns}


def schedule_from_dict(data: Mapping[str, Any]) -> StepSchedule:
    """The schedule `schedule_to_dict` wrote."""
    turns = tuple(Turn(role, work, bool(wake), bool(sleep)) for role, work, wake, sleep in data["turns"])
    return StepSchedule(turns, colocated=bool(data["colocated"]))
