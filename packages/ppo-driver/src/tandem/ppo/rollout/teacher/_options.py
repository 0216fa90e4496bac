"""How a teacher's worker is built and run: the forward-only worker's options and its logits' chunk."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.ppo.rollout.forward import ForwardOptions


@dataclass(frozen=True)
class TeacherOptions(ForwardOptions):
    """Options of a teacher's worker (`TeacherWorker`) and of the group that drives them (`ForwardOptions`' fields,
    and the rows of logits computed at once)."""

    logits_chunk_tokens: int = 4096
    """Response positions whose logits (and float32 log-softmax) are computed at once: a 152k vocabulary
    takes 2.3 GiB of float32 logits for 4096 of them."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.logits_chunk_tokens, bool) or self.logits_chunk_tokens < 1:
            raise ValueError(f"TeacherOptions.logits_chunk_tokens={self.logits_chunk_tokens}: must be >= 1")
