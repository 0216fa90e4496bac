"""The run's processes coming up and going down: setup (inputs, Ray, groups, reward model, resume, logging), close.

`PPODriver.setup` and `PPODriver.close` call these; the driver keeps the step.
A start that fails leaves the run folder as it was (`RunFolder.commit` comes
last); `close` stops everything this start made, each part on its own, so that
one failure to stop does not keep the others running.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from typing import TYPE_CHECKING

from tandem.ppo.loop.cluster import start_groups, start_ray, weight_pack
from tandem.ppo.run.folder import RunFolder
from tandem.ppo.run.log import EventLog
from tandem.ppo.run.state import load_state
from tandem.ppo.run.worker_logs import driver_log, logs_dir

if TYPE_CHECKING:
    from tandem.ppo.loop.driver import PPODriver

__all__ = ["close", "setup"]

logger = logging.getLogger("tandem.ppo.driver")  # the run's lines, as before the split


def setup(driver: PPODriver) -> None:
    """Ray, placement groups, engines and train groups (concurrently), data, reward, logging.

    The run folder is locked first and changed only once everything is up
    (`RunFolder.commit`): a start that fails leaves it as it was. A run whose
    folder holds every rollout already starts nothing (`complete`).
    """
    config = driver.config
    driver.folder = RunFolder.open(config)
    if driver.folder.complete:
        return
    driver.events = EventLog(driver.run_dir / "events.jsonl", defer=True)
    setup_inputs(driver)
    setup_ray(driver)
    # From here on a failure is the run's own (the workers): its lines are kept in RUN_DIR/logs.
    driver._driver_log.enter_context(driver_log(driver.run_dir))
    driver.started_logs = True
    setup_groups(driver)
    setup_reward_model(driver)
    resume(driver)
    driver.folder.commit()
    driver.events.start()
    setup_metrics(driver)


def setup_inputs(driver: PPODriver) -> None:
    """Model folders, tokenizer, reward and prompts, each checked before Ray starts (`preflight`)."""
    from tandem.ppo.rollout.preflight import read_inputs

    inputs = read_inputs(driver.config, reward_model=driver._score_with_reward_model)
    driver.tokenizer, driver.reward_fn = inputs.tokenizer, inputs.reward_fn
    driver.dataset, driver.eval_dataset = inputs.dataset, inputs.eval_dataset


def setup_ray(driver: PPODriver) -> None:
    """Ray: the cluster at `--ray-address` (or RAY_ADDRESS), else a local one, with the worker-log hook."""
    from tandem.ppo.run.worker_logs import ray_runtime_env

    runtime_env = ray_runtime_env(driver.run_dir)
    driver._started_ray = start_ray(driver.config.ray_address, driver.config.local_gpus, runtime_env)


def setup_groups(driver: PPODriver) -> None:
    """The placement groups, the train groups and the engines; the models asleep when the plan says."""
    assert driver.folder is not None
    folder = driver.folder
    started = start_groups(
        driver.config, folder.actor_config(), folder.critic_config(), lock_file=folder.lock.path
    )
    driver.placements, driver.actor, driver.critic, driver.engines = started
    slots = {"actor": started.placements.actor, "rollout": started.placements.rollout}
    driver.events.record("placement", **{f"{k}_nodes": list(v.node_ips) for k, v in slots.items()})
    from tandem.ppo.run.worker_logs import group_workers, name_worker_logs

    roles = (("actor", driver.actor), ("critic", driver.critic), ("engine", driver.engines))
    name_worker_logs(
        driver.run_dir, [w for role, g in roles if g is not None for w in group_workers(role, g)]
    )
    driver.weight_pack = weight_pack(driver.config)
    driver.engines.on_restart = driver._engine_restarted
    driver.events.record("setup_done")
    if driver.plan.sleep_after_train:
        # Both models start awake; the engine needs the GPU first.
        for group in driver._models():
            driver._sleep(group)


def setup_reward_model(driver: PPODriver) -> None:
    """The reward model's workers (`--rm-type model`), on the rollout bundles; asleep when the plan says."""
    from tandem.ppo.rollout.reward_model import start_reward_model, uses_reward_model

    if not uses_reward_model(driver.config):
        return
    turn = driver.schedule_of(0).turn("reward_model", "score")  # the same turn in every step
    assert turn is not None
    driver.reward_model = start_reward_model(
        driver.config, driver.placements, events=driver.events, sleeps=turn.sleep_after
    )
    if driver.reward_model.sleeps:
        driver._sleep_reward_model()


def resume(driver: PPODriver) -> None:
    """The data cursor, RNG and metrics of the resumed rollout; the engines get the resumed actor's weights."""
    assert driver.folder is not None
    start = driver.folder.resume.next_rollout_id
    loaded = {g.role: g.start_rollout_id for g in driver._models()}
    if any(v != start for v in loaded.values()):
        raise RuntimeError(f"the models loaded other rollouts than {start - 1}: {loaded}")
    driver.start_rollout_id = start
    driver.weights_version = start
    if start > 0:
        state = load_state(driver.run_dir, start - 1)
        driver.dataset.load_state_dict(state.data)
        state.restore_rng()
        driver.metrics_so_far = list(state.metrics)  # steps 0 .. start - 1, saved with the state
        # The engines start from the HF folder: they need the resumed actor's weights.
        driver._sync_weights()
        logger.info("resumed after rollout %d", start - 1)


def setup_metrics(driver: PPODriver) -> None:
    """metrics.jsonl, TensorBoard, the progress bar and the trackers, from the resumed step on."""
    from tandem.ppo.run.metrics import MetricsLogger
    from tandem.ppo.run.trackers import open_trackers

    config, start = driver.config, driver.start_rollout_id
    driver.logger = MetricsLogger(
        driver.run_dir,
        total_steps=config.num_rollout,
        start_step=start,
        tensorboard=config.tensorboard,
        progress=config.progress,
        sinks=open_trackers(config),
    )


def close(driver: PPODriver) -> None:
    """Stop the workers and engines, release the placement groups, stop Ray if we started it."""
    import ray

    for name in ("logger", "events"):
        obj = getattr(driver, name, None)
        if obj is not None:
            with contextlib.suppress(Exception):
                obj.close()
    if driver.engines is not None:
        with contextlib.suppress(Exception):
            driver.engines.shutdown()
    if driver.reward_model is not None:
        with contextlib.suppress(Exception):
            driver.reward_model.shutdown()
    for group in driver._models():
        with contextlib.suppress(Exception):
            group.shutdown()
        with contextlib.suppress(Exception):
            group.kill()
    if driver.placements is not None:
        with contextlib.suppress(Exception):
            driver.placements.remove()
    if driver._started_ray and ray.is_initialized():
        ray.shutdown()
    driver._driver_log.close()
    if driver.folder is not None:
        if driver.refused and driver.folder.created and not driver.folder.committed:
            # Nothing ran: the error line says why, and the new folder goes as if never made.
            shutil.rmtree(logs_dir(driver.run_dir), ignore_errors=True)
        driver.folder.close()
