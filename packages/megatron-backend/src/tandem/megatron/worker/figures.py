"""What a train worker reports about itself: its memory, its lifecycle's timings, its process groups.

`WorkerFigures` is a base of `train_worker.TrainWorker`: the methods the driver, the memory plan, the
benchmarks and the tests call to read a rank's figures, apart from the methods that change its state.
None of them sleeps, wakes or trains.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tandem.megatron.runtime.gpu_memory import device_used_bytes, foreign_gpu_bytes, process_gpu_bytes
from tandem.megatron.worker._trainee import Trainee
from tandem.megatron.worker.memory import WorkerMemory, process_group_counts

__all__ = ["WorkerFigures"]


class WorkerFigures:
    """A train worker's read-only figures; `TrainWorker` sets the state they read in `init`."""

    _trainee: Trainee | None
    _memory: WorkerMemory | None
    _lifecycle: Any
    _backend: Any
    _gpu_start: dict[str, int | None]

    def lifecycle_timings(self) -> dict[str, float]:
        """Seconds of each step of this worker's last sleep or wake (that of a weight export included)."""
        return dict(self._lifecycle.last_timings) if self._lifecycle is not None else {}

    def process_groups(self) -> dict[str, int]:
        """How many of this rank's reloadable process groups are alive, by size.

        Keys `local_one_rank` (groups of one rank that answer in the process: no
        communicator, never torn down), `alive_one_rank`, `alive_larger`,
        `torn_down_one_rank`, `torn_down_larger`. Asleep, every other group is torn
        down unless `keep_single_rank_groups` keeps those of one rank (whose NCCL
        communicators then keep their device memory).
        """
        return process_group_counts()

    def state_snapshot(self) -> dict[str, torch.Tensor]:
        """CPU copies of this rank's weights, optimizer state and schedule position (tests, debugging)."""
        trainee = self._require_init()
        if self._lifecycle.asleep:
            raise RuntimeError("state_snapshot: the model is asleep; wake it up first")
        return trainee.snapshot()

    def state_nbytes(self) -> dict[str, int]:
        """Bytes of the training state that sleep moves, by memory tag: every tag of `memory_tags()` (0
        where empty), and `base` and `grads` always (`Trainee.state_nbytes`). Measured now when awake;
        while any tag sleeps, the figures recorded at the end of `init` and of the first `train` (a later one
        changes no size)."""
        self._require_init()
        return self._require_memory().state_nbytes()

    def phase_peaks(self) -> dict[str, int]:
        """Each work's transient bytes on CUDA, the largest seen so far: the allocator's peak in the work
        less what was allocated as it began (after any wake), by work (`train`, `log_probs`, `weights`,
        once each has run), and under `gpu_memory.CACHED` the most the allocator kept cached as one of them
        ended (what the process holds between phases unless `empty_cache` hands it back). Empty on the CPU,
        which has no allocator figures."""
        self._require_init()
        return self._require_memory().phase_peaks()

    def host_buffer_bytes(self) -> int | None:
        """Bytes of host memory the sleep backend keeps for this worker's state (pinned, kept between
        cycles, also while awake); None where the backend does not say (torch_memory_saver's CPU backup)."""
        host_nbytes = getattr(self._backend, "host_nbytes", None)
        return int(host_nbytes()) if host_nbytes is not None else None

    def bytes_copied_to_host(self) -> dict[str, int]:
        """Bytes each memory tag has copied to the host so far (pinned_host; {} elsewhere): a LoRA model's
        frozen base only at its first sleep."""
        self._require_init()
        copied = getattr(self._backend, "copied_to_host", None)
        if copied is None:
            return {}
        return {tag: int(copied(tag)) for tag in self._backend.tags}

    def gpu_memory(self) -> dict[str, int | None]:
        """This worker's GPU memory now and at start-up, in bytes, as nvidia-smi reports it.

        `process`: what the driver attributes to this process now (CUDA context
        included); `process_baseline`: the same once the CUDA context existed, before
        the model; `device_used` / `device_before_context` / `context`: the whole
        GPU now, before this worker's CUDA context, and that context's size. None
        where nvidia-smi cannot tell (no such pid in a container's view); all 0 on CPU.
        `pid`: this process's (the memory plan tells the run's processes from others' by it).
        """
        if not torch.cuda.is_available():
            zeros: dict[str, int | None] = dict.fromkeys(
                ("process", "process_baseline", "device_used", "device_before_context", "context"), 0
            )
            return {**zeros, "pid": os.getpid()}
        current = {"process": process_gpu_bytes(), "device_used": device_used_bytes(), "pid": os.getpid()}
        return {**current, **self._gpu_start}

    def foreign_gpu_bytes(self, own_pids: list[int]) -> int | None:
        """The most memory that processes outside `own_pids` (the run's) hold on one of this worker's GPUs;
        None on a CPU or where nvidia-smi cannot tell (`gpu_memory.foreign_gpu_bytes`)."""
        return foreign_gpu_bytes(own_pids) if torch.cuda.is_available() else None

    def _require_init(self) -> Trainee:
        if self._trainee is None:
            raise RuntimeError("TrainWorker: call init(config, role, master_addr, master_port) first")
        return self._trainee

    def _require_memory(self) -> WorkerMemory:
        self._require_init()
        assert self._memory is not None, "init sets the trainee and its memory together"
        return self._memory
