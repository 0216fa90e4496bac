"""A demo-sized PPO run with a reward model on the shared logical GPU: the plan's order, the rewards, the scores.

The demo's actor, critic and embedded engine share one logical GPU of a local Ray
with a reward-model worker (a random Llama sequence classifier on the demo's
tokenizer). The event log must show, every step: the engine generates, releases
its memory, the reward model wakes, scores and sleeps, then the critic and the
actor take their turns; never two of them awake and computing at once. The
critic starts from the reward model (`--critic-hf-checkpoint`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.ppo._demo import DEMO_DEFAULTS, prepare_demo
from tandem.ppo.config import PPOConfig
from tandem.ppo.config.file import unvalidated

from .._runs import run_driver
from ..test_schedule import check_run_follows_its_schedules
from .conftest import save_reward_model

pytestmark = pytest.mark.slow

WEIGHTS = {"model": 1.0, "custom": 0.5}


@pytest.fixture(scope="module")
def demo_with_rm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The demo's model and data, and a reward model on the demo's tokenizer."""
    from transformers import AutoTokenizer

    from tandem.ppo._tiny import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("demo-rm")
    filled = prepare_demo({"run_dir": str(root / "base")})
    tokenizer = AutoTokenizer.from_pretrained(filled["hf_checkpoint"])
    rm = root / "rm"
    model = save_reward_model(
        rm, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=2
    )
    build_tiny_tokenizer(rm)
    return {"filled": filled, "rm": str(rm), "model": model}


def config_of(demo: dict[str, Any], run_dir: Path, **overrides: Any) -> PPOConfig:
    values = {
        **DEMO_DEFAULTS,
        **demo["filled"],
        "run_dir": str(run_dir),
        "progress": False,
        "rm_type": "model",
        "reward_model": demo["rm"],
        "reward_weights": ",".join(f"{k}={v}" for k, v in WEIGHTS.items()),
        **overrides,
    }
    return unvalidated(values)


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def check_turns(events: list[dict[str, Any]]) -> None:
    """Never two roles awake and computing on the GPU at once; the reward model only on a released engine."""
    awake: set[str] = {"actor", "critic", "reward_model"}  # all start awake, then sleep before rollout 0
    engine_holds_memory = True
    scoring = False
    for e in events:
        kind, role = e["event"], e.get("role")
        if kind == "setup_done":
            continue
        if kind in ("generate_begin", "engine_resume", "weight_sync"):
            engine_holds_memory = True
            assert "reward_model" not in awake, f"{kind} while the reward model is awake"
        elif kind == "engine_release":
            engine_holds_memory = False
        elif kind == "rm_wake":
            assert not engine_holds_memory, "the reward model woke while the engine held its memory"
            assert awake == set(), f"the reward model woke while {awake} were awake"
            awake.add("reward_model")
        elif kind == "rm_sleep":
            awake.discard("reward_model")
        elif kind == "score_begin":
            assert awake == {"reward_model"}, f"scoring while {awake} are awake"
            scoring = True
        elif kind == "score_end":
            scoring = False
        elif kind == "wake":
            assert "reward_model" not in awake, f"{role} woke while the reward model is awake"
            awake.add(role)
        elif kind == "sleep":
            awake.discard(role)
        elif kind in ("train_begin", "log_probs_begin", "save"):
            assert awake == {role}, f"{role} {kind} while {awake} are awake"
        assert not scoring or kind in ("score_begin", "score_end"), f"{kind} while scoring"
    assert awake == set()


def test_the_reward_model_takes_its_turn_and_its_score_is_in_the_reward(
    tmp_path: Path, demo_with_rm: dict[str, Any], ray_cluster: str
) -> None:
    # The critic starts from the reward model too (its score head as the value head), as OpenRLHF's does.
    config = config_of(
        demo_with_rm,
        tmp_path / "run",
        num_rollout=3,
        num_critic_only_steps=1,
        eval_interval=2,
        save_interval=2,
        critic_hf_checkpoint=demo_with_rm["rm"],
    )
    kept: dict[str, Any] = {}
    summary = run_driver(
        config,
        ray_cluster,
        after=lambda d: kept.update(
            rollout=d.last_sampled.rollout, schedules=[d.schedule_of(k) for k in range(3)]
        ),
    )
    events = read_events(tmp_path / "run")
    check_turns(events)
    check_run_follows_its_schedules(events, kept["schedules"])  # each step in its schedule's order

    # Each step: generate -> engine release -> rm wake -> score -> rm sleep -> critic -> actor.
    kinds = [(e["event"], e.get("role")) for e in events]
    begins = [i for i, x in enumerate(kinds) if x[0] == "step_begin"]
    ends = [i for i, x in enumerate(kinds) if x[0] == "step_end"]
    assert len(begins) == len(ends) == 3
    for k, (begin, end) in enumerate(zip(begins, ends, strict=True)):
        step = [x for x in kinds[begin : end + 1] if x[0] not in ("weights_received", "engine_resume")]
        order = [f"{x[0]}:{x[1]}" if x[0] in ("wake", "sleep", "train_begin") else x[0] for x in step]
        expected = ["step_begin", "generate_begin", "engine_release", "rm_wake", "score_begin", "score_end"]
        expected += ["rm_sleep", "generate_end", "wake:critic", "train_begin:critic"]
        assert order[: len(expected)] == expected, order
        if k >= 1:  # after the critic-only warm-up the actor trains, after the critic
            assert order.index("wake:actor") > order.index("sleep:critic"), order
    # Three evals (of the starting weights, after rollouts 1 and 2) score too, and each following
    # step's engines come back first.
    assert sum(e["event"] == "score_begin" for e in events) == 3 + 3
    assert sum(e["event"] == "engine_resume" for e in events) == 2

    for m in summary.metrics:
        # reward/mean is the weighted sum of the terms' means (the sum is linear).
        combined = WEIGHTS["model"] * m["reward/model"] + WEIGHTS["custom"] * m["reward/custom"]
        assert m["reward/mean"] == pytest.approx(combined, abs=1e-6), m
        assert 0.0 <= m["reward/custom"] <= 1.0
        for key in (
            "time/reward_model",
            "time/reward_model_wake",
            "time/reward_model_score",
            "time/reward_model_sleep",
        ):
            assert m[key] >= 0.0, key
        assert "lifecycle/reward_model_sleep/pause_weights" in m
    assert "eval/model" in summary.metrics[1]

    # The scores in the last rollout are transformers' own for prompt + response.
    rollout = kept["rollout"]
    model = demo_with_rm["model"]
    with torch.no_grad():
        expected_scores = [
            float(model(input_ids=torch.tensor([[*p.prompt_ids, *g.token_ids]])).logits[0, 0])
            for p, g in zip(rollout.prompts, rollout.generations, strict=True)
        ]
    assert rollout.reward_terms["model"] == pytest.approx(expected_scores, abs=1e-5)
