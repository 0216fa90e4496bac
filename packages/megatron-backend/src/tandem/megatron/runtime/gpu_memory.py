"""GPU memory figures of one process and of its GPU, as nvidia-smi reports them (no CUDA call), and the
CUDA caching allocator's counts and peaks over a block (`AllocatorCalls`, `PhasePeak`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Collection, Iterator
from typing import Any, ClassVar

__all__ = [
    "CACHED",
    "PART_SEPARATOR",
    "AllocatorCalls",
    "PhasePeak",
    "PhasePeaks",
    "all_devices_used_bytes",
    "device_used_bytes",
    "empty_device_cache",
    "foreign_gpu_bytes",
    "phase_part",
    "process_gpu_bytes",
    "resident_change",
]


def empty_device_cache(device: Any) -> None:
    """Hand this process's unused cached device memory back to the driver, cuBLAS's workspaces included (one per
    stream used; they live in torch's allocator too and come back on use). Waits for the device first; nothing
    off CUDA."""
    import torch

    if torch.device(device).type != "cuda":
        return
    torch.cuda.synchronize(device)
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


def _nvidia_smi(*args: str) -> list[str] | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", *args, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()


def process_gpu_bytes() -> int | None:
    """GPU memory the driver attributes to this process; None when nvidia-smi lists no such pid."""
    for line in _nvidia_smi("--query-compute-apps=pid,used_memory") or []:
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(used.strip()) * 1024**2
    return None


def foreign_gpu_bytes(own_pids: Collection[int]) -> int | None:
    """The most GPU memory that processes outside `own_pids` hold on one of the GPUs this process sees (another
    job, a notebook, a process that touched CUDA once), from nvidia-smi's list of compute processes.

    None where it cannot tell: no nvidia-smi, or none of `own_pids` in its list (a container's own pid
    namespace, where its pids are not the host's), since then nothing tells ours from the others'.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    uuids = _nvidia_smi("--query-gpu=uuid", *(["-i", visible] if visible else []))
    apps = _nvidia_smi("--query-compute-apps=pid,gpu_uuid,used_memory")
    if uuids is None or apps is None:
        return None
    held = {uuid.strip(): 0 for uuid in uuids if uuid.strip()}
    ours = False
    for line in apps:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or not fields[0].isdigit():
            continue
        pid, uuid, used = int(fields[0]), fields[1], fields[2]
        if pid in own_pids:
            ours = True
        elif uuid in held and used.isdigit():
            held[uuid] += int(used) * 1024**2
    return max(held.values(), default=0) if ours else None


def device_used_bytes() -> int | None:
    """Memory in use on this process's GPU (all processes), from nvidia-smi without touching CUDA."""
    device = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    lines = _nvidia_smi("--query-gpu=memory.used", "-i", device)
    return int(lines[0].strip()) * 1024**2 if lines else None


def all_devices_used_bytes() -> list[int] | None:
    """Memory in use on each GPU this process can see, from nvidia-smi; None without GPUs or nvidia-smi."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    args = ["--query-gpu=memory.used"] + (["-i", visible] if visible else [])
    lines = _nvidia_smi(*args)
    if not lines:
        return None
    return [int(line.strip()) * 1024**2 for line in lines if line.strip()]


class AllocatorCalls:
    """How often the CUDA caching allocator asked the driver for memory, and gave it back, in a block.

    `with calls: ...`, then `calls.metrics()`: `alloc/device_mallocs` (cudaMalloc calls, or the
    segments an expandable segment mapped) and `alloc/device_frees` (cudaFree calls, or
    unmapped segments, `empty_cache()` included) made by this process inside the block, from
    `torch.cuda.memory_stats()`; nothing without CUDA. They count what a sleep that handed the
    memory back costs the next phase: a resident model reuses its cached blocks and calls
    neither.
    """

    KEYS: ClassVar[dict[str, str]] = {
        "alloc/device_mallocs": "num_device_alloc",
        "alloc/device_frees": "num_device_free",
    }
    SEGMENT_KEYS: ClassVar[dict[str, str]] = {
        "alloc/device_mallocs": "segment.all.allocated",
        "alloc/device_frees": "segment.all.freed",
    }

    def __init__(self) -> None:
        self._before: dict[str, int] = {}
        self._counts: dict[str, float] = {}

    @staticmethod
    def _read() -> dict[str, int]:
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return {}
        stats: dict[str, Any] = torch.cuda.memory_stats()
        out = {}
        for name, key in AllocatorCalls.KEYS.items():
            value = stats.get(key, stats.get(AllocatorCalls.SEGMENT_KEYS[name]))
            if value is not None:
                out[name] = int(value)
        return out

    def __enter__(self) -> AllocatorCalls:
        self._before = self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        after = self._read()
        self._counts = {k: float(after[k] - self._before[k]) for k in after if k in self._before}

    def metrics(self) -> dict[str, float]:
        """The counts of the last block (empty without CUDA)."""
        return dict(self._counts)


PART_SEPARATOR = "/"
"""Between a phase's name and its part's in `PhasePeaks.as_dict()`'s keys: `train/optimizer_step`."""

CACHED = "cached"
"""The key of a worker's `phase_peaks()` beside its works': `PhasePeaks.cached()`, the most its allocator kept
cached after one of them."""


class PhasePeak:
    """The GPU memory a block takes at its peak above what it began with (a phase's transient).

    `with PhasePeak() as peak: ...`, then `peak.nbytes`: the larger of two rises in the block (the
    allocator's peak statistics reset on entry): `max_memory_allocated()` less `memory_allocated()` on
    entry (activations, logits, a weight sync's buckets, above the tensors that stay resident), and
    `max_memory_reserved()` less `memory_reserved()` on entry (the segments the allocator took from the
    driver for them: the same bytes and what rounding and fragmentation add, which the GPU must hold
    too). None without CUDA (or before this process has touched it): the CPU has no allocator figures.
    The memory plan adds it to a phase's resident tags (and a kept cache, `cached`, beside them).
    `peak.cached`: the bytes the allocator keeps cached as the block ends (reserved, not allocated):
    what the process goes on holding unless it hands its cache back (`empty_cache`).

    State that the block creates and keeps (Adam's moments, made by the first optimizer step), or
    wakes, is resident, not transient: the code that makes it runs inside `resident_change()`, and
    what it kept moves the block's start up instead of adding to its rise, so that the plan, which
    counts the state among the resident tags, does not count it twice. State the block puts to sleep
    moves the start down the same way (its reserved start by the segments the sleep handed back).

    Parts (`part(name)`, one at a time): the rise of each named stretch of the block above the block's
    start (counting the segments it took itself, not those an earlier stretch left cached), and of what
    lies outside them, apart (`parts`, `outside`): a train's optimizer steps and its
    forward and backward passes, which a plan may give different tags (the optimizer's state asleep
    through the passes). `nbytes` is the largest of them.
    Resets the process's peak statistic: blocks of it do not nest.
    """

    def __init__(self) -> None:
        self._start: int | None = None
        self._reserved_start: int | None = None
        self._rise = 0  # the largest rise of the stretches before the last reset
        self._part: str | None = None
        self._part_reserved = 0  # what was reserved as the part began (and the state it kept took since)
        self._part_above = 0  # what was allocated above the block's start as the part began
        self._by_part: dict[str | None, int] = {}
        self.nbytes: int | None = None
        self.cached: int | None = None
        self.parts: dict[str, int] = {}
        """Each part's largest rise above the block's start (empty without CUDA or without parts)."""
        self.outside: int | None = None
        """The largest rise outside the parts (None without CUDA)."""

    @staticmethod
    def _cuda() -> Any:
        import torch

        return torch.cuda if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def _rises(self, cuda: Any) -> int:
        assert self._start is not None and self._reserved_start is not None
        allocated_rise = int(cuda.max_memory_allocated()) - self._start
        reserved_rise = int(cuda.max_memory_reserved()) - self._reserved_start
        return max(0, allocated_rise, reserved_rise)

    def _fold(self, cuda: Any, *, reset: bool = True) -> None:
        """The rise since the statistics last started into the block's figure and the current part's.

        A part's rise is its allocated peak above the block's start, or, where larger, what was allocated
        above that start as the part began plus the segments the part took from the driver: the segments
        reserved before it (the passes' activations, cached) are the stretch's before it, not the part's,
        which its allocations reuse first."""
        rise = self._rises(cuda)
        self._rise = max(self._rise, rise)
        if self._part is not None:
            assert self._start is not None
            allocated_rise = int(cuda.max_memory_allocated()) - self._start
            took = int(cuda.max_memory_reserved()) - self._part_reserved
            rise = max(0, allocated_rise, self._part_above + took)
        self._by_part[self._part] = max(self._by_part.get(self._part, 0), rise)
        if reset:
            cuda.reset_peak_memory_stats()

    def __enter__(self) -> PhasePeak:
        global _ACTIVE
        cuda = self._cuda()
        self.nbytes = self.cached = self.outside = None
        self._start = self._reserved_start = None
        self._rise, self._part, self._by_part, self.parts = 0, None, {}, {}
        if cuda is not None:
            self._start, self._reserved_start = int(cuda.memory_allocated()), int(cuda.memory_reserved())
            cuda.reset_peak_memory_stats()
        _ACTIVE = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = None
        cuda = self._cuda()
        if self._start is not None and self._reserved_start is not None and cuda is not None:
            self._part = None
            self._fold(cuda, reset=False)
            self.nbytes = self._rise
            self.outside = self._by_part.get(None, 0)
            self.parts = {name: rise for name, rise in self._by_part.items() if name is not None}
            self.cached = max(0, int(cuda.memory_reserved()) - int(cuda.memory_allocated()))

    def _live(self) -> Any:
        cuda = self._cuda()
        return None if cuda is None or self._start is None or self._reserved_start is None else cuda

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Within: code that creates or wakes state the block keeps, or puts state to sleep; what it kept
        (or handed back) moves the block's start."""
        cuda = self._live()
        if cuda is None:
            yield
            return
        before, reserved_before = int(cuda.memory_allocated()), int(cuda.memory_reserved())
        self._fold(cuda)  # the peak so far, above the old start
        yield
        kept = int(cuda.memory_allocated()) - before
        reserved_change = int(cuda.memory_reserved()) - reserved_before
        assert self._start is not None and self._reserved_start is not None
        if kept >= 0:
            # The block's own peak above the moved start: its temporaries, without the state it kept (whose
            # tensors hold at least as many bytes of segments; what else the block reserved stays a rise). A
            # part's reserved base takes the segments the state took, at most its bytes.
            self._start += kept
            self._reserved_start += kept
            self._part_reserved += max(0, min(kept, reserved_change))
            self._fold(cuda)
        else:
            # State put away: the block's peak came before it went, above the old start; then the start comes
            # down, the reserved one by the segments handed back alone (a freed block stays cached), and by no
            # more than the state's bytes (the rest handed back held transients, counted as rises already).
            self._fold(cuda)
            self._start += kept
            self._reserved_start -= min(-kept, max(0, -reserved_change))
            self._part_reserved -= max(0, -reserved_change)

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Within: a stretch of the block whose rise is kept apart, as `parts[name]` (the largest of its
        stretches); parts do not nest."""
        cuda = self._live()
        if cuda is None:
            yield
            return
        if self._part is not None:
            raise RuntimeError(f"PhasePeak.part({name!r}) inside part {self._part!r}: parts do not nest")
        self._fold(cuda)
        assert self._start is not None
        self._part = name
        self._part_reserved = int(cuda.memory_reserved())
        self._part_above = max(0, int(cuda.memory_allocated()) - self._start)
        try:
            yield
        finally:
            self._fold(cuda)
            self._part = None


_ACTIVE: PhasePeak | None = None
"""The `PhasePeak` block open in this process (blocks do not nest), for `resident_change` and `phase_part`."""


@contextlib.contextmanager
def resident_change() -> Iterator[None]:
    """Within: state that stays is created or woken (the optimizer's moments at its first step, its state woken
    for a step), or state is put to sleep; an open `PhasePeak` counts what it kept or handed back as
    resident, not as its transient. Nothing outside a block or without CUDA."""
    active = _ACTIVE
    if active is None:
        yield
        return
    with active.changing():
        yield


@contextlib.contextmanager
def phase_part(name: str) -> Iterator[None]:
    """Within: a part of the open `PhasePeak` block (`PhasePeak.part`); nothing outside a block or without
    CUDA."""
    active = _ACTIVE
    if active is None:
        yield
        return
    with active.part(name):
        yield


class PhasePeaks:
    """Each phase's largest transient so far: `with peaks.measure("train"): ...` (a `PhasePeak` each time),
    then `peaks.as_dict()`, {phase: bytes}; empty without CUDA. `peaks.cached()`: the most the allocator
    kept cached at the end of one of them (None without CUDA)."""

    def __init__(self) -> None:
        self._largest: dict[str, int] = {}
        self._cached: int | None = None

    @contextlib.contextmanager
    def measure(self, phase: str, *, outside: str | None = None) -> Iterator[None]:
        """Keep the block's transient as `phase`'s where it is the largest so far; and where the block has parts
        (`phase_part`), each part's as `phase/part`, and what lies outside them as `phase/<outside>`."""
        with PhasePeak() as peak:
            yield
        if peak.nbytes is not None:
            self._largest[phase] = max(self._largest.get(phase, 0), peak.nbytes)
        if peak.parts:
            named = {**peak.parts, **({outside: peak.outside or 0} if outside is not None else {})}
            for name, nbytes in named.items():
                key = f"{phase}{PART_SEPARATOR}{name}"
                self._largest[key] = max(self._largest.get(key, 0), nbytes)
        if peak.cached is not None:
            self._cached = max(self._cached or 0, peak.cached)

    def as_dict(self) -> dict[str, int]:
        """{phase: its largest transient bytes so far}."""
        return dict(self._largest)

    def cached(self) -> int | None:
        """The most bytes the allocator kept cached (reserved, not allocated) as one of the blocks ended:
        what the process holds beside its tensors between phases while it keeps its cache."""
        return self._cached
