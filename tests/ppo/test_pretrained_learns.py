"""A pretrained model learns: SmolLM2-135M-Instruct through `ppo-driver`'s driver on the CPU, in one run.

The run is `ppo-driver demo --model smollm2`'s, with its defaults (the sums task of
`tandem.ppo._sums`, one critic-only step and five PPO steps): the real tokenizer and chat template, the actor, the
critic and the embedded engine sharing one logical GPU and sleeping in turn. The
greedy eval reward of the starting weights (`eval_before_train`, step -1) and of
the last step's are measured in the same run on held-out prompts. Then:

- the eval reward rises by at least 0.2 (the base model scores about 0.45);
- the critic's explained variance ends above 0 (it predicts the returns better than their mean);
- the KL to the reference weights stays finite;
- the exported `hf/` folder loads in transformers, and its greedy answers differ from the
  base model's on the eval prompts (and score more);
- metrics that were not computed are absent: no actor figures in the critic-only step, no
  entropy without an entropy bonus; every metrics line is strict JSON.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from tandem.ppo._sums import SUMS_DEFAULTS, write_sums_task
from tandem.ppo.config.file import unvalidated
from tandem.ppo.loop.training import train

pytestmark = pytest.mark.slow

STEPS = SUMS_DEFAULTS["num_rollout"]


def _greedy_answers(folder: Path, prompts: list[str]) -> list[str]:
    """transformers' own greedy answers (at most the run's 8 tokens) to the chat prompts, in one batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    # The attention mask marks the left padding by position: pad = eos here, so ids cannot tell.
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=SUMS_DEFAULTS["rollout_max_response_len"], do_sample=False
        )
    width = inputs["input_ids"].shape[1]
    return [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out]


def _score(answers: list[str], labels: list[str]) -> float:
    last = [re.findall(r"-?\d+", a)[-1:] for a in answers]
    return sum(n == [label] for n, label in zip(last, labels, strict=True)) / len(labels)


def _strict_json(line: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} in metrics.jsonl")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.timeout(1200)  # the bound: 20 minutes on two otherwise idle cores
def test_smollm2_learns_the_sums_task(smollm2: Path, tmp_path: Path, ray_cluster: str) -> None:
    train_file, eval_file = write_sums_task(tmp_path / "data")
    run_dir = tmp_path / "run"
    config = unvalidated(
        {
            **SUMS_DEFAULTS,
            "hf_checkpoint": str(smollm2),
            "prompt_data": str(train_file),
            "eval_prompt_data": str(eval_file),
            "run_dir": str(run_dir),
            "progress": False,
            "ray_address": ray_cluster,  # a job of the session's cluster (tests/conftest.py)
        }
    )
    summary = train(config)

    rows = [_strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The eval before training has a line of its own (step -1); the others join their step's.
    assert [r["step"] for r in rows if "reward/mean" in r] == list(range(STEPS))
    assert [r["step"] for r in rows if "eval/mean" in r] == [-1, 2, STEPS - 1]
    before, after = rows[0]["eval/mean"], rows[-1]["eval/mean"]
    assert before == summary.eval_before["eval/mean"]  # type: ignore[index]
    assert after >= before + 0.2, [(r["step"], r.get("eval/mean"), r.get("reward/mean")) for r in rows]

    steps = summary.metrics
    assert steps[-1]["critic/explained_variance"] > 0, [m["critic/explained_variance"] for m in steps]
    kl = [m["actor/kl_loss"] for m in steps[SUMS_DEFAULTS["num_critic_only_steps"] :]]
    assert all(math.isfinite(v) for v in kl), kl
    # Not computed, so absent (not NaN): the actor in the critic-only step, the entropy without a bonus.
    warmup = SUMS_DEFAULTS["num_critic_only_steps"]
    assert not any(k.startswith("actor/") or k == "loss/policy" for m in steps[:warmup] for k in m)
    assert all("actor/pg_loss" in m for m in steps[warmup:])
    assert not any("actor/entropy" in m for m in steps)

    # The exported actor is a Hugging Face model of its own, answering otherwise than the base model.
    prompts = [json.loads(line)["prompt"] for line in eval_file.read_text().splitlines()]
    labels = [json.loads(line)["label"] for line in eval_file.read_text().splitlines()]
    assert summary.hf_dir is not None
    base, trained = _greedy_answers(smollm2, prompts), _greedy_answers(summary.hf_dir, prompts)
    assert sum(a != b for a, b in zip(base, trained, strict=True)) >= 2, list(zip(base, trained, strict=True))
    assert _score(trained, labels) > _score(base, labels), (base, trained)
