"""`ppo-driver demo --model smollm2`: PPO on a pretrained instruct model, on a task it visibly gets better at.

The task is one-digit sums with a short answer: the user asks "What is a plus
b? Answer with a single number, nothing else." and the reward is 1 when the
last number of the response is `a + b`, 0 otherwise (`sum_reward`). The
response has at most 8 tokens, so an answer must come at once.

SmolLM2-135M-Instruct, greedy, often opens with "The answer is ..." and then
gets the sum wrong, while the answers that start with the equation
("3 + 4 = 7") are mostly right; sampled at the rollout temperature, it writes
each kind now and then. PPO with its critic moves the greedy answer towards
the equation form, so the greedy eval reward rises within a few steps. The
eval prompts (every fifth pair) are never trained on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tandem.ppo.app.pretrained import cache_root, cached_model, fetch_model, model_info

QUESTION = "What is {a} plus {b}? Answer with a single number, nothing else."
"""The user's message for the pair (a, b)."""

SUMS_DEFAULTS: dict[str, Any] = {
    "run_dir": "runs/demo-smollm2",
    "num_rollout": 6,
    "num_critic_only_steps": 1,
    "rollout_batch_size": 8,
    "n_samples_per_prompt": 4,
    "global_batch_size": 16,
    "micro_batch_size": 8,
    "rollout_max_response_len": 8,
    "max_prompt_len": 96,
    "temperature": 0.7,
    "lr": 1e-5,
    "critic_lr": 1e-4,
    "value_clip": None,
    "use_kl_loss": True,
    "kl_loss_coef": 0.01,
    "device": "cpu",
    "params_dtype": "float32",
    "offload_backend": "pinned_host",
    "local_gpus": 1,
    "custom_rm_path": "tandem.ppo._sums:sum_reward",
    "eval_interval": 3,
    "save_interval": None,
    "seed": 1,
}
"""The pretrained demo's settings (on the CPU); any flag given to `ppo-driver demo` overrides them."""

_NUMBER = re.compile(r"-?\d+")


def sum_reward(samples: list[Any]) -> list[float]:
    """1 where the last number in the response is the label (the sum), else 0."""
    scores = []
    for sample in samples:
        numbers = _NUMBER.findall(sample.response)
        scores.append(1.0 if numbers and numbers[-1] == str(sample.label) else 0.0)
    return scores


def write_sums_task(out_dir: str | Path) -> tuple[Path, Path]:
    """Train and eval JSONL of the sums task: pairs (a, b) of digits, every fifth pair held out for eval."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": QUESTION.format(a=a, b=b), "label": str(a + b)} for a in range(10) for b in range(10)]
    train, evaluation = out / "train.jsonl", out / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(rows) if i % 5 != 2))
    evaluation.write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(rows) if i % 5 == 2))
    return train, evaluation


def prepare_sums_demo(
    values: dict[str, Any], *, write: bool = True, root: str | Path | None = None
) -> dict[str, Any]:
    """Fill in SmolLM2 (fetched into the cache once) and the sums task under RUN_DIR, unless the flags name others.

    `write`, `root`: as `_demo.prepare_demo`'s. Without `write`, or with a `root` (the dry run's scratch
    folder), SmolLM2 is never fetched: a model not in the cache yet is a ValueError naming the command
    that fetches it.
    """
    base = Path(root if root is not None else values.get("run_dir", SUMS_DEFAULTS["run_dir"]))
    filled = dict(values)
    if not filled.get("hf_checkpoint"):
        cached = fetch_model("smollm2") if write and root is None else cached_model("smollm2")
        if cached is None:
            raise ValueError(
                f"--dry-run: SmolLM2-135M-Instruct is not in the cache yet ({cache_root() / model_info('smollm2').folder}), "
                "and a dry run fetches nothing; `ppo-driver fetch-model smollm2` fetches it (about half a minute "
                "once), then the dry run checks the config against it"
            )
        filled["hf_checkpoint"] = str(cached)
    if not filled.get("prompt_data"):
        folder = base / "data"
        train, evaluation = (
            write_sums_task(folder) if write else (folder / "train.jsonl", folder / "eval.jsonl")
        )
        filled["prompt_data"] = str(train)
        if filled.get("eval_prompt_data") is None:
            filled["eval_prompt_data"] = str(evaluation)
    return filled
