"""The memory side of a train worker: some of its tags asleep, each phase's allocator peak, the state's bytes.

A memory plan (tandem.ppo.loop.memory_plan) puts only some of a role's memory tags to
sleep at each turn of the PPO step: the actor's optimizer state while its weights stay
for the log-probs, say. `WorkerMemory` runs those sleeps and wakes over the model's
`Lifecycle`, with the process groups down only while every tag is; it keeps, per work
of the worker (`train`, `log_probs`, `weights`), the largest transient the allocator
saw (`PhasePeak`), and the state's bytes per tag as last measured awake, which a sleep
would otherwise hide (a paused storage has 0 bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch

from tandem.lifecycle import Lifecycle, reloadable_process_groups
from tandem.megatron.runtime.gpu_memory import CACHED, PhasePeaks, resident_change

__all__ = ["StepWakes", "WorkerMemory", "process_group_counts", "storage_piece"]


class WorkerMemory:
    """Sleep and wake of any of one model's memory tags, its phases' peaks, and its state's bytes.

    The process groups go down with the last tag and come back with the first: a sleep
    destroys them only when it leaves every tag asleep, and a wake reloads them only when
    it starts from every tag asleep (or wakes every tag: `wake_up(None)` reloads them even
    when awake, for a retried step). A model partly asleep keeps computing, so it keeps them.

    Args:
        lifecycle: the model's lifecycle, made with `tags`.
        tags: the model's memory tags, in the order they sleep.
        weight_tags: those a forward pass reads (`Trainee.weight_tags`).
        state_nbytes: the state's bytes by tag, measured now (`Trainee.state_nbytes`).
    """

    def __init__(
        self,
        lifecycle: Lifecycle,
        tags: Sequence[str],
        weight_tags: Sequence[str],
        state_nbytes: Callable[[], dict[str, int]],
    ) -> None:
        self.lifecycle = lifecycle
        self.tags = list(tags)
        self.weight_tags = [t for t in self.tags if t in weight_tags]
        self._measure_state = state_nbytes
        self._state_nbytes: dict[str, int] | None = None
        self._trained = False
        """Whether `record_state` ran after a train: the state's bytes are those of every later one."""
        self._peaks = PhasePeaks()

    # --- which tags sleep ---------------------------------------------------------------------------
    def asleep(self) -> list[str]:
        """The tags put away now, in the order they sleep."""
        paused = self.lifecycle.paused_tags
        return [t for t in self.tags if t in paused]

    @property
    def all_asleep(self) -> bool:
        """Whether every tag is put away (the process groups are then torn down)."""
        return len(self.asleep()) == len(self.tags)

    def weights_asleep(self) -> list[str]:
        """The weight tags put away now: a forward pass needs them back."""
        paused = self.lifecycle.paused_tags
        return [t for t in self.weight_tags if t in paused]

    def check(self, method: str, tags: Sequence[str] | None) -> list[str] | None:
        """`tags` as a list (None: every tag); ValueError naming the worker's tags for one it lacks."""
        if tags is None:
            return None
        if isinstance(tags, str):
            raise ValueError(f"{method}: tags={tags!r}; give a list of tag names, e.g. [{tags!r}]")
        unknown = [t for t in tags if t not in self.tags]
        if unknown:
            raise ValueError(
                f"{method}: tags {unknown} are not this worker's; choose among its memory tags {self.tags} "
                "(None: every tag)"
            )
        return list(tags)

    def sleep(self, tags: Sequence[str] | None = None) -> dict[str, float]:
        """Put `tags` away (None: every tag; those asleep already are skipped); the seconds each step took."""
        chosen = self.check("sleep", tags)
        after = set(self.tags if chosen is None else chosen) | set(self.asleep())
        self.lifecycle.sleep(chosen, process_groups=len(after) == len(self.tags))
        return self.lifecycle.last_timings

    def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, float]:
        """Bring `tags` back (None: every tag, and the process groups even when awake); the seconds each
        step took."""
        chosen = self.check("wake_up", tags)
        reload = chosen is None or (bool(chosen) and self.all_asleep)
        self.lifecycle.wake_up(chosen, process_groups=reload)
        return self.lifecycle.last_timings

    def wake_for_train(self, keep: Sequence[str]) -> StepWakes | None:
        """Wake what a train needs: every tag but those of `keep` asleep now (`TrainWorker.keep_asleep_for_passes`),
        which wake for each optimizer step alone: their `StepWakes`. None where none of them sleeps: then a train
        wakes every tag, and the process groups too (`wake_up()`), as always."""
        asleep = self.asleep()
        at_step = [t for t in keep if t in asleep]
        if not at_step:
            if asleep:
                self.wake_up()
            return None
        if others := [t for t in asleep if t not in at_step]:
            self.wake_up(others)
        return StepWakes(self, at_step)

    @contextmanager
    def weights_back(self, *, collectives: bool, tags: Sequence[str] | None = None) -> Iterator[bool]:
        """The weight tags that are asleep (of `tags`: default all of them) back for the block, and asleep
        again after; yields whether the process groups are alive in the block.

        Only those that were asleep move, and the process groups come back (and go again) only where the
        block gathers over them (`collectives`) and they were down: with every tag asleep.
        """
        asleep = [t for t in self.weights_asleep() if tags is None or t in tags]
        if not asleep:
            yield True
            return
        were_down = self.all_asleep
        groups = collectives and were_down
        self.lifecycle.wake_up(asleep, process_groups=groups)
        try:
            yield groups or not were_down
        finally:
            self.lifecycle.sleep(asleep, process_groups=groups)

    # --- what the memory plan measures ---------------------------------------------------------------
    @contextmanager
    def measure(self, work: str, *, outside: str | None = None) -> Iterator[None]:
        """Keep the block's allocator peak above its start as `work`'s transient, the largest so far (CUDA);
        where the block has parts (`gpu_memory.phase_part`), each part's as `work/part` and the rest's as
        `work/<outside>` too."""
        with self._peaks.measure(work, outside=outside):
            yield

    def phase_peaks(self) -> dict[str, int]:
        """Each work's largest transient bytes so far (`measure`), and under `CACHED` the most the allocator
        kept cached after one of them; empty on the CPU."""
        peaks = self._peaks.as_dict()
        cached = self._peaks.cached()
        if cached is not None:
            peaks[CACHED] = cached
        return peaks

    def record_state(self) -> None:
        """Measure the state's bytes now (awake), for `state_nbytes` to answer while asleep."""
        self._state_nbytes = self._measure_state()

    def record_state_after_train(self) -> None:
        """`record_state` after the first train only: the optimizer's moments exist from its step on, and a
        later train changes no tensor's size, and a measure walks every storage of every tag."""
        if not self._trained:
            self.record_state()
            self._trained = True

    def state_nbytes(self) -> dict[str, int]:
        """The state's bytes by tag, every tag included: measured now when awake, else as last recorded."""
        if not self.asleep():
            figures = self._measure_state()
        elif self._state_nbytes is None:
            raise RuntimeError("state_nbytes: the model is asleep and no figures were recorded awake")
        else:
            figures = self._state_nbytes
        return {**dict.fromkeys(self.tags, 0), **figures}


class StepWakes:
    """Memory tags asleep through a train's forward and backward passes, woken for each of its optimizer
    steps and put back to sleep after it (a memory plan's `PlannedTurn.at_step`: the optimizer's state, which
    only the step reads, so that the passes' activations and the state need not fit the GPU at once).

    `around_step()` wraps one optimizer step: the tags wake before it (their copy back is waited for by the
    step's `join_optimizer`) and sleep after it, also when it fails, so that the worker holds what the plan
    has asleep once the train is over. Both moves count as resident change, not as the train's transient
    (`gpu_memory.resident_change`). `seconds` adds up the wakes' and the sleeps' seconds, `moved_bytes` the
    bytes they moved (each way, the tags' recorded figures).
    """

    def __init__(self, memory: WorkerMemory, tags: Sequence[str]) -> None:
        self.memory = memory
        self.tags = list(tags)
        self.seconds = {"wake": 0.0, "sleep": 0.0}
        self.moved_bytes = 0

    @contextmanager
    def around_step(self) -> Iterator[None]:
        """The tags back for the block, asleep again after it."""
        woken = [t for t in self.memory.asleep() if t in self.tags]
        with resident_change():
            self.seconds["wake"] += self.memory.wake_up(woken).get("total", 0.0) if woken else 0.0
        try:
            yield
            if woken:
                self.memory.record_state()  # every tag awake: the bytes `state_nbytes` answers with after
        finally:
            with resident_change():
                self.seconds["sleep"] += self.memory.sleep(woken).get("total", 0.0) if woken else 0.0
            nbytes = self.memory.state_nbytes()
            self.moved_bytes += 2 * sum(nbytes.get(t, 0) for t in woken)

    def figures(self) -> dict[str, float]:
        """`TrainResult.step_moves`: the wakes' and sleeps' seconds, and the GiB they moved both ways."""
        return {
            **{f"step_{k}_s": v for k, v in self.seconds.items()},
            "step_moved_gib": self.moved_bytes / 2**30,
        }


def process_group_counts() -> dict[str, int]:
    """How many of this process's reloadable process groups are alive, by size (`TrainWorker.process_groups`)."""
    counts = dict.fromkeys(
        ("local_one_rank", "alive_one_rank", "alive_larger", "torn_down_one_rank", "torn_down_larger"), 0
    )
    for group in reloadable_process_groups():
        if group.local:
            counts["local_one_rank"] += 1
            continue
        state = "alive" if group.alive else "torn_down"
        counts[f"{state}_{'one_rank' if group.size() == 1 else 'larger'}"] += 1
    return counts


def storage_piece(
    tensors: Callable[[], Iterable[torch.Tensor]], index: int, pieces: int
) -> list[torch.Tensor]:
    """Piece `index` of `pieces` of `tensors()`: the tensors of the distinct storages whose first byte, in the
    storages' order, lies in the piece's share of their total bytes. Each storage's bytes are its tensors'
    extent by their shapes, not its present size, which a paused piece has at 0: so the cuts stay where
    they were whichever pieces are asleep."""
    groups: dict[int, list[torch.Tensor]] = {}
    extent: dict[int, int] = {}
    for t in tensors():
        key = int(t.untyped_storage()._cdata)  # stable while resized
        groups.setdefault(key, []).append(t)
        reach = int(t.storage_offset()) + sum(
            (n - 1) * step for n, step in zip(t.shape, t.stride(), strict=True)
        )
        extent[key] = max(extent.get(key, 0), (reach + 1) * t.element_size() if t.numel() else 0)
    total = sum(extent.values())
    chosen: list[torch.Tensor] = []
    start = 0
    for key, group in groups.items():
        if pieces == 1 or min(start * pieces // max(total, 1), pieces - 1) == index:
            chosen += group
        start += extent[key]
    return chosen
