"""The reward model as a role on the shared GPUs: `wake`, `score`, `sleep`, each one recorded.

The driver decides when the role wakes and sleeps (it owns the plan); the role
does what it is told and writes each step into `RUN_DIR/events.jsonl` (`rm_wake`
before its memory comes back, `score_begin` / `score_end` around the forward
passes, `rm_sleep` once its memory is free), so that a test can check that it
never computes while another role holds the GPU. The samples reach it as
`ScoreRequest`s and become its token sequences through `RewardModelInputs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from tandem.ppo.rollout.forward import EventRecorder
from tandem.ppo.rollout.reward_mix import ScoreRequest

from ._group import RewardModelGroup

RewardModelInput = Literal["tokens", "chat"]

ROLE = "reward_model"
"""The role's name in events (`role`) and metrics (`time/reward_model_*`, `lifecycle/reward_model_*`)."""


class RewardModelInputs:
    """Turns samples into the reward model's token sequences.

    `tokens`: the policy's own ids, prompt as the engine saw it (chat template included)
    then the response as sampled; the reward model must share the policy's vocabulary.
    `chat`: the reward model's tokenizer and chat template over the prompt's messages (a
    plain prompt as one user message) and the decoded response as the assistant's answer,
    for a reward model with a tokenizer of its own.
    """

    def __init__(self, mode: RewardModelInput, tokenizer: Any = None) -> None:
        if mode not in ("tokens", "chat"):
            raise ValueError(f"--reward-model-input: got {mode!r}; choose tokens or chat")
        if mode == "chat" and tokenizer is None:
            raise ValueError("--reward-model-input chat: needs the reward model's tokenizer")
        self.mode = mode
        self.tokenizer = tokenizer

    def __call__(self, requests: Sequence[ScoreRequest]) -> list[list[int]]:
        """One token sequence per request, in order."""
        if self.mode == "tokens":
            return [[*r.prompt.prompt_ids, *r.response_ids] for r in requests]
        return [self._chat(r) for r in requests]

    def _chat(self, request: ScoreRequest) -> list[int]:
        record = request.prompt.record
        messages = list(record.messages or [{"role": "user", "content": record.prompt or ""}])
        messages.append({"role": "assistant", "content": request.response})
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]


class RewardModelRole:
    """The reward model of a run: its workers, how samples reach them, and its recorded steps.

    The driver decides when it wakes and sleeps (the `score` turn of the step's schedule)
    and times the steps (`time/reward_model_wake`, `_score`, `_sleep` in its phase clock)
    from the timings they return; the role writes the events.

    Args:
        group: the workers (one per rollout bundle).
        inputs: how `ScoreRequest`s become token sequences.
        events: the run's `EventLog`.
    """

    name = ROLE

    def __init__(self, group: RewardModelGroup, inputs: RewardModelInputs, *, events: EventRecorder) -> None:
        self.group = group
        self.inputs = inputs
        self.events = events

    def wake(self) -> list[dict[str, float]]:
        """Bring the weights back on every worker (`rm_wake` first: from here it holds memory); their timings."""
        self.events.record("rm_wake", role=ROLE)
        return self.group.wake_up()

    def score(self, requests: Sequence[ScoreRequest]) -> list[float]:
        """One score per request, in order (`score_begin` / `score_end` around the forward passes)."""
        sequences = self.inputs(requests)
        tokens = sum(len(s) for s in sequences)
        self.events.record("score_begin", role=ROLE, samples=len(sequences), tokens=tokens)
        scores = self.group.score(sequences)
        self.events.record("score_end", role=ROLE, samples=len(scores))
        return scores

    def sleep(self) -> list[dict[str, float]]:
        """Put every worker's weights on the host (`rm_sleep` after: from here it holds none); their timings."""
        timings = self.group.sleep()
        self.events.record("rm_sleep", role=ROLE)
        return timings

    def shutdown(self) -> None:
        """Stop the workers."""
        self.group.shutdown()
