"""The driver's teacher turn with stand-ins for the engines and the workers (no Ray).

On shared GPUs the drawn rollout is followed by: the engines release their memory,
the teacher wakes, gives the log-probs of every sample (prompt then response, the
student's own ids, under the sampling temperature), sleeps; the log-probs reach the
rollout and each data-parallel rank's batch in sample order. Resident, nothing is
released and the teacher never sleeps. A failed turn still puts it to sleep, and
log-probs of the wrong lengths are refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem.ppo.config import PPOConfig
from tandem.ppo.engines import Generation
from tandem.ppo.loop.driver import PPODriver
from tandem.ppo.loop.schedule import StepFacts
from tandem.ppo.loop.shared_gpus import SharedGpus
from tandem.ppo.rollout.data import PromptRecord, PromptSample
from tandem.ppo.rollout.rewards import exact_match
from tandem.ppo.rollout.teacher import TeacherRole
from tandem.ppo.rollout.train_batches import to_train_batches
from tandem.ppo.run.log import PhaseClock


class Calls:
    """One list of everything the stand-ins were asked to do, in order."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def record(self, event: str, **fields: Any) -> None:
        self.log.append(f"event:{event}")


class Engines:
    """Engines whose sample k of a call answers k + 10 then the eos (2): each response its own ids."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def generate(self, prompts: list[list[int]], params: Any) -> list[Generation]:
        self.calls.log.append("generate")
        return [Generation([10 + k, 2], [-0.5, -0.5], "stop") for k in range(len(prompts))]

    def release_memory(self) -> None:
        self.calls.log.append("release")

    def resume_memory(self) -> None:
        self.calls.log.append("resume")


class Group:
    """Teacher workers whose log-prob of a response token is -(its id) / temperature: each value says which
    sample and token it belongs to."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def wake_up(self) -> list[dict[str, float]]:
        self.calls.log.append("teacher.wake_up")
        return [{"total": 0.0}]

    def sleep(self) -> list[dict[str, float]]:
        self.calls.log.append("teacher.sleep")
        return [{"total": 0.0}]

    def log_probs(
        self, sequences: list[list[int]], response_lengths: list[int], temperature: float
    ) -> list[torch.Tensor]:
        self.calls.log.append(f"teacher.log_probs:{sequences}:{response_lengths}:{temperature}")
        return [
            -torch.tensor(s[len(s) - n :], dtype=torch.float32) / temperature
            for s, n in zip(sequences, response_lengths, strict=True)
        ]


class Tokenizer:
    eos_token_id = 2

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return "7"


class Model:
    """A train group that only sleeps (the start puts it to sleep with the teacher)."""

    role = "actor"

    def sleep(self) -> list[dict[str, float]]:
        return [{"total": 0.0}]


def driver_with(calls: Calls, *, sleeps: bool) -> PPODriver:
    driver = PPODriver.__new__(PPODriver)  # the plan's methods only: no validation, no Ray
    driver.config = PPOConfig(n_samples_per_prompt=2, temperature=0.5)
    driver.facts = StepFacts(colocate=True, offload_train=sleeps, critic=False, teacher=True)
    driver.events = calls  # type: ignore[assignment]
    driver.clock = PhaseClock(track_gpu_memory=False)
    driver.tokenizer = Tokenizer()
    driver.reward_fn = exact_match
    driver.episodes = None  # single-turn samples
    driver.gpus = SharedGpus(
        engines=Engines(calls),  # type: ignore[arg-type]
        actor=Model(),  # type: ignore[arg-type]
        critic=None,
        events=calls,  # type: ignore[arg-type]
        clock=driver.clock,
    )
    teacher = TeacherRole(Group(calls), temperature=driver.config.temperature, events=calls)  # type: ignore[arg-type]
    driver.gpus.add_teacher(teacher)
    driver.gpus.start_asleep(driver.between_steps())  # as a run's start does
    driver.dataset = None  # type: ignore[assignment]  # rounds of sampling only: prompts given
    driver.data_parallel_sizes = {"actor": 1}
    driver.drawing = driver.new_drawing()
    calls.log.clear()
    return driver


PROMPTS = [PromptSample(PromptRecord(i, "q", None, "7"), [5, 6 + i], "q") for i in range(2)]
LOG_PROBS = "teacher.log_probs:[[5, 6, 10, 2], [5, 6, 11, 2], [5, 7, 12, 2], [5, 7, 13, 2]]:[2, 2, 2, 2]:0.5"
"""The teacher is given prompt then response of each of the 4 samples (2 prompts x 2), the response lengths
and the sampling temperature."""


def test_shared_the_drawn_rollout_is_followed_by_release_wake_log_probs_sleep() -> None:
    calls = Calls()
    driver = driver_with(calls, sleeps=True)
    rollout = driver.drawing.teach(driver.drawing.sample(PROMPTS, seed=0))
    assert calls.log == [
        "generate",
        "release",
        "event:engine_release",
        "event:wake",
        "teacher.wake_up",
        "event:log_probs_begin",
        LOG_PROBS,
        "event:log_probs_end",
        "teacher.sleep",
        "event:sleep",
    ]
    assert not driver.gpus.awake("teacher") and not driver.gpus.awake("engine")
    # -(response id) / 0.5 per token, sample by sample: the order the samples were drawn in.
    assert rollout.teacher_log_probs is not None
    assert [t.tolist() for t in rollout.teacher_log_probs] == [[-20, -4], [-22, -4], [-24, -4], [-26, -4]]
    assert rollout.rewards == [1.0] * 4  # the rewards are the rollout's own, untouched
    for phase in ("engine_release", "teacher_wake", "teacher_log_probs", "teacher_sleep"):
        assert f"time/{phase}" in driver.clock.values, phase
    # Each data-parallel rank's batch carries its own samples' teacher log-probs.
    batches = to_train_batches(rollout, 2)
    assert [[t.tolist() for t in b.teacher_log_probs or []] for b in batches] == [
        [[-20, -4], [-22, -4]],
        [[-24, -4], [-26, -4]],
    ]
    # A kept subset (dynamic sampling's filter) keeps the matching log-probs.
    kept = rollout.select([3, 0])
    assert [t.tolist() for t in kept.teacher_log_probs or []] == [[-26, -4], [-20, -4]]


def test_resident_the_teacher_gives_its_log_probs_in_place() -> None:
    calls = Calls()
    driver = driver_with(calls, sleeps=False)
    driver.drawing.teach(driver.drawing.sample(PROMPTS, seed=0))
    assert calls.log == ["generate", "event:log_probs_begin", LOG_PROBS, "event:log_probs_end"]
    assert driver.gpus.awake("teacher")


def test_without_a_teacher_the_rollout_is_as_drawn() -> None:
    calls = Calls()
    driver = driver_with(calls, sleeps=True)
    driver.facts = StepFacts(colocate=True, offload_train=True, critic=False)
    rollout = driver.drawing.sample(PROMPTS, seed=0)
    assert driver.drawing.teach(rollout) is rollout and rollout.teacher_log_probs is None
    assert to_train_batches(rollout, 1)[0].teacher_log_probs is None


def test_a_failed_turn_still_puts_the_teacher_to_sleep() -> None:
    calls = Calls()
    driver = driver_with(calls, sleeps=True)

    def broken(*args: Any) -> list[torch.Tensor]:
        raise RuntimeError("teacher rank 0: log_probs failed")

    assert driver.teacher is not None
    driver.teacher.group.log_probs = broken  # type: ignore[method-assign,assignment]
    with pytest.raises(RuntimeError, match="rank 0"):
        driver.drawing.teach(driver.drawing.sample(PROMPTS, seed=0))
    assert calls.log[-2:] == ["teacher.sleep", "event:sleep"]


def test_log_probs_of_other_lengths_than_the_responses_are_refused() -> None:
    calls = Calls()
    driver = driver_with(calls, sleeps=False)
    assert driver.teacher is not None
    driver.teacher.group.log_probs = lambda *args: [torch.zeros(1)] * 4  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="other lengths than their responses"):
        driver.drawing.teach(driver.drawing.sample(PROMPTS, seed=0))
