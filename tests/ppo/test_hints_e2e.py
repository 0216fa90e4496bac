"""A run built not to learn is told why: one driver run trips every hint at once (CPU).

The demo with a learning rate far too small to move its weights (`--lr 1e-12`), a critic that
does not train (`--critic-lr 0`), a response limit of 2 tokens (the tiny model rarely ends an
answer with EOS, so nearly every response is cut) and a reward that depends on the prompt alone
(every sample of a prompt scores the same; the prompts differ by a thousandth, so the critic's
untrained values, which vary more than that, explain the returns far worse than their mean).
Each hint comes once, on the terminal and in driver.log and events.jsonl, naming its flag; the
plots show the figures. The demo as the README runs it gets none (tests/ppo/test_driver.py,
`test_demo_task_learns`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tandem.ppo.app.plot import plot_run
from tandem.ppo.run.health import FIRST_HINT_STEP, STATIC_WEIGHTS_FRACTION

from ._runs import demo_config, read_jsonl, run_driver

pytestmark = pytest.mark.slow

PROMPT_REWARD = '''
def prompt_reward(samples):
    """The same reward for every response to a prompt: a thousandth of its label."""
    return [int(s.label) / 1000 for s in samples]
'''

FLAGS = {
    "static_weights": "--lr",
    "tied_groups": "--n-samples-per-prompt",
    "critic": "--critic-lr",
    "truncated": "--rollout-max-response-len",
}


def test_a_run_that_cannot_learn_is_told_why_once(
    tmp_path: Path, ray_cluster: str, caplog: pytest.LogCaptureFixture
) -> None:
    reward = tmp_path / "prompt_reward.py"
    reward.write_text(PROMPT_REWARD)
    config = demo_config(
        tmp_path / "run",
        num_rollout=FIRST_HINT_STEP + 1,
        lr=1e-12,
        critic_lr=0.0,
        rollout_max_response_len=2,
        custom_rm_path=f"{reward}:prompt_reward",
        # Half the demo's prompts, and the models resident: the hints need steps, not their size.
        rollout_batch_size=8,
        offload_train=False,
        eval_interval=None,
        save_interval=None,
        export_hf=False,
    )
    with caplog.at_level(logging.WARNING, logger="tandem.ppo.hints"):
        summary = run_driver(config, ray_cluster)
    run_dir = tmp_path / "run"

    hints = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "hint"]
    assert sorted(h["name"] for h in hints) == sorted(FLAGS)  # each once
    assert {h["rollout_id"] for h in hints} == {FIRST_HINT_STEP - 1}  # as soon as a hint may come
    for hint in hints:
        assert FLAGS[hint["name"]] in hint["message"] and "\n" not in hint["message"]
    said = [r.getMessage() for r in caplog.records if r.name == "tandem.ppo.hints"]
    assert sorted(said) == sorted(f"hint: {h['message']}" for h in hints)  # the terminal's lines
    log = (run_dir / "logs" / "driver.log").read_text()
    assert all(f"hint: {h['message']}" in log for h in hints)

    by_name = {h["name"]: h["message"] for h in hints}
    assert "under half a float32 spacing" in by_name["static_weights"]
    assert by_name["tied_groups"].startswith("100% of prompts")
    assert "--critic-lr (now 0)" in by_name["critic"]
    assert "--rollout-max-response-len 2" in by_name["truncated"]
    last = summary.metrics[-1]
    assert last["policy/changed_fraction_since_start"] < STATIC_WEIGHTS_FRACTION
    assert last["reward/tied_groups"] == 1.0 and last["critic/explained_variance_window"] < -1
    # The plots draw the new figures, the weights' movement even where it stays near 0.
    assert {"policy.png", "reward.png", "critic.png"} <= {
        p.name for p in plot_run([run_dir], run_dir / "plots")
    }
