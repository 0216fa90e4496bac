"""wandb and MLflow, offline on the CPU: they hold metrics.jsonl's scalars, step by step, and the resolved config."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from tandem.ppo.config.checks import check_trackers
from tandem.ppo.config.file import unvalidated
from tandem.ppo.run.metrics import MetricsLogger, read_metrics
from tandem.ppo.run.trackers import config_params, open_trackers

STEPS = [
    {"reward/mean": 0.25, "loss/policy": -0.5, "lifecycle/actor_sleep/pause_weights": 0.125},
    {"reward/mean": 0.5, "loss/policy": -0.25, "lifecycle/actor_sleep/pause_weights": 0.0625},
    {"reward/mean": 0.75, "loss/policy": 0.125, "lifecycle/actor_sleep/pause_weights": 0.03125},
]


def _log_run(config: Any) -> list[dict[str, Any]]:
    with MetricsLogger(
        config.run_dir, total_steps=3, tensorboard=False, progress=False, sinks=open_trackers(config)
    ) as log:
        for step, metrics in enumerate(STEPS):
            log.log(step, metrics)
    return read_metrics(config.run_dir)


# --- wandb's offline run file (`run-<id>.wandb`): a LevelDB-style log of Record protobufs -------------
_HEADER = 7  # ":W&B", a magic uint16 and a version byte
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    records, pos, pending = [], _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _wandb_history(run_file: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    history, config = [], {}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.append(row)
        elif kind in ("run", "config"):  # the config given to wandb.init, then any updates
            for item in (record.run.config if kind == "run" else record.config).update:
                config[item.key] = json.loads(item.value_json)
    return history, config


@pytest.mark.slow
def test_wandb_offline_holds_the_metrics_and_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = unvalidated(
        {
            "run_dir": str(tmp_path / "run"),
            "use_wandb": True,
            "wandb_mode": "offline",
            "wandb_group": "shared",
        }
    )
    rows = _log_run(config)
    import wandb

    wandb.teardown()  # wandb's service writes the run file out when it stops (at exit in a real run)
    run_files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, list((tmp_path / "run").rglob("*"))
    history, logged_config = _wandb_history(run_files[0])
    scalars = [{k: v for k, v in row.items() if not k.startswith("_")} for row in history]
    assert scalars == [{k: v for k, v in row.items() if k != "step"} for row in rows]
    assert [row["_step"] for row in history] == [row["step"] for row in rows]
    logged_config.pop("_wandb", None)
    assert logged_config == config_params(config)


@pytest.mark.slow
def test_mlflow_file_store_holds_the_metrics_and_the_config_as_parameters(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    config = unvalidated(
        {"run_dir": str(tmp_path / "run"), "use_mlflow": True, "mlflow_experiment_name": "e"}
    )
    rows = _log_run(config)
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert run.info.status == "FINISHED"
    for key in STEPS[0]:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(row["step"], row[key]) for row in rows]
    assert run.data.params == {k: str(v) for k, v in config_params(config).items()}


def test_a_missing_tracker_is_refused_naming_its_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a)
    )
    for flag, field in (("--use-wandb", "use_wandb"), ("--use-mlflow", "use_mlflow")):
        with pytest.raises(ValueError, match=rf"^{flag}: .* not installed; pip install 'tandem-ppo-driver\["):
            check_trackers(unvalidated({field: True}))
