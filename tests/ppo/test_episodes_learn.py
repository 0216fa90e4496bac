"""Episodes learn: `ppo-driver demo --task recall`'s run, the demo's tiny model through the driver on the
CPU, passes a mark that no single-turn policy can reach.

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

from tandem.ppo._recall import RECALL_DEFAULTS, prepare_recall_demo
from tandem.ppo.config.file import unvalidated

from ._runs import read_jsonl, run_driver

pytestmark = pytest.mark.slow

STEPS = RECALL_DEFAULTS["num_rollout"]


def test_a_multi_turn_task_learns_past_the_single_turn_bound(tmp_path: Path, ray_cluster: str) -> None:
    # `ppo-driver demo --task recall`'s settings; no checkpoint but the last, no export.
    values = {**RECALL_DEFAULTS, "run_dir": str(tmp_path / "run"), "progress": False}
    config = unvalidated(prepare_recall_demo({**values, "save_interval": None, "export_hf": False}))
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
