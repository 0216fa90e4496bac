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


def test_a_driver_state_holds_the_last_steps_metrics_and_a_resume_reads_the_rest_from_metrics_jsonl(
    tmp_path: Path,
) -> None:
    """Each state held every step's metrics, so that a run's states grew with the square of its length
    (3 kB a step: 1.6 MB a state at step 500, 16 GB of states over 10,000 steps saved every 10);
    metrics.jsonl holds them already."""
    import json

    from tandem.ppo.run.metrics import MetricsLogger
    from tandem.ppo.run.state import DriverState, metrics_before, save_state

    history = [
        {"reward/mean": k / 10, "critic/explained_variance": float("nan") if k == 2 else 0.5}
        for k in range(6)
    ]
    with MetricsLogger(tmp_path, total_steps=10, tensorboard=False, progress=False) as logger:
        logger.log(-1, {"eval/mean": 0.1})  # the eval before training: no step of the run
        for k, metrics in enumerate(history):
            logger.log(k, metrics)
    path = save_state(tmp_path, DriverState.capture(5, {"epoch": 0, "cursor": 5}, history))
    saved = DriverState(**json.loads(path.read_text()))
    assert saved.metrics == history[-1:]
    resumed = metrics_before(tmp_path, 4, saved)  # a start that resumes after rollout 3
    assert [m["reward/mean"] for m in resumed] == [0.0, 0.1, 0.2, 0.3]
    assert resumed[2]["critic/explained_variance"] is None  # NaN is null in metrics.jsonl
    (tmp_path / "metrics.jsonl").unlink()
    older = DriverState(3, {}, metrics=history[:4])  # a state written before: every step's metrics
    assert metrics_before(tmp_path, 4, older) == history[:4]
