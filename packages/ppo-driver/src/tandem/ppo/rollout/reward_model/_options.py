"""How a reward-model worker is built and run: one frozen, documented set of options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RewardModelDtype = Literal["auto", "float32", "bfloat16"]
RewardModelDevice = Literal["auto", "cpu", "cuda"]
RewardModelOffload = Literal["pinned_host", "none"]


@dataclass(frozen=True)
class RewardModelOptions:
    """Options of a reward-model worker (`RewardModelWorker`) and of the group that drives them."""

    dtype: RewardModelDtype = "auto"
    """Dtype of the weights and the forward pass; "auto": bfloat16 on CUDA, float32 on the CPU."""

    device: RewardModelDevice = "auto"
    """Where the worker runs; "auto": its CUDA device when it sees one, else the CPU."""

    max_tokens_per_batch: int = 16384
    """Token budget of one forward pass: samples (longest first) are batched so that rows x the
    batch's longest sample stays within it; a longer sample is scored alone."""

    offload_backend: RewardModelOffload = "pinned_host"
    """Where the weights go while asleep: "pinned_host" (tandem.lifecycle's retained host buffers,
    back at link speed) or "none" (they stay on the device; sleep only empties the caches)."""

    request_timeout_s: float = 600.0
    """Seconds the group waits for a worker's answer (a score, a wake, a sleep)."""

    startup_timeout_s: float = 900.0
    """Seconds the group waits for a worker to load its model."""

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(
                f"RewardModelOptions.dtype={self.dtype!r}: choose 'auto', 'float32' or 'bfloat16'"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"RewardModelOptions.device={self.device!r}: choose 'auto', 'cpu' or 'cuda'")
        if isinstance(self.max_tokens_per_batch, bool) or self.max_tokens_per_batch < 1:
            raise ValueError(
                f"RewardModelOptions.max_tokens_per_batch={self.max_tokens_per_batch}: must be >= 1"
            )
        if self.offload_backend not in ("pinned_host", "none"):
            raise ValueError(
                f"RewardModelOptions.offload_backend={self.offload_backend!r}: choose 'pinned_host' or 'none'"
            )
        if self.request_timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError(
                f"RewardModelOptions.request_timeout_s={self.request_timeout_s}, "
                f"startup_timeout_s={self.startup_timeout_s}: both must be positive"
            )
