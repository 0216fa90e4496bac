"""The teacher's workers of a run, one Ray actor per rollout bundle; what the driver takes log-probs from.

`create_teacher_group` starts one `TeacherWorker` per bundle of the rollout slot,
beside the rollout engine of that bundle (`forward.start_forward_group`).
`TeacherGroup.log_probs` splits the samples across the workers in contiguous chunks
and returns each sample's log-probs in input order; a worker that dies, fails or
does not answer in time is named by rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tandem.ppo.rollout.forward import ForwardGroup, start_forward_group

from ._options import TeacherOptions

if TYPE_CHECKING:
    import torch


class TeacherError(RuntimeError):
    """A teacher's worker died, timed out, or failed; the message names its rank."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"teacher rank {rank}: {message}")
        self.rank = rank


class TeacherGroup(ForwardGroup):
    """The teacher's workers in rank order: `wake_up`, `log_probs`, `sleep`, `shutdown`.

    Args:
        handles: Ray actor handles of `TeacherWorker`s (rank order).
        timeout_s: seconds to wait for each worker's answer.
    """

    TIMEOUT_OPTION = "TeacherOptions.request_timeout_s"

    def error(self, rank: int, message: str) -> TeacherError:
        """A `TeacherError` naming rank `rank`."""
        return TeacherError(rank, message)

    def log_probs(
        self, sequences: Sequence[Sequence[int]], response_lengths: Sequence[int], temperature: float
    ) -> list[torch.Tensor]:
        """Each sample's response log-probs (`TeacherWorker.log_probs`), in input order; worker r takes the
        r-th contiguous chunk."""
        calls = [
            (
                rank,
                self.handles[rank].log_probs.remote(
                    [list(s) for s in sequences[lo:hi]], list(response_lengths[lo:hi]), temperature
                ),
            )
            for rank, lo, hi in self.chunks(len(sequences))
        ]
        return [t for chunk in self.wait(calls, "log_probs") for t in chunk]


def create_teacher_group(
    folder: str,
    placement_group: Any,
    bundle_indices: Sequence[int],
    *,
    num_gpus_per_worker: float,
    num_cpus_per_worker: float = 0.1,
    options: TeacherOptions | None = None,
) -> TeacherGroup:
    """Start one teacher worker per bundle of `placement_group` (rank r on `bundle_indices[r]`), each loaded."""
    from ._worker import TeacherWorker  # torch and transformers: the package itself loads neither

    return start_forward_group(
        TeacherGroup,
        TeacherWorker,
        folder,
        placement_group,
        bundle_indices,
        num_gpus_per_worker=num_gpus_per_worker,
        num_cpus_per_worker=num_cpus_per_worker,
        options=options or TeacherOptions(),
    )
