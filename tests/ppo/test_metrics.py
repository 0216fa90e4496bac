"""Metrics: the jsonl file and its truncation on resume, TensorBoard events, and PNG plots."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from tandem.ppo.app.plot import plot_run
from tandem.ppo.run.metrics import MetricsLogger, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_scalars(tensorboard_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], list[int]]:
    """Scalars and purge (SessionLog START) steps of every event file: TFRecord frames of Event protos."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    starts = []
    for path in sorted(tensorboard_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4  # length, its crc, the record, its crc
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                starts.append(event.step)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars, starts


def log_steps(run_dir: Path, steps: range, **kwargs: Any) -> None:
    with MetricsLogger(run_dir, total_steps=10, progress=False, **kwargs) as logger:
        for step in steps:
            logger.log(step, {"reward/mean": step / 10, "loss/policy": -step, "time/step": 1.5})


def test_jsonl_round_trip(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, total_steps=3, progress=False) as logger:
        logger.log(0, {"reward/mean": 0.25, "loss/value": 1.0, "prompts/dropped": 2})
        # Written and flushed at once: a crash right now would lose nothing.
        assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
            "step": 0,
            "reward/mean": 0.25,
            "loss/value": 1.0,
            "prompts/dropped": 2,
        }
        logger.log(1, {"reward/mean": 0.5, "loss/value": float("nan")})
        logger.log(1, {"eval/accuracy": 0.75})  # eval metrics at the same step: a line of their own
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [0, 1, 1]
    assert rows[0] == {"step": 0, "reward/mean": 0.25, "loss/value": 1.0, "prompts/dropped": 2}
    # Strict JSON: an undefined value is null (a bare NaN is not JSON), read back as None.
    assert rows[1]["loss/value"] is None
    assert '"loss/value": null' in (tmp_path / "metrics.jsonl").read_text().splitlines()[1]
    assert rows[2] == {"step": 1, "eval/accuracy": 0.75}


def test_tensorboard_gets_every_scalar(tmp_path: Path) -> None:
    log_steps(tmp_path, range(3))
    scalars, _ = read_scalars(tmp_path / "tensorboard")
    assert scalars["reward/mean"] == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert scalars["loss/policy"] == [(0, 0.0), (1, -1.0), (2, -2.0)]
    assert set(scalars) == {"reward/mean", "loss/policy", "time/step"}


def test_resume_drops_the_steps_that_will_be_redone(tmp_path: Path) -> None:
    log_steps(tmp_path, range(6))  # a run killed after step 5; its last checkpoint was after step 3
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "reward/me')  # and torn while writing step 6
    assert [row["step"] for row in read_metrics(tmp_path)] == list(range(6))  # the torn line is skipped

    log_steps(tmp_path, range(4, 8), start_step=4)
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == list(range(8))
    assert not list(tmp_path.glob(".metrics.jsonl.*"))  # the temporary file of the atomic rewrite is gone

    # TensorBoard is told to discard the killed run's events from step 4 on.
    _, starts = read_scalars(tmp_path / "tensorboard")
    assert 4 in starts


def test_resume_without_anything_to_drop_leaves_the_file_alone(tmp_path: Path) -> None:
    log_steps(tmp_path, range(3))
    before = (tmp_path / "metrics.jsonl").stat()
    log_steps(tmp_path, range(3, 3), start_step=3)
    after = (tmp_path / "metrics.jsonl").stat()
    assert (before.st_ino, before.st_size) == (after.st_ino, after.st_size)


def test_bad_metrics_are_refused(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, total_steps=1, progress=False, tensorboard=False) as logger:
        with pytest.raises(TypeError, match="'reward/mean' is 'high', not a number"):
            logger.log(0, {"reward/mean": "high"})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match='named "step"'):
            logger.log(0, {"step": 1.0})
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(RuntimeError, match="after close"):
        logger.log(0, {})
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnonsense\n{"step": 1}\n')
    with pytest.raises(ValueError, match="line 2: not a metrics line"):
        read_metrics(tmp_path)
    with pytest.raises(ValueError, match="does not exist; pass a run directory"):
        read_metrics(tmp_path / "nope")


def test_progress_bar_shows_the_key_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with MetricsLogger(tmp_path, total_steps=4, start_step=1, tensorboard=False) as logger:
        logger.log(1, {"reward/mean": 0.123456, "loss/policy": 2.0, "time/step": 3.0})
    err = capsys.readouterr().err
    assert "2/4" in err
    assert "reward/mean=0.1235" in err
    assert "time/step" not in err


def test_progress_bar_says_what_the_step_is_doing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """While a phase runs (a first step's critic train on a CPU takes half a minute), the bar names it;
    the phases reach it from the driver's clock (`PhaseClock.on_begin`)."""
    from tandem.ppo.run.log import PhaseClock

    clock = PhaseClock(track_gpu_memory=False)
    with MetricsLogger(tmp_path, total_steps=6, tensorboard=False) as logger:
        clock.on_begin = logger.status
        with clock.phase("eval"):
            assert capsys.readouterr().err.endswith(
                "step 0: eval, generating and scoring:   0%|          | 0/6 [00:00<?, ?step/s]"
            )
        clock.announce("generate")
        with clock.phase("critic_train"):
            assert "step 0: critic training:   0%|" in capsys.readouterr().err
        logger.log(0, {"reward/mean": 0.5})
        with clock.phase("save"):  # the step just logged, and its wakes and sleeps are the save's
            assert "step 0: saving the checkpoint:  17%|" in capsys.readouterr().err
            with clock.phase("critic_wake"):
                assert capsys.readouterr().err == ""
        with clock.phase("actor_wake"):
            assert "step 1: actor waking:  17%|" in capsys.readouterr().err
    assert "time/critic_train" in clock.values


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    assert width >= 300 and height >= 200
    assert len(data) > 5000


def test_plot_overlays_runs_one_png_per_group(tmp_path: Path) -> None:
    log_steps(tmp_path / "shared", range(5))
    log_steps(tmp_path / "resident", range(3))
    with MetricsLogger(tmp_path / "shared", total_steps=6, start_step=5, progress=False) as logger:
        logger.log(5, {"tokens_per_s": 100.0, "memory/gpu_gib": 1.0})
    paths = plot_run([tmp_path / "shared", tmp_path / "resident"], tmp_path / "plots")
    assert [p.name for p in paths] == ["loss.png", "memory.png", "other.png", "reward.png", "time.png"]
    for path in paths:
        assert_png(path)

    with pytest.raises(ValueError, match="one label per run"):
        plot_run([tmp_path / "shared"], tmp_path / "plots", labels=["a", "b"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_run([tmp_path / "empty"], tmp_path / "plots")


def test_plot_single_point_and_many_metrics(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, total_steps=1, progress=False, tensorboard=False) as logger:
        logger.log(0, {f"loss/part{i}": float(i) for i in range(7)})
    (path,) = plot_run([tmp_path], tmp_path / "plots", labels=["only"])
    assert_png(path)
    assert path.parent == tmp_path / "plots"


def _strict_json(line: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_undefined_values_are_null_in_strict_json_and_skipped_in_tensorboard(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, total_steps=2, progress=False) as logger:
        # Step 0 of a run whose returns are all equal: the explained variance is undefined.
        logger.log(0, {"critic/explained_variance": float("nan"), "reward/mean": 0.5})
        logger.log(1, {"critic/explained_variance": 0.25, "grad_norm": float("inf")})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [_strict_json(line) for line in lines]  # a strict parser takes every line
    assert rows[0] == {"step": 0, "critic/explained_variance": None, "reward/mean": 0.5}
    assert rows[1] == {"step": 1, "critic/explained_variance": 0.25, "grad_norm": None}
    scalars, _ = read_scalars(tmp_path / "tensorboard")
    assert scalars["critic/explained_variance"] == [(1, 0.25)]
    assert "grad_norm" not in scalars


def test_resume_rewrites_an_older_files_nan_as_null(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "v": NaN}\n{"step": 1, "v": 1.0}\n')
    with MetricsLogger(tmp_path, total_steps=2, start_step=1, progress=False):
        pass
    assert [_strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 0, "v": None}
    ]


def test_the_adaptive_kl_coefficient_is_replayed_from_the_steps_so_far() -> None:
    # kl_coef 0.01, target 0.1, horizon 1000, 8 × 4 = 32 samples a step (K_β = 0.032). Step 0 is a critic-only
    # warm-up (its KL is the critic's), step 1 the actor's: KL 0.3 → error clipped to 0.2, KL 0.1 → 0.
    # The next step's coefficient: 0.01 · (1 + 0.2 · 0.032) · (1 + 0) = 0.010064. A resumed run has the same
    # history back with its state, hence the same coefficient.
    from tandem.ppo.config import PPOConfig
    from tandem.ppo.loop.step_metrics import kl_coef_of_step

    config = PPOConfig(
        rollout_batch_size=8, n_samples_per_prompt=4, kl_coef=0.01, kl_target=0.1, kl_horizon=1000
    )
    history = [{"critic/reward_kl": 0.3}, {"actor/reward_kl": 0.1, "critic/reward_kl": 0.1}]
    assert kl_coef_of_step(config, []) == 0.01
    assert kl_coef_of_step(config, history) == pytest.approx(0.010064)
    # Without a target the coefficient is the workers' own kl_coef: nothing to pass.
    fixed = PPOConfig(rollout_batch_size=8, n_samples_per_prompt=4, kl_coef=0.01)
    assert kl_coef_of_step(fixed, history) is None


def test_a_roles_train_time_is_the_slowest_ranks_by_part() -> None:
    from tandem.megatron.payloads import TrainResult
    from tandem.ppo.loop.step_metrics import role_metrics

    ranks = [
        TrainResult(
            metrics={"pg_loss": 0.5}, train_time={"passes": 1.0, "optimizer_step": 0.5, "total": 2.0}
        ),
        TrainResult(
            metrics={"pg_loss": 0.5}, train_time={"passes": 1.5, "optimizer_step": 0.25, "total": 1.9}
        ),
    ]
    assert role_metrics("actor", ranks) == {
        "actor/pg_loss": 0.5,
        "train_time/actor/passes": 1.5,
        "train_time/actor/optimizer_step": 0.5,
        "train_time/actor/total": 2.0,
    }
