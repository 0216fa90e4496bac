"""Experiment trackers: wandb and MLflow get the scalars of metrics.jsonl and the resolved config.

`--use-wandb` (slime's flags: `--wandb-project`, `--wandb-group`, `--wandb-team`,
`--wandb-mode offline`) and `--use-mlflow` (`--mlflow-tracking-uri`, a local
`file:` store under RUN_DIR by default; `--mlflow-experiment-name`) each add a
sink to the run's `MetricsLogger`: every `log(step, metrics)` reaches them with
the same names and values as metrics.jsonl's line, and the run's resolved config
is logged once as the tracker's config (wandb) or parameters (MLflow). Each is an
extra (`tandem-ppo-driver[wandb]`, `tandem-ppo-driver[mlflow]`), imported only
when asked for; a missing one fails validation naming the flag and the install
(`config.checks.check_trackers`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

__all__ = ["MlflowSink", "TrackerSink", "WandbSink", "config_params", "open_trackers"]

MLFLOW_PARAMS_PER_CALL = 100
"""MLflow's limit on the parameters of one `log_batch` request."""

MLFLOW_PARAM_CHARS = 6000
"""MLflow's limit on one parameter value's length."""


class TrackerSink(Protocol):
    """What `MetricsLogger` writes each step's metrics to, besides metrics.jsonl."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record one step's scalars."""

    def close(self) -> None:
        """Finish the tracker's run."""


def config_params(config: Any) -> dict[str, Any]:
    """The resolved config as plain values (tuples as lists), what the trackers record."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


class WandbSink:
    """A wandb run: the config once, then each step's scalars at that step."""

    def __init__(self, config: Any) -> None:
        import wandb

        run_dir = Path(config.run_dir)
        self.run: Any = wandb.init(
            project=config.wandb_project,
            entity=config.wandb_team,
            group=config.wandb_group,
            name=config.wandb_run_name or run_dir.resolve().name,
            mode=config.wandb_mode,
            dir=str(Path(config.wandb_dir or run_dir).resolve()),
            config=config_params(config),
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """One step's scalars (wandb needs steps that never go back: a resumed run's are later)."""
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        """Finish the run (an offline one stays in WANDB_DIR for `wandb sync`)."""
        self.run.finish()


class MlflowSink:
    """An MLflow run in `--mlflow-tracking-uri` (a `file:` store under RUN_DIR by default)."""

    def __init__(self, config: Any) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = config.mlflow_tracking_uri or Path(config.run_dir, "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store only on request; a run folder's own store is what we want
            # (a database backend needs SQLAlchemy, which mlflow-skinny leaves out).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client: Any = MlflowClient(tracking_uri=uri)
        name = config.mlflow_experiment_name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        run = self.client.create_run(experiment_id, run_name=Path(config.run_dir).resolve().name)
        self.run_id: str = run.info.run_id
        self.tracking_uri = uri
        params = [Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in config_params(config).items()]
        for start in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[start : start + MLFLOW_PARAMS_PER_CALL])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """One step's scalars as MLflow metrics at that step."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow's limit on the metrics of one request
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def close(self) -> None:
        """End the run."""
        self.client.set_terminated(self.run_id)


def open_trackers(config: Any) -> list[TrackerSink]:
    """The sinks the config asks for (none by default)."""
    sinks: list[TrackerSink] = []
    if getattr(config, "use_wandb", False):
        sinks.append(WandbSink(config))
    if getattr(config, "use_mlflow", False):
        try:
            sinks.append(MlflowSink(config))
        except BaseException:
            for sink in sinks:
                sink.close()
            raise
    return sinks
