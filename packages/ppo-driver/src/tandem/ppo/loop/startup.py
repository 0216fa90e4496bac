"""The run's processes coming up, part by part: the run folder, Ray, the roles on the GPUs, the reward model,
the teacher, the resumed state, the metrics.

`PPODriver.setup` calls these in order. Each returns what it started and puts how to
stop it on the driver's `closing` stack, which `PPODriver.close` unwinds in reverse
order, each part on its own, so that one failure to stop does not keep the others
running. A start that fails leaves the run folder as it was (`RunFolder.commit` comes
last).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from tandem.ppo.loop.cluster import start_groups, start_ray, weight_pack
from tandem.ppo.loop.shared_gpus import SharedGpus
from tandem.ppo.rollout.reward_model import start_reward_model
from tandem.ppo.rollout.teacher import start_teacher as start_teacher_role
from tandem.ppo.run.folder import RunFolder
from tandem.ppo.run.metrics import MetricsLogger
from tandem.ppo.run.state import load_state, metrics_before
from tandem.ppo.run.trackers import open_trackers
from tandem.ppo.run.worker_logs import group_workers, logs_dir, name_worker_logs, ray_runtime_env

if TYPE_CHECKING:
    from tandem.placement import Placements
    from tandem.ppo.config.ppo_config import PPOConfig
    from tandem.ppo.rollout.data import PromptDataset
    from tandem.ppo.run.log import EventLog, PhaseClock

__all__ = [
    "open_folder",
    "open_metrics",
    "quietly",
    "resume",
    "start_cluster",
    "start_reward",
    "start_roles",
    "start_teacher",
]

# The name the run's lines show on the terminal, as before the split of the driver.
logger = logging.getLogger("tandem.ppo.driver")


def quietly(stop: Callable[[], Any]) -> Callable[[], None]:
    """`stop`, its failure ignored: one part that fails to stop must not keep the others running."""

    def call() -> None:
        with contextlib.suppress(Exception):
            stop()

    return call


def open_folder(
    config: PPOConfig, closing: contextlib.ExitStack, *, refused: Callable[[], bool]
) -> RunFolder:
    """RUN_DIR locked and its resume point found (`RunFolder.open`, before Ray: nothing written but the lock).

    On close the lock is released; a folder this start created, where nothing ran (`refused`:
    the start was refused for its input), goes as if never made, logs and all.
    """
    folder = RunFolder.open(config)

    def close() -> None:
        if refused() and folder.created and not folder.committed:
            shutil.rmtree(logs_dir(folder.path), ignore_errors=True)
        folder.close()

    closing.callback(close)
    return folder


def start_cluster(config: PPOConfig, run_dir: Path, closing: contextlib.ExitStack) -> None:
    """Ray: the cluster at `--ray-address` (or RAY_ADDRESS), else a local one, with the worker-log hook;
    stopped on close when this start started it."""
    if start_ray(config.ray_address, config.local_gpus, ray_runtime_env(run_dir)):
        closing.callback(lambda: ray.shutdown() if ray.is_initialized() else None)


def start_roles(
    config: PPOConfig,
    folder: RunFolder,
    *,
    events: EventLog,
    clock: PhaseClock,
    closing: contextlib.ExitStack,
    stopping_now: Callable[[], bool] = lambda: False,
) -> tuple[Placements, SharedGpus]:
    """The placement groups, the train groups and the engines (concurrently), as the roles on the GPUs (all
    awake), each worker's log named after its role and rank.

    On close they stop (`SharedGpus.shutdown`), killed without a shutdown call once `stopping_now` (a
    signal stopped the run in the middle of a step)."""
    started = start_groups(config, folder.actor_config(), folder.critic_config(), lock_file=folder.lock.path)
    closing.callback(quietly(started.placements.remove))
    gpus = SharedGpus(
        engines=started.engines,
        actor=started.actor,
        critic=started.critic,
        events=events,
        clock=clock,
        weight_pack=weight_pack(config),
        sync_adapters=config.syncs_adapters,
    )
    closing.callback(lambda: gpus.shutdown(graceful=not stopping_now()))
    slots = {"actor": started.placements.actor, "rollout": started.placements.rollout}
    events.record("placement", **{f"{k}_nodes": list(v.node_ips) for k, v in slots.items()})
    roles = (("actor", gpus.actor), ("critic", gpus.critic), ("engine", gpus.engines))
    name_worker_logs(folder.path, [w for role, g in roles if g is not None for w in group_workers(role, g)])
    events.record("setup_done")
    return started.placements, gpus


def start_reward(config: PPOConfig, placements: Placements, gpus: SharedGpus, *, events: EventLog) -> None:
    """The reward model's workers (`--rm-type model`), one per rollout bundle, among the roles on the GPUs
    (stopped with them)."""
    gpus.add_reward_model(start_reward_model(config, placements, events=events))


def start_teacher(config: PPOConfig, placements: Placements, gpus: SharedGpus, *, events: EventLog) -> None:
    """The distillation teacher's workers (`--teacher-hf-checkpoint`), one per rollout bundle, among the roles on
    the GPUs (stopped with them)."""
    gpus.add_teacher(start_teacher_role(config, placements, events=events))


def resume(folder: RunFolder, gpus: SharedGpus, dataset: PromptDataset) -> tuple[int, list[dict[str, Any]]]:
    """The rollout this start trains first, and the metrics before it: the models' loaded rollout, the
    data cursor and RNG restored, the engines given the resumed actor's weights."""
    start = folder.resume.next_rollout_id
    loaded = {g.role: g.start_rollout_id for g in gpus.models()}
    if any(v != start for v in loaded.values()):
        raise RuntimeError(f"the models loaded other rollouts than {start - 1}: {loaded}")
    gpus.weights_version = start
    if start == 0:
        return start, []
    state = load_state(folder.path, start - 1)
    dataset.load_state_dict(state.data)
    state.restore_rng()
    # The engines start from the HF folder: they need the resumed actor's weights.
    gpus.sync_weights()
    logger.info("resumed after rollout %d", start - 1)
    return start, metrics_before(folder.path, start, state)  # steps 0 .. start - 1


def open_metrics(config: PPOConfig, start: int, closing: contextlib.ExitStack) -> MetricsLogger:
    """metrics.jsonl, TensorBoard, the progress bar and the trackers, from the resumed step on."""
    metrics = MetricsLogger(
        config.run_dir,
        total_steps=config.num_rollout,
        start_step=start,
        tensorboard=config.tensorboard,
        progress=config.progress,
        sinks=open_trackers(config),
    )
    closing.callback(quietly(metrics.close))
    return metrics
