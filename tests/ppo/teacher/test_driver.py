"""On-policy distillation alone on the shared logical GPU: the student's per-token reverse KL to its teacher falls.

The student is the demo's untrained base model; the teacher is that same model
taught the demo's task in this process (a few dozen cross-entropy steps on "d+1"
-> "d+1"'s digit). The run has no reward at all (`--rm-type none`): the teacher's
per-token reverse KL, folded into the rewards (`--opd-mode reward`, with the critic:
the KL-first plan), is the only signal. One run serves: the reverse KL of the
student's samples to the teacher falls over the steps; every step's events follow
its schedule (the teacher wakes after the engine released its memory, gives its
log-probs and sleeps before the actor's log-probs and the critic).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.ppo.loop.driver import PPODriver

from .._runs import demo_config, read_jsonl, run_driver
from ..test_schedule import check_run_follows_its_schedules

pytestmark = pytest.mark.slow

STEPS = 20
TEACHER_STEPS = 40
"""The teacher's cross-entropy steps from the student's weights (lr 1e-2): most prompts answered right."""


def prompt_ids(tokenizer: Any, d: int) -> list[int]:
    """The demo's prompt "d+1" as the driver tokenizes it (the chat template, its special tokens its own)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{d}+1"}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def build_teacher(folder: Path) -> Path:
    """The student itself (the demo's base model, its seed) a few cross-entropy steps towards each prompt's digit:
    a teacher that knows the task, on the student's tokenizer, close enough that the student's own samples
    cover what it prefers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.ppo._demo import build_base_model

    build_base_model(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    rows = [prompt_ids(tokenizer, d) for d in range(9)]
    answers = torch.tensor([tokenizer.convert_tokens_to_ids(str(d + 1)) for d in range(9)])
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):  # right-padded: the answer is predicted at each row's last prompt token
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    last = torch.tensor([len(r) - 1 for r in rows])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(TEACHER_STEPS):
        logits = model(input_ids=ids, attention_mask=mask).logits[torch.arange(len(rows)), last]
        loss = torch.nn.functional.cross_entropy(logits, answers)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def distilled(tmp_path_factory: pytest.TempPathFactory, ray_cluster: str) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("distill")
    teacher = build_teacher(root / "teacher")
    run_dir = root / "run"
    config = demo_config(
        run_dir,
        num_rollout=STEPS,
        custom_rm_path=None,
        rm_type="none",
        teacher_hf_checkpoint=str(teacher),
        opd_coef=1.0,
        entropy_coef=0.0,  # the teacher is peaked: an entropy bonus would pull the other way
        eval_interval=None,
        save_interval=None,
    )
    kept: dict[str, Any] = {}

    def read(driver: PPODriver) -> None:
        kept["schedules"] = [driver.schedule_of(k) for k in range(STEPS)]

    summary = run_driver(config, ray_cluster, after=read)
    return {
        "teacher": teacher,
        "run_dir": run_dir,
        "summary": summary,
        "metrics": read_jsonl(run_dir / "metrics.jsonl"),
        "events": read_jsonl(run_dir / "events.jsonl"),
        **kept,
    }


def test_the_students_reverse_kl_to_the_teacher_falls(distilled: dict[str, Any]) -> None:
    kl = [m["actor/opd_reverse_kl"] for m in distilled["metrics"]]
    assert len(kl) == STEPS
    # The untaught student's samples are far from what the teacher now says (about 4 nats a token);
    # the last steps' mean reverse KL is a fraction of the first steps'.
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert first > 1.0, kl
    assert last < 0.65 * first, kl  # about half on the CPU run (4.1 -> 1.9 nats a token over 20 steps)
    # No reward at all: the teacher's signal is the only one.
    assert all(m["reward/mean"] == 0.0 for m in distilled["metrics"])
    assert all(m["time/teacher_log_probs"] > 0 for m in distilled["metrics"])
    # Every group ties on the reward 0, which says nothing of a run without a reward: no hint about it.
    hints = [e["name"] for e in distilled["events"] if e["event"] == "hint"]
    assert "tied_groups" not in hints, hints


def test_every_step_follows_its_schedule_with_the_teachers_turn(distilled: dict[str, Any]) -> None:
    schedules = distilled["schedules"]
    assert schedules[0].describe() == (
        "engine: generate, release → teacher: wake, log_probs, sleep → actor: wake, log_probs, sleep"
        " → critic: wake, train, sleep → actor: wake, train, sleep → engine: resume, weights"
    )
    check_run_follows_its_schedules(distilled["events"], schedules)
