"""Episodes learn: the demo's tiny model, through the driver on the CPU, passes a mark that no
single-turn policy can reach, in one run.

The task is `tandem.ppo._recall`'s: the first prompt says `go`, the environment answers the model's
first turn with a hidden digit, and the second turn is rewarded 1 for repeating it (0.1 for another
digit). A policy that does not read the environment's reply is right once in ten on average (mean
reward at most 0.19, accuracy at most 0.1; the module docstring proves it), and the greedy eval of the
starting weights is exactly that. In the same run:

- the greedy eval accuracy ends at 0.3 or more (three times the single-turn bound) and the training
  accuracy of the last steps is past 0.2;
- every episode has its two turns, none failed, none was truncated;
- the critic predicts the returns better than their mean at the end (explained variance > 0), on the
  model's tokens only (the context is masked out of both models' losses).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.ppo._recall import write_recall_task

from ._runs import demo_config, read_jsonl, run_driver

pytestmark = pytest.mark.slow

STEPS = 40


def test_a_multi_turn_task_learns_past_the_single_turn_bound(tmp_path: Path, ray_cluster: str) -> None:
    data = write_recall_task(tmp_path / "data")
    config = demo_config(
        tmp_path / "run",
        env_path="tandem.ppo._recall:RecallEnv",
        custom_rm_path=None,
        prompt_data=str(data),
        eval_prompt_data=str(data),
        max_turns=2,
        num_rollout=STEPS,
        eval_interval=STEPS // 2,
        save_interval=None,
        export_hf=False,
    )
    run_driver(config, ray_cluster)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert evals[0]["step"] == -1 and evals[0]["eval/accuracy"] == pytest.approx(0.1)
    assert evals[-1]["eval/accuracy"] >= 0.3, [e["eval/accuracy"] for e in evals]
    steps = [m for m in metrics if "reward/accuracy" in m]
    assert len(steps) == STEPS
    last = steps[-3:]
    assert sum(m["reward/accuracy"] for m in last) / 3 > 0.2, [m["reward/accuracy"] for m in steps]
    assert all(m["episodes/turns"] == 2 and m["episodes/end_done"] == 1 for m in steps)
    assert all(m["episodes/failed"] == 0 for m in steps)
    assert steps[-1]["critic/explained_variance"] > 0
