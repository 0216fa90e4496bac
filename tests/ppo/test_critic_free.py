"""Critic-free runs end to end on CPU: no critic starts, sleeps, wakes, trains or saves; the step has no critic phase.

The demo task (one logical GPU shared by the actor and the embedded engine),
with REINFORCE++-baseline and the KL in its rewards (the actor's own
reference pass: no KL-first plan), GSPO's loss and DAPO's overlong penalty;
then `--filter-truncated`, whose loss masks reach the actor's batches. One run,
since each start costs minutes on a small CPU machine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import ray

from tandem.ppo.config import PPOConfig
from tandem.ppo.loop.driver import PPODriver

from . import _runs as runs
from ._runs import read_jsonl

pytestmark = pytest.mark.slow


def demo_config(run_dir: Path, **overrides: Any) -> PPOConfig:
    return runs.demo_config(run_dir, **{"eval_interval": None, **overrides})


def test_critic_free_run_has_no_critic_anywhere(tmp_path: Path, ray_cluster: str) -> None:
    """REINFORCE++-baseline with the KL in its rewards, GSPO's loss and DAPO's overlong penalty."""
    # The demo's responses are one token long (its cap): each ends on the overlong buffer's last token.
    config = demo_config(
        tmp_path / "run",
        num_rollout=2,
        save_interval=1,
        export_hf=False,
        advantage_estimator="reinforce_plus_plus_baseline",
        loss_type="gspo",
        kl_coef=0.05,
        normalize_advantages=True,
        overlong_buffer_len=1,
        overlong_penalty_factor=0.5,
    )
    assert config.use_critic is False  # implied by the estimator
    seen: dict[str, Any] = {}

    def inspect(driver: PPODriver) -> None:
        seen.update(critic=driver.critic, roles=dict(driver.data_parallel_sizes))
        # `--filter-truncated` reaches the batches the actor trains on: mask 0 for responses cut at the cap.
        driver.config = dataclasses.replace(driver.config, filter_truncated=True)
        sampled = driver.draw(2)
        seen["rollout"] = sampled.rollout
        seen["batches"] = [ray.get(ref) for ref in sampled.data_refs["actor"]]

    summary = runs.run_driver(config, ray_cluster, after=inspect)
    assert (seen["critic"], seen["roles"]) == (None, {"actor": 1})

    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e for e in events if e.get("role") == "critic"] == []
    # Without a critic there is no KL-first plan: the actor computes its reference log-probs itself.
    assert not [e for e in events if e["event"] == "log_probs_begin"]
    # The actor's own plan is still followed: it trains, sleeps, wakes and saves each step.
    kinds = [(e["event"], e.get("role")) for e in events]
    assert kinds.count(("train_begin", "actor")) == 2 and kinds.count(("save", "actor")) == 2
    assert ("sleep", "actor") in kinds and ("wake", "actor") in kinds

    for metrics in summary.metrics:
        assert not [k for k in metrics if k.startswith(("critic/", "time/critic", "time/kl_first"))], metrics
        assert "loss/value" not in metrics
        assert 0.0 <= metrics["actor/tied_groups"] <= 1.0
        assert metrics["actor/grad_norm"] > 0
        assert "actor/reward_kl" in metrics
        assert metrics["reward/overlong_penalty"] == pytest.approx(-0.5)  # length 1 = the cap
        assert metrics["reward/shaped_mean"] == pytest.approx(metrics["reward/mean"] - 0.5)
    assert summary.metrics[1]["actor/reward_kl"] != 0  # after one update the policy has moved
    run_dir = tmp_path / "run"
    assert (run_dir / "actor").is_dir() and not (run_dir / "critic").exists()
    (checkpoints,) = [line for line in summary.describe().splitlines() if line.startswith("checkpoints:")]
    assert checkpoints.split()[1:] == [str(run_dir / "actor")]

    rollout, (batch,) = seen["rollout"], seen["batches"]
    truncated = [g.finish_reason == "length" for g in rollout.generations]
    assert any(truncated)
    assert [bool(m.sum() == 0) for m in batch.loss_masks] == truncated
    assert batch.rewards.tolist() == pytest.approx([r - 0.5 for r in rollout.rewards])
