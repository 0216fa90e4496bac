"""The driver's reward-model plan with stand-ins for the engines and the workers (no Ray).

Each generation on shared GPUs is followed by: the engines release their memory,
the reward model wakes, scores, sleeps; an engine that generates again first takes
its memory back. Resident, nothing is released and the reward model never sleeps.
How samples become the reward model's tokens (`tokens`, `chat`) is checked too.
"""

from __future__ import annotations

from typing import Any

import pytest

from tandem.ppo.config import PPOConfig
from tandem.ppo.engines import Generation
from tandem.ppo.loop.driver import PPODriver
from tandem.ppo.loop.schedule import StepFacts
from tandem.ppo.loop.shared_gpus import SharedGpus
from tandem.ppo.rollout.data import PromptRecord, PromptSample
from tandem.ppo.rollout.reward_mix import RewardMix, ScoreRequest
from tandem.ppo.rollout.reward_model import RewardModelInputs, RewardModelRole
from tandem.ppo.rollout.rewards import exact_match
from tandem.ppo.run.log import PhaseClock


class Calls:
    """One list of everything the stand-ins were asked to do, in order."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def record(self, event: str, **fields: Any) -> None:
        self.log.append(f"event:{event}")


class Engines:
    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def generate(self, prompts: list[list[int]], params: Any) -> list[Generation]:
        self.calls.log.append("generate")
        return [Generation([7, 2], [-0.5, -0.5], "stop") for _ in prompts]

    def release_memory(self) -> None:
        self.calls.log.append("release")

    def resume_memory(self) -> None:
        self.calls.log.append("resume")


class Group:
    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def wake_up(self) -> list[dict[str, float]]:
        self.calls.log.append("rm.wake_up")
        return [{"total": 0.0}]

    def sleep(self) -> list[dict[str, float]]:
        self.calls.log.append("rm.sleep")
        return [{"total": 0.0}]

    def score(self, sequences: list[list[int]]) -> list[float]:
        self.calls.log.append(f"rm.score:{sequences}")
        return [float(len(s)) for s in sequences]


class Tokenizer:
    eos_token_id = 2

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return "7"


class Model:
    """A train group that only sleeps (the start puts it to sleep with the reward model)."""

    def __init__(self, role: str) -> None:
        self.role = role

    def sleep(self) -> list[dict[str, float]]:
        return [{"total": 0.0}]


def driver_with(calls: Calls, *, sleeps: bool) -> PPODriver:
    driver = PPODriver.__new__(PPODriver)  # the plan's methods only: no validation, no Ray
    driver.config = PPOConfig(n_samples_per_prompt=2)
    driver.facts = StepFacts(colocate=True, offload_train=sleeps, critic=False, reward_model=True)
    driver.events = calls  # type: ignore[assignment]
    driver.clock = PhaseClock(track_gpu_memory=False)
    driver.tokenizer = Tokenizer()
    driver.gpus = SharedGpus(
        engines=Engines(calls),  # type: ignore[arg-type]
        actor=Model("actor"),  # type: ignore[arg-type]
        critic=None,
        events=calls,  # type: ignore[arg-type]
        clock=driver.clock,
    )
    driver.gpus.add_reward_model(RewardModelRole(Group(calls), RewardModelInputs("tokens"), events=calls))  # type: ignore[arg-type]
    driver.gpus.start_asleep(driver.between_steps())  # as a run's start does
    calls.log.clear()
    driver.reward_fn = RewardMix({"model": 1.0, "exact_match": 1.0}, {"exact_match": exact_match})
    driver.episodes = None  # single-turn samples
    driver.dataset = None  # type: ignore[assignment]  # rounds of sampling only: prompts given
    driver.data_parallel_sizes = {"actor": 1}
    driver.drawing = driver.new_drawing()
    return driver


PROMPT = PromptSample(PromptRecord(0, "q", None, "7"), [5, 6], "q")


def test_shared_each_generation_is_followed_by_release_wake_score_sleep() -> None:
    calls = Calls()
    driver = driver_with(calls, sleeps=True)
    first = driver.drawing.sample([PROMPT], seed=0)  # e.g. dynamic sampling's first round
    second = driver.drawing.sample([PROMPT], seed=1)  # its second round: the engines come back first
    turn = [
        "release",
        "event:engine_release",
        "event:rm_wake",
        "rm.wake_up",
        "event:score_begin",
        "rm.score:[[5, 6, 7, 2], [5, 6, 7, 2]]",
        "event:score_end",
        "rm.sleep",
        "event:rm_sleep",
    ]
    assert calls.log == ["generate", *turn, "event:engine_resume", "resume", "generate", *turn]
    for rollout in (first, second):
        assert rollout.reward_terms == {"model": [4.0, 4.0], "exact_match": [1.0, 1.0]}
        assert rollout.rewards == [5.0, 5.0]
    for phase in (
        "engine_release",
        "engine_resume",
        "reward_model_wake",
        "reward_model_score",
        "reward_model_sleep",
    ):
        assert f"time/{phase}" in driver.clock.values, phase


def test_resident_the_reward_model_scores_in_place() -> None:
    calls = Calls()
    driver = driver_with(calls, sleeps=False)
    driver.drawing.sample([PROMPT], seed=0)
    driver.drawing.sample([PROMPT], seed=1)
    score = ["event:score_begin", "rm.score:[[5, 6, 7, 2], [5, 6, 7, 2]]", "event:score_end"]
    assert calls.log == ["generate", *score, "generate", *score]


def test_a_failed_score_still_puts_the_reward_model_to_sleep() -> None:
    calls = Calls()
    driver = driver_with(calls, sleeps=True)

    def broken(sequences: list[list[int]]) -> list[float]:
        raise RuntimeError("reward model rank 0: score failed")

    driver.reward_model.group.score = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="rank 0"):
        driver.drawing.sample([PROMPT], seed=0)
    assert calls.log[-2:] == ["rm.sleep", "event:rm_sleep"]


def test_chat_input_renders_the_messages_with_the_reward_models_template() -> None:
    from tandem.ppo._tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    chat = PromptSample(PromptRecord(0, None, [{"role": "user", "content": "2+1"}], "3"), [9, 9], "ignored")
    plain = PromptSample(PromptRecord(1, "4+1", None, "5"), [8], "ignored")
    requests = [ScoreRequest(chat, [99], "3"), ScoreRequest(plain, [98, 2], "5")]
    ids = RewardModelInputs("chat", tokenizer)(requests)
    expected = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
            tokenize=True,
            return_dict=False,
        )
        for q, a in (("2+1", "3"), ("4+1", "5"))
    ]
    assert ids == expected
    assert tokenizer.decode(ids[1]) == "<s>user: 4+1</s>\n<s>assistant: 5</s>\n"
    assert RewardModelInputs("tokens")(requests) == [[9, 9, 99], [8, 98, 2]]


def test_importing_the_package_imports_neither_torch_nor_ray() -> None:
    import subprocess
    import sys

    code = (
        "import sys, tandem.ppo.rollout.reward_model, tandem.ppo.rollout.reward_mix; "
        "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "[]", out
