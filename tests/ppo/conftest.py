"""Driver runs that several test modules read (each run costs tens of seconds on two cores)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray

from tandem.ppo.loop.driver import PPODriver, RunSummary
from tandem.ppo.loop.schedule import StepSchedule
from tandem.value_transfer import unpack_values

from ._runs import demo_config, read_jsonl, run_driver


@dataclass(frozen=True)
class KlFirstRun:
    """`kl_first_run`: what the run left and what was read from its driver before it stopped."""

    run_dir: Path
    config: Any
    summary: RunSummary
    events: list[dict[str, Any]]
    """The event log as the run's own steps and saves left it (before the reads below)."""
    schedules: list[StepSchedule]
    save: StepSchedule
    fresh_batch: Any
    """A rollout drawn after the run, on the final weights..."""
    fresh_log_probs: list[Any]
    """...and the actor's log-probs of it."""


@pytest.fixture(scope="session")
def kl_first_run(tmp_path_factory: pytest.TempPathFactory, ray_cluster: str) -> KlFirstRun:
    """Three demo steps on the shared logical GPU with the KL in the rewards (the KL-first plan: the
    actor's log-probs before the critic trains) steered by the adaptive controller, two critic
    passes a step, one critic-only warm-up step, a save every two rollouts and the HF export at
    the end: the run that tests/ppo/test_driver.py (the event order,
    the KL-first plan, the exported folder) and tests/ppo/test_schedule.py (each step's events in
    its schedule's order) read."""
    run_dir = tmp_path_factory.mktemp("kl-first") / "run"
    config = demo_config(
        run_dir,
        num_rollout=3,
        num_critic_only_steps=1,
        kl_coef=0.05,
        kl_target=0.01,  # the adaptive KL controller steers it
        critic_updates_per_step=2,  # SAO: two critic passes in its one turn
        save_interval=2,
        eval_interval=None,
    )
    kept: dict[str, Any] = {}

    def read(driver: PPODriver) -> None:
        kept["events"] = read_jsonl(run_dir / "events.jsonl")
        kept["schedules"] = [driver.schedule_of(k) for k in range(3)]
        kept["save"] = driver.save_schedule()
        sampled = driver.draw(3)
        assert driver.actor is not None
        driver.actor.run("wake_up")
        (out,) = ray.get(driver.actor.compute_log_probs(3, sampled.data_refs["actor"]))
        assert out is not None
        kept["fresh_batch"] = ray.get(sampled.data_refs["actor"][0])
        kept["fresh_log_probs"] = unpack_values(out.log_probs, "cpu")

    summary = run_driver(config, ray_cluster, after=read)
    return KlFirstRun(run_dir=run_dir, config=config, summary=summary, **kept)
