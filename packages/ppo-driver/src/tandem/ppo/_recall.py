"""A multi-turn task for the demo's tiny model: the second answer must repeat what the first observation said.

The episode (`RecallEnv`): the first prompt is `go`; whatever the model answers, the
environment then shows it the hidden digit `d` of the sample (its label); the model's second
answer is rewarded 1 when it is `d`, 0.1 when it is another single digit (a format reward, as
the demo's), 0 otherwise, and the episode ends.

Why a single-turn policy cannot pass 0.19: such a policy writes its whole response without
seeing the environment's reply, and the first prompt is the same for every digit, so its
answer is independent of `d`. With `d` uniform over the ten digits (`write_recall_task`), any
answer is right with probability 1/10: the mean reward is at most 0.1 · 1 + 0.9 · 0.1 = 0.19 and
the accuracy (reward 1) at most 0.1, greedy or not. A policy above either mark reads the
observation. `ppo-driver demo --task recall` trains the demo's model on it (`RECALL_DEFAULTS`), and
tests/ppo/test_episodes_learn.py checks that it passes both marks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.ppo._demo import DEMO_DEFAULTS, build_base_model

__all__ = ["RECALL_DEFAULTS", "RecallEnv", "prepare_recall_demo", "write_recall_task"]

FIRST_PROMPT = "go"

RECALL_DEFAULTS: dict[str, Any] = {
    **DEMO_DEFAULTS,
    "run_dir": "runs/demo-recall",
    "env_path": "tandem.ppo._recall:RecallEnv",
    "custom_rm_path": None,
    "max_turns": 2,
    "num_rollout": 40,
    "eval_interval": 20,
}
"""`ppo-driver demo --task recall`: the demo's model and settings, episodes of two turns, 40 steps."""


class RecallEnv:
    """One episode of the recall task (see the module docstring)."""

    def __init__(self) -> None:
        self.digit = ""

    def reset(self, sample: Any) -> str:
        self.digit = str(sample.label)
        return FIRST_PROMPT

    def step(self, turn: Any) -> tuple[str | None, float, bool]:
        if turn.index == 0:
            return self.digit, 0.0, False
        answer = turn.text.strip()
        reward = 1.0 if answer == self.digit else 0.1 if len(answer) == 1 and answer.isdigit() else 0.0
        return None, reward, True


def write_recall_task(out_dir: str | Path) -> Path:
    """The task's JSONL: one line per digit, `{"prompt": "go", "label": "d"}` (the environment reads the label)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "recall.jsonl"
    path.write_text("".join(json.dumps({"prompt": FIRST_PROMPT, "label": str(d)}) + "\n" for d in range(10)))
    return path


def prepare_recall_demo(
    values: dict[str, Any], *, write: bool = True, root: str | Path | None = None
) -> dict[str, Any]:
    """Fill in the demo's model and the recall task under RUN_DIR, unless the flags name others.

    `write` and `root` as in `prepare_demo` (False: only name where they go; `root`: build them there).
    """
    base = Path(root if root is not None else values.get("run_dir", RECALL_DEFAULTS["run_dir"]))
    filled = dict(values)
    if not filled.get("hf_checkpoint"):
        filled["hf_checkpoint"] = str(build_base_model(base / "base") if write else base / "base")
    if not filled.get("prompt_data"):
        task = base / "data"
        filled["prompt_data"] = str(write_recall_task(task) if write else task / "recall.jsonl")
        if filled.get("eval_prompt_data") is None:
            filled["eval_prompt_data"] = filled["prompt_data"]
    return filled
