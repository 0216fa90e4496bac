"""How a forward-only worker (a reward model's, a teacher's) is built and run: one frozen, documented set of options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ForwardDtype = Literal["auto", "float32", "bfloat16"]
ForwardDevice = Literal["auto", "cpu", "cuda"]
ForwardOffload = Literal["pinned_host", "none"]


@dataclass(frozen=True)
class ForwardOptions:
    """Options of a forward-only worker (`ForwardWorker`) and of the group that drives them; the reward
    model's and the teacher's are subclasses, so that messages name their own class."""

    dtype: ForwardDtype = "auto"
    """Dtype of the weights and the forward pass; "auto": bfloat16 on CUDA, float32 on the CPU."""

    device: ForwardDevice = "auto"
    """Where the worker runs; "auto": its CUDA device when it sees one, else the CPU."""

    max_tokens_per_batch: int = 16384
    """Token budget of one forward pass: samples (longest first) are batched so that rows x the
    batch's longest sample stays within it; a longer sample goes alone."""

    offload_backend: ForwardOffload = "pinned_host"
    """Where the weights go while asleep: "pinned_host" (tandem.lifecycle's retained host buffers,
    back at link speed) or "none" (they stay on the device; sleep only empties the caches)."""

    request_timeout_s: float = 600.0
    """Seconds the group waits for a worker's answer (a score, a wake, a sleep)."""

    startup_timeout_s: float = 900.0
    """Seconds the group waits for a worker to load its model."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"{name}.dtype={self.dtype!r}: choose 'auto', 'float32' or 'bfloat16'")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"{name}.device={self.device!r}: choose 'auto', 'cpu' or 'cuda'")
        if isinstance(self.max_tokens_per_batch, bool) or self.max_tokens_per_batch < 1:
            raise ValueError(f"{name}.max_tokens_per_batch={self.max_tokens_per_batch}: must be >= 1")
        if self.offload_backend not in ("pinned_host", "none"):
            raise ValueError(
                f"{name}.offload_backend={self.offload_backend!r}: choose 'pinned_host' or 'none'"
            )
        if self.request_timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError(
                f"{name}.request_timeout_s={self.request_timeout_s}, "
                f"startup_timeout_s={self.startup_timeout_s}: both must be positive"
            )
