"""`ppo-driver memory-plan RUN_DIR`: a run's memory plan again for another GPU, from its memory_plan.json.

The file is written here as a run writes it (`write_plans`), from hand-made figures; the resumed run of
tests/ppo/test_driver.py reads a real one. No Ray, no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.ppo.app.cli import run as cli
from tandem.ppo.loop.memory_figures import (
    MemoryFigures,
    planned_roles,
    schedule_from_dict,
    schedule_to_dict,
    write_plans,
)
from tandem.ppo.loop.memory_model import GpuBudget, MemoryModel, RoleMemory, TrainSplit
from tandem.ppo.loop.memory_plan import capacity_range
from tandem.ppo.loop.memory_planner import plan_memory
from tandem.ppo.loop.schedule import TRAIN_ROLES, StepFacts, save_schedule, step_schedule

GIB = 2**30
TAGS = ["weights", "grads", "main_params", "optimizer_moments"]


def _run_dir(
    tmp_path: Path, *, kv_cache: int = 40 * GIB, splits: dict[str, TrainSplit] | None = None
) -> tuple[Path, MemoryFigures]:
    train = {"weights": 1 * GIB, "grads": 2 * GIB, "main_params": 4 * GIB, "optimizer_moments": 8 * GIB}
    model = MemoryModel(
        {
            "engine": RoleMemory({"weights": GIB, "kv_cache": kv_cache}, fixed=GIB // 2),
            "actor": RoleMemory(train, fixed=GIB // 2),
            "critic": RoleMemory(dict(train), fixed=GIB // 2),
        },
        {("actor", "train"): 6 * GIB, ("critic", "train"): 6 * GIB, ("engine", "generate"): GIB},
        splits or {},  # type: ignore[arg-type]
    )
    for role in model.roles:  # the figures a run writes: every phase, 0 where nothing measured
        for work in (
            "generate",
            "score",
            "log_probs",
            "train",
            "start_next",
            "await_next",
            "weights",
            "save",
        ):
            model.phases.setdefault((role, work), 0)  # type: ignore[attr-defined]
    figures = MemoryFigures(model, GpuBudget(60 * GIB, 4 * GIB), {"actor": TAGS, "critic": TAGS})
    facts = StepFacts(colocate=True, offload_train=True, critic=True)
    plans = {
        s.describe(): plan_memory(s, model, figures.budget, planned_roles=TRAIN_ROLES)
        for s in (step_schedule(facts), save_schedule(facts))
    }
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_plans(run_dir / "memory_plan.json", figures, plans)
    return run_dir, figures


def test_schedules_round_trip_as_data() -> None:
    for facts in (
        StepFacts(True, True, True, reward_model=True, kl_first=True),
        StepFacts(False, True, False),
    ):
        schedule = step_schedule(facts)
        assert schedule_from_dict(json.loads(json.dumps(schedule_to_dict(schedule)))) == schedule


def test_the_runs_own_gpu_another_size_and_one_too_small(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, figures = _run_dir(tmp_path)
    step = step_schedule(StepFacts(colocate=True, offload_train=True, critic=True))
    least, most = capacity_range(step, figures.model, planned_roles=planned_roles(step))
    margin = figures.budget.margin

    assert cli(["memory-plan", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "planned for 60.0 GiB less a margin of 4.0 GiB" in out
    assert step.describe() in out
    assert f"from {(most + margin) / GIB:.1f} GiB the actor, the critic and the engines stay resident" in out
    assert "moves 0.0 MiB a step" not in out, "60 GiB is too small for all of it: the plan moves"

    # Room for everything: nothing of the actor's and the critic's moves.
    assert cli(["memory-plan", str(run_dir), "--gpu-memory-gib", str((most + margin) / GIB + 1)]) == 0
    roomy = capsys.readouterr().out
    assert roomy.count("moves 0.0 MiB a step") == 2  # the step's schedule and the save's

    # Below the least: refused in one line naming the turn and its numbers, exit 2.
    small = (least + margin) / GIB - 0.5
    assert cli(["memory-plan", str(run_dir), "--gpu-memory-gib", f"{small:.3f}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ppo-driver memory-plan: error: turn "), err
    assert "available" in err[0] and "Give the GPU more room" in err[0]


def test_a_folder_without_a_plan_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["memory-plan", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'memory_plan.json'}: no such file" in err and "--memory-plan fit" in err
    (tmp_path / "memory_plan.json").write_text("{}")
    assert cli(["memory-plan", str(tmp_path)]) == 2
    assert "not a memory plan this version reads" in capsys.readouterr().err


def test_a_gpu_on_which_the_trains_fit_only_with_their_state_woken_for_the_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Trains measured in two parts (6 GiB of passes, 1 GiB of step) and a small KV cache: the trains bind.
    # Each train holds 1.5 + 15 + 6 = 22.5 GiB with its state awake; with its moments asleep through the
    # passes, the larger of 1.5 + 7 + 6 and 1.5 + 15 + 1 = 17.5 GiB.
    split = TrainSplit(6 * GIB, 1 * GIB)
    run_dir, _ = _run_dir(tmp_path, kv_cache=4 * GIB, splits={"actor": split, "critic": split})
    assert cli(["memory-plan", str(run_dir), "--gpu-memory-gib", "24"]) == 0
    out = capsys.readouterr().out
    assert "| wakes for the optimizer step critic/optimizer_moments" in out
    assert "| wakes for the optimizer step actor/optimizer_moments" in out
    assert "and 16.0 GiB each way for each optimizer step of the trains that wake it" in out
    assert "fits from 21.5 GiB" in out  # 17.5 and the 4 GiB margin
    assert cli(["memory-plan", str(run_dir), "--gpu-memory-gib", "21.4"]) == 2
    assert "its train (passes, or step with its state woken)" in capsys.readouterr().err
