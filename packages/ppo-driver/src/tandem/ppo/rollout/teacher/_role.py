"""The teacher as a role on the shared GPUs: `wake`, `log_probs`, `sleep`, its work recorded.

The driver decides when the role wakes and sleeps (the teacher's `log_probs` turn of
the step's schedule, which `SharedGpus` carries out); the role does what it is told
and writes each step into `RUN_DIR/events.jsonl` with role `teacher` (`wake` before its
memory comes back, `log_probs_begin` / `log_probs_end` around the forward passes,
`sleep` once its memory is free), as the train groups' steps read, so that a test
can check that it never computes while another role holds the GPU. The samples reach it as
`ScoreRequest`s: the policy's own ids, prompt then response, which the teacher shares
(its tokenizer is the policy's, checked before the run starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tandem.ppo.rollout.forward import EventRecorder
from tandem.ppo.rollout.reward_mix import ScoreRequest

from ._group import TeacherGroup

if TYPE_CHECKING:
    import torch

ROLE = "teacher"
"""The role's name in events (`role`) and metrics (`time/teacher_*`, `lifecycle/teacher_*`)."""


class TeacherRole:
    """The teacher of a run: its workers, the sampling temperature its log-probs are taken under, its recorded work.

    Args:
        group: the workers (one per rollout bundle).
        temperature: the rollout's sampling temperature (the student's log-probs are under it too).
        events: the run's `EventLog`.
    """

    name = ROLE

    def __init__(self, group: TeacherGroup, *, temperature: float, events: EventRecorder) -> None:
        self.group = group
        self.temperature = temperature
        self.events = events

    def wake(self) -> list[dict[str, float]]:
        """Bring the weights back on every worker (`wake` first: from here it holds memory); their timings."""
        self.events.record("wake", role=ROLE)
        return self.group.wake_up()

    def log_probs(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """Each sample's response log-probs under the teacher, in order (`log_probs_begin` / `_end` around them)."""
        sequences = [[*r.prompt.prompt_ids, *r.response_ids] for r in requests]
        lengths = [len(r.response_ids) for r in requests]
        tokens = sum(len(s) for s in sequences)
        self.events.record("log_probs_begin", role=ROLE, samples=len(sequences), tokens=tokens)
        out = self.group.log_probs(sequences, lengths, self.temperature)
        self.events.record("log_probs_end", role=ROLE, samples=len(out))
        if [len(t) for t in out] != lengths:
            raise RuntimeError(
                f"the teacher returned log-probs for {len(out)} samples of other lengths than their responses"
            )
        return out

    def sleep(self) -> list[dict[str, float]]:
        """Put every worker's weights on the host (`sleep` after: from here it holds none); their timings."""
        timings = self.group.sleep()
        self.events.record("sleep", role=ROLE)
        return timings

    def shutdown(self) -> None:
        """Stop the workers."""
        self.group.shutdown()
