"""`measure_memory`'s capacity: the GPU's memory less what processes outside the run hold on it, over stand-in
roles (the answers a train group and the engines give on a GPU)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tandem.ppo.loop.memory_figures import measure_memory

GIB = 2**30


class FakeGroup:
    """A train group's answers, one rank, with the pids it reports and what its worker sees of others."""

    def __init__(self, role: str, pid: int | None, foreign: int | None) -> None:
        self.role, self.pid, self.foreign = role, pid, foreign
        self.asked_pids: list[int] | None = None

    def run(self, method: str, *args: Any) -> list[Any]:
        if method == "foreign_gpu_bytes":
            self.asked_pids = list(args[0])
        answers: dict[str, Any] = {
            "memory_tags": ["weights", "optimizer"],
            "state_nbytes": {"weights": GIB, "optimizer": 2 * GIB},
            "gpu_memory": {"context": GIB // 2, "pid": self.pid},
            "phase_peaks": {"train": 3 * GIB},
            "foreign_gpu_bytes": self.foreign,
        }
        return [answers[method]]


class FakeGpus:
    reward_model = None
    teacher = None

    def __init__(self, groups: list[FakeGroup]) -> None:
        self.groups = groups

    def models(self) -> list[FakeGroup]:
        return self.groups


def engine(pid: int | None) -> dict[str, float]:
    stats = {"allocated_gib": 4.0, "reserved_gib": 4.0, "kv_cache_gib": 2.0, "total_gib": 80.0}
    return stats if pid is None else {**stats, "pid": pid}


def test_the_capacity_leaves_what_others_hold(caplog: pytest.LogCaptureFixture) -> None:
    actor, critic = FakeGroup("actor", 11, 3 * GIB), FakeGroup("critic", 12, 2 * GIB)
    with caplog.at_level(logging.INFO, logger="tandem.ppo.loop.memory_figures"):
        figures = measure_memory(
            FakeGpus([actor, critic]), engine_stats=[engine(10)], gpu_memory_gib=None, margin_gib=4
        )
    assert actor.asked_pids == [10, 11, 12], "the engines' and every worker's pids are the run's"
    assert figures.budget.capacity == 80 * GIB - 3 * GIB, "the most any worker saw held by others"
    assert figures.budget.available == 73 * GIB
    assert "processes outside the run hold 3.00 GiB" in caplog.text
    # A stated capacity stands where the GPU has it; past what the run has of the GPU it is cut there.
    stated = measure_memory(
        FakeGpus([actor, critic]), engine_stats=[engine(10)], gpu_memory_gib=60, margin_gib=4
    )
    assert stated.budget.capacity == 60 * GIB
    with caplog.at_level(logging.WARNING, logger="tandem.ppo.loop.memory_figures"):
        cut = measure_memory(
            FakeGpus([actor, critic]), engine_stats=[engine(10)], gpu_memory_gib=79, margin_gib=4
        )
    assert cut.budget.capacity == 77 * GIB and "--gpu-memory-gib 79 is more than the 77.0 GiB" in caplog.text


def test_without_the_runs_pids_nothing_is_taken_off() -> None:
    # An engine that reports no pid (or a worker in a pid namespace of its own): nothing tells the run's
    # processes from the others', so the whole GPU is the capacity and the margin covers the rest.
    actor = FakeGroup("actor", 11, 3 * GIB)
    figures = measure_memory(
        FakeGpus([actor]), engine_stats=[engine(None)], gpu_memory_gib=None, margin_gib=4
    )
    assert figures.budget.capacity == 80 * GIB and actor.asked_pids is None
    unknown = FakeGroup("actor", None, 3 * GIB)
    assert (
        measure_memory(
            FakeGpus([unknown]), engine_stats=[engine(10)], gpu_memory_gib=None, margin_gib=4
        ).budget.capacity
        == 80 * GIB
    )


def test_a_gpu_full_of_others_is_refused() -> None:
    actor = FakeGroup("actor", 11, 80 * GIB)
    with pytest.raises(
        ValueError, match=r"other processes hold 80\.0 GiB, the GPU's whole memory; free the GPU"
    ):
        measure_memory(FakeGpus([actor]), engine_stats=[engine(10)], gpu_memory_gib=None, margin_gib=4)
