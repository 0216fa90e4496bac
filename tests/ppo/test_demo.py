"""`ppo-driver demo`: actor, critic and engine ranks share each logical GPU as planned."""

from __future__ import annotations

from collections import defaultdict

import pytest

from tandem.ppo._demo import DemoArgs, run_demo


def test_demo_colocates_actor_critic_and_engine_on_every_gpu() -> None:
    rows = run_demo(DemoArgs(gpus=2, actor_gpus=2, rollout_gpus=2))
    by_gpu: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for row in rows:
        assert len(row["gpu_ids"]) == 1, row  # a fractional share still sees exactly one GPU
        by_gpu[tuple(row["gpu_ids"])].add(row["role"])
    assert len(by_gpu) == 2
    assert all(roles == {"actor", "critic", "engine"} for roles in by_gpu.values()), by_gpu
    # Critic rank r sits on the same GPU as actor rank r (the critic reuses the actor's bundles).
    gpu_of = {(r["role"], r["rank"]): r["gpu_ids"] for r in rows}
    assert all(gpu_of[("critic", rank)] == gpu_of[("actor", rank)] for rank in range(2))


def test_demo_refuses_too_few_gpus_by_flag() -> None:
    with pytest.raises(ValueError, match="--gpus"):
        run_demo(DemoArgs(gpus=1, actor_gpus=2, rollout_gpus=2))
