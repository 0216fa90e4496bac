"""The reward-model worker: a Hugging Face sequence classifier on one device that scores token sequences.

Forward only, with transformers' own model code: samples are right-padded into
batches of at most `max_tokens_per_batch` padded tokens (longest first), the
backbone runs with an attention mask, the `score` head is applied to every
position as transformers does, and each sample's score is read at the position
transformers reads it (`score_position`: the rightmost token that is not the pad
id). Right padding under a causal mask leaves every real token's hidden state as
it is alone, so a score does not depend on which samples share its batch.

Sleep and wake move the weights to retained host buffers and back through
tandem.lifecycle (`PinnedHostBackend`, as the embedded engine does); asleep, the
process keeps its CUDA context and nothing else of the model on the device.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tandem.lifecycle import Lifecycle, NoopBackend, PinnedHostBackend
from tandem.megatron.runtime.gpu_memory import device_used_bytes, process_gpu_bytes

from ._batching import score_position, token_budget_batches
from ._options import RewardModelOptions

logger = logging.getLogger(__name__)

WEIGHTS = "weights"
"""The lifecycle tag of the reward model's weights (its only GPU state between calls)."""


class RewardModelAsleepError(RuntimeError):
    """The reward model was asked to score while asleep."""


class RewardModelWorker:
    """One reward model on one device (CPU or a CUDA GPU): `score`, `sleep`, `wake_up`; see the module docstring.

    Args:
        folder: a one-label sequence-classification Hugging Face folder.
        options: worker options; None: the defaults.
        memory_backend: where the sleeping weights go; None: built from `options.offload_backend`.
    """

    def __init__(
        self, folder: str, options: RewardModelOptions | None = None, *, memory_backend: Any = None
    ) -> None:
        from transformers import AutoModelForSequenceClassification

        self.options = options = options or RewardModelOptions()
        self.device = _pick_device(options.device)
        self.dtype = _pick_dtype(options.dtype, self.device)
        self._gpu_start = _gpu_baseline(self.device)
        model: Any = AutoModelForSequenceClassification.from_pretrained(folder, dtype=self.dtype)
        if int(model.config.num_labels) != 1:
            raise ValueError(
                f"--reward-model: {folder!r} has {model.config.num_labels} labels; a reward model has exactly one"
            )
        self.model = model.to(self.device).eval().requires_grad_(False)
        _own_storages(self.model)
        self._backbone = getattr(self.model, self.model.base_model_prefix)
        text_config = self.model.config.get_text_config()
        self.pad_token_id: int | None = text_config.pad_token_id
        self._vocab = int(text_config.vocab_size)
        if memory_backend is None:
            none = options.offload_backend == "none"
            memory_backend = NoopBackend() if none else PinnedHostBackend(self.device)
        if hasattr(memory_backend, "register"):
            memory_backend.register(WEIGHTS, lambda: [*self.model.parameters(), *self.model.buffers()])
        self._lifecycle = Lifecycle(memory_backend, tags=[WEIGHTS])
        self._lock = threading.RLock()

    # -- facts ---------------------------------------------------------------------------------------

    def asleep(self) -> bool:
        """Whether the weights are put away right now."""
        return self._lifecycle.asleep

    def health(self) -> bool:
        """True: the worker is alive (and can score once awake)."""
        return True

    def weight_bytes(self) -> int:
        """Bytes of the model's weights and buffers (what a sleep moves off the device)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def gpu_memory(self) -> dict[str, int | None]:
        """This worker's GPU memory now and at start-up, in bytes, as nvidia-smi reports it.

        The keys of the train worker's `gpu_memory`: `process` (now, CUDA context included),
        `process_baseline` (once the context existed, before the model), `device_used`,
        `device_before_context`, `context`; None where nvidia-smi cannot tell; all 0 on CPU.
        """
        if self.device.type != "cuda":
            return dict.fromkeys(
                ("process", "process_baseline", "device_used", "device_before_context", "context"), 0
            )

        return {"process": process_gpu_bytes(), "device_used": device_used_bytes(), **self._gpu_start}

    def memory_stats(self) -> dict[str, float]:
        """GiB held on the device by this process's torch allocator (CUDA only)."""
        if self.device.type != "cuda":
            return {}
        return {
            "allocated_gib": torch.cuda.memory_allocated(self.device) / 2**30,
            "reserved_gib": torch.cuda.memory_reserved(self.device) / 2**30,
        }

    # -- the lifecycle ----------------------------------------------------------------------------

    def sleep(self) -> dict[str, float]:
        """Put the weights on the host and hand the device memory back; the lifecycle's timings. Idempotent."""
        with self._lock:
            self._lifecycle.sleep()
            timings = self._lifecycle.last_timings
            self._empty_device_cache()
            return timings

    def wake_up(self) -> dict[str, float]:
        """Bring the weights back, as they were; the lifecycle's timings. Idempotent."""
        with self._lock:
            self._lifecycle.wake_up()
            return self._lifecycle.last_timings

    # -- scoring -----------------------------------------------------------------------------------

    def score(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One score per token sequence (prompt + response), in input order, as float.

        Raises `RewardModelAsleepError` while asleep, and ValueError naming the sample
        for an empty sequence or a token id outside the model's vocabulary.
        """
        with self._lock:
            if self._lifecycle.asleep:
                raise RewardModelAsleepError("score: the reward model is asleep; call wake_up() first")
            rows = self._check(sequences)
            scores = [0.0] * len(rows)
            batches = token_budget_batches([len(r) for r in rows], self.options.max_tokens_per_batch)
            with torch.no_grad():
                for batch in batches:
                    for i, value in zip(batch, self._score_batch([rows[i] for i in batch]), strict=True):
                        scores[i] = value
            return scores

    def _score_batch(self, rows: list[list[int]]) -> list[float]:
        longest = max(len(r) for r in rows)
        fill = self.pad_token_id if self.pad_token_id is not None else 0
        ids = torch.full((len(rows), longest), fill, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        hidden = self._backbone(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
        ).last_hidden_state
        logits = self.model.score(hidden)  # every position, as transformers computes it
        positions = torch.tensor([score_position(r, self.pad_token_id) for r in rows], device=self.device)
        picked = logits[torch.arange(len(rows), device=self.device), positions, 0]
        return [float(v) for v in picked.float().cpu()]

    def _check(self, sequences: Sequence[Sequence[int]]) -> list[list[int]]:
        rows = []
        for i, sequence in enumerate(sequences):
            row = [int(t) for t in sequence]
            if not row:
                raise ValueError(f"sample {i} has no tokens; every sample needs at least one")
            bad = [t for t in row if not 0 <= t < self._vocab]
            if bad:
                raise ValueError(
                    f"sample {i} has token ids outside the reward model's vocabulary [0, {self._vocab}): {bad[:5]}"
                )
            rows.append(row)
        return rows

    # -- shutdown and device memory -----------------------------------------------------------------

    def shutdown(self) -> None:
        """Free the device's cached memory before the actor goes away."""
        self._empty_device_cache()

    def _empty_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # cuBLAS workspaces (one per stream used) live in torch's allocator too; they come back on use.
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()


def _gpu_baseline(device: torch.device) -> dict[str, int | None]:
    """The GPU memory before this process's CUDA context, that context's size, and the process's then."""
    if device.type != "cuda":
        return {}

    before = device_used_bytes()
    torch.zeros(1, device=device)  # the CUDA context exists from here on
    after = device_used_bytes()
    return {
        "process_baseline": process_gpu_bytes(),
        "device_before_context": before,
        "context": None if after is None or before is None else after - before,
    }


def _own_storages(model: torch.nn.Module) -> None:
    """Give every weight a storage of its own that can be freed (CPU weights may map the checkpoint file)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not tensor.untyped_storage().resizable():
                tensor.data = tensor.data.clone()


def _pick_device(device: str) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError(
                "RewardModelOptions.device='cuda' but no CUDA device is visible; use 'auto' or 'cpu'"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
