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
observation. tests/ppo/test_episodes_learn.py trains the demo's model on it past both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["RecallEnv", "write_recall_task"]

FIRST_PROMPT = "go"


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
