"""What one turn of the step touches and holds on its GPUs with some memory tags asleep: the memory plan's
arithmetic of a single turn (`memory_plan` holds the plans, their moves between turns and their check).

- `turn_needs`: the tags a turn touches, which no plan may sleep (a train touches its model's every tag, the
  actor's log-probs its weights alone, the engines their weights and KV cache, a weight sync the engines'
  memory and the actor's weights);
- `turn_peaks`: each set of GPUs' bytes at a turn with some tags asleep (`turn_parts` in words, each role's
  share), and `fit_refusal` / `turn_refusal`, why a turn does not fit a budget;
- `step_candidates` / `step_transient`: a train's optimizer state kept asleep through its passes and woken for
  each optimizer step alone (`memory_plan.PlannedTurn.at_step`), and what its train then holds;
- `role_idle`: whether a role's workers are free in a turn (a wake sent to them runs beside its work).

Pure: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from tandem.megatron.choices import memory_tag_kind
from tandem.ppo.loop.memory_model import STEP_KINDS, WEIGHT_TAGS, GpuBudget, MemoryModel, TagRef
from tandem.ppo.loop.schedule import Residents, Role, StepSchedule, residents_at_each_turn

__all__ = [
    "fit_refusal",
    "role_idle",
    "step_candidates",
    "step_transient",
    "turn_needs",
    "turn_parts",
    "turn_peaks",
    "turn_refusal",
    "walk_schedule",
]


def turn_needs(residents: Residents, memory: MemoryModel) -> frozenset[TagRef]:
    """The tags a turn touches: those of every role computing in it (the async loop's background generation
    included), the actor's weights alone for its log-probs, and the actor's weights for a weight sync."""
    turn = residents.turn
    roles = set(residents.computing)
    if turn.wake_before and turn.work is None:
        roles.add(turn.role)  # a lifecycle-only wake (a warm-up's engines): the role comes back whole
    needs = {(r, tag) for r in roles if r in memory.roles for tag in memory.roles[r].tags}
    if turn.role == "actor" and turn.work == "log_probs":
        needs = {(r, tag) for r, tag in needs if r != "actor" or memory_tag_kind(tag) in WEIGHT_TAGS}
    if turn.work == "weights" and "actor" in memory.roles:
        needs |= {("actor", tag) for tag in memory.roles["actor"].tags if memory_tag_kind(tag) in WEIGHT_TAGS}
    return frozenset(needs)


def _role_parts(
    schedule: StepSchedule,
    residents: Residents,
    asleep: frozenset[TagRef],
    memory: MemoryModel,
    *,
    handed_back: Role | None = None,
    cached: Collection[Role] = (),
    at_step: frozenset[TagRef] = frozenset(),
) -> list[tuple[str, Role, int, int, int, str]]:
    """Each role's part of `residents`' turn: (its GPUs, role, fixed bytes, bytes of its tags awake, bytes of
    its transient or kept cache, what that last figure is) (`turn_peaks`)."""
    parts = []
    for role, held in memory.roles.items():
        awake = sum(n for tag, n in held.tags.items() if (role, tag) not in asleep)
        extra, what = 0, ""
        woken = sum(memory.nbytes(ref) for ref in at_step if ref[0] == role)
        if role in cached:
            extra, what = memory.kept_cache(role), "its kept cache"
        elif role in residents.computing and role != handed_back and woken:
            extra, what = (
                step_transient(role, woken, memory),
                "its train (passes, or step with its state woken)",
            )
        elif role in residents.computing and role != handed_back:
            work = residents.turn.work if role == residents.turn.role else "start_next"
            extra, what = memory.transient(role, work), f"its {work} transient"
        parts.append((schedule.gpus(role), role, held.fixed, awake, extra, what))
    return parts


def step_transient(role: Role, woken: int, memory: MemoryModel) -> int:
    """What `role`'s train holds above its tags awake when `woken` bytes of its state wake for each optimizer step
    alone (`PlannedTurn.at_step`): the larger of its passes' transient and that state with its step's transient
    (`MemoryModel.train_splits`); ValueError naming the role when the model lacks its split."""
    split = memory.train_splits.get(role)
    if split is None:
        raise ValueError(
            f"train_splits: no figure for {role}'s passes and optimizer step apart; measure them in the first step"
        )
    return max(split.passes, woken + split.step)


def turn_peaks(
    schedule: StepSchedule,
    residents: Residents,
    asleep: frozenset[TagRef],
    memory: MemoryModel,
    *,
    handed_back: Role | None = None,
    cached: Collection[Role] = (),
    at_step: frozenset[TagRef] = frozenset(),
) -> dict[str, int]:
    """Each set of GPUs' bytes in `residents`' turn with `asleep` asleep: every role's fixed bytes and tags
    awake, and the transient of each role computing (but `handed_back`'s, whose cache went back); a role of
    `cached` holds its kept cache at every turn instead (`MemoryModel.kept_cache`: its transients fit in it).
    A train role with tags of `at_step` (asleep, woken for its optimizer steps alone) holds the larger of its
    passes' transient and those tags with its step's (`step_transient`)."""
    peaks: dict[str, int] = {}
    for gpus, _, fixed, awake, extra, _ in _role_parts(
        schedule, residents, asleep, memory, handed_back=handed_back, cached=cached, at_step=at_step
    ):
        peaks[gpus] = peaks.get(gpus, 0) + fixed + awake + extra
    return peaks


def turn_parts(
    schedule: StepSchedule,
    residents: Residents,
    asleep: frozenset[TagRef],
    memory: MemoryModel,
    *,
    cached: Collection[Role] = (),
    at_step: frozenset[TagRef] = frozenset(),
) -> dict[str, str]:
    """`turn_peaks`' sums in words, each set of GPUs': every role's fixed bytes (CUDA context), tags awake and
    transient (or kept cache), in GiB, as a refusal names them."""
    words: dict[str, list[str]] = {}
    for gpus, role, fixed, awake, extra, what in _role_parts(
        schedule, residents, asleep, memory, cached=cached, at_step=at_step
    ):
        said = f"{role}: fixed {fixed / 2**30:.2f} + tags awake {awake / 2**30:.2f}"
        if what:
            said += f" + {what} {extra / 2**30:.2f}"
        words.setdefault(gpus, []).append(said)
    return {gpus: "; ".join(said) for gpus, said in words.items()}


def step_candidates(residents: Residents, memory: MemoryModel, planned: Collection[Role]) -> list[TagRef]:
    """The tags a train turn may keep asleep through its passes and wake for its optimizer steps alone
    (`PlannedTurn.at_step`), in the order a plan takes them: its role's optimizer state (`STEP_KINDS`: the
    moments before the fp32 main parameters), the larger piece first; none where the turn is no train of a
    planned role, or the model lacks the role's `train_splits`."""
    role = residents.turn.role
    if residents.turn.work != "train" or role not in planned or role not in memory.train_splits:
        return []
    refs = [(role, tag) for tag in memory.roles[role].tags if memory_tag_kind(tag) in STEP_KINDS]
    return sorted(refs, key=lambda ref: (STEP_KINDS.index(memory_tag_kind(ref[1])), -memory.nbytes(ref), ref))


def walk_schedule(schedule: StepSchedule, memory: MemoryModel) -> list[tuple[Residents, frozenset[TagRef]]]:
    missing = sorted({t.role for t in schedule.turns} - set(memory.roles))
    if missing:
        raise ValueError(f"memory model: no figures for {missing}, which the schedule's turns use")
    steps = residents_at_each_turn(schedule)
    return [(r, turn_needs(r, memory)) for r in steps]


def fit_refusal(
    schedule: StepSchedule,
    index: int,
    peaks: Mapping[str, int],
    asleep: frozenset[TagRef],
    budget: GpuBudget,
    parts: Mapping[str, str] | None = None,
) -> str | None:
    """Why turn `index` does not fit `budget` with `asleep` asleep (its `peaks`; `parts`, `turn_parts`' words
    for them, name what each role holds), or None where every set of GPUs fits."""
    turn = schedule.turns[index]
    for gpus, peak in sorted(peaks.items()):
        if peak > budget.available:
            names = ", ".join(f"{r}/{g}" for r, g in sorted(asleep)) or "nothing"
            held = f" ({parts[gpus]}, GiB)" if parts and gpus in parts else ""
            return (
                f"turn {index} ({turn.describe()!r}, phase {turn.role}/{turn.work}) on the {gpus} GPUs needs "
                f"{peak} bytes ({peak / 2**30:.2f} GiB){held} with {names} asleep; {budget.available} bytes "
                f"({budget.available / 2**30:.2f} GiB) available: capacity {budget.capacity} less margin "
                f"{budget.margin}. Give the GPU more room (a larger capacity, a smaller margin) or the turn less "
                "to hold (smaller micro-batches, a shorter KV cache)"
            )
    return None


def turn_refusal(
    schedule: StepSchedule,
    index: int,
    residents: Residents,
    asleep: frozenset[TagRef],
    memory: MemoryModel,
    budget: GpuBudget,
    cached: Collection[Role] = (),
    at_step: frozenset[TagRef] = frozenset(),
) -> str | None:
    """`fit_refusal` of turn `index` (`residents`') with `asleep` asleep: its `turn_peaks`, and where one passes
    the budget the `turn_parts` that name what each role holds."""
    peaks = turn_peaks(schedule, residents, asleep, memory, cached=cached, at_step=at_step)
    if all(peak <= budget.available for peak in peaks.values()):
        return None
    parts = turn_parts(schedule, residents, asleep, memory, cached=cached, at_step=at_step)
    return fit_refusal(schedule, index, peaks, asleep, budget, parts)


def role_idle(role: Role, residents: Residents, needs: frozenset[TagRef]) -> bool:
    """Whether `role`'s workers are free in `residents`' turn: it computes nothing there and the turn touches
    none of its tags (a weight sync reads the actor's weights), so a wake sent to them runs beside the turn's
    work rather than queued with it."""
    return role not in residents.computing and not any(r == role for r, _ in needs)
