"""The lines printed at the end of a run name what the run folder holds, and only that."""

from __future__ import annotations

from pathlib import Path

from tandem.ppo.run.log import RunSummary


def _lines(run_dir: Path) -> dict[str, str]:
    summary = RunSummary(run_dir, 1, [{"reward/mean": 0.5}], eval_before={"eval/mean": 0.1})
    return {line.split(":", 1)[0]: line for line in summary.describe().splitlines()}


def test_tensorboard_is_named_only_where_the_run_writes_its_logs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "actor").mkdir(parents=True)
    lines = _lines(run_dir)  # a run with --no-tensorboard
    assert "tensorboard" not in lines and "run dir" in lines and "metrics" in lines
    assert lines["checkpoints"] == f"checkpoints:  {run_dir / 'actor'}"
    (run_dir / "tensorboard").mkdir()
    assert f"tensorboard --logdir {run_dir / 'tensorboard'}" in _lines(run_dir)["tensorboard"]
