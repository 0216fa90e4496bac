"""The reward-model worker: a Hugging Face sequence classifier on one device that scores token sequences.

Forward only, with transformers' own model code: samples are right-padded into
batches of at most `max_tokens_per_batch` padded tokens (longest first), the
backbone runs with an attention mask, the `score` head is applied to every
position as transformers does, and each sample's score is read at the position
transformers reads it (`score_position`: the rightmost token that is not the pad
id). Right padding under a causal mask leaves every real token's hidden state as
it is alone, so a score does not depend on which samples share its batch.

The device, the dtype, sleep and wake are the forward-only worker's
(`tandem.ppo.rollout.forward.ForwardWorker`): the weights sleep in retained host
buffers, and asleep the process keeps its CUDA context and nothing else of the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tandem.ppo.rollout.forward._worker import ForwardWorker, checked_rows, right_padded

from ._batching import score_position, token_budget_batches
from ._options import RewardModelOptions


class RewardModelAsleepError(RuntimeError):
    """The reward model was asked to score while asleep."""


class RewardModelWorker(ForwardWorker):
    """One reward model on one device (CPU or a CUDA GPU): `score`, `sleep`, `wake_up`; see the module docstring.

    Args:
        folder: a one-label sequence-classification Hugging Face folder.
        options: worker options; None: the defaults.
        memory_backend: where the sleeping weights go; None: built from `options.offload_backend`.
    """

    asleep_error = RewardModelAsleepError

    def __init__(
        self, folder: str, options: RewardModelOptions | None = None, *, memory_backend: Any = None
    ) -> None:
        super().__init__(folder, options or RewardModelOptions(), memory_backend=memory_backend)
        self._backbone = getattr(self.model, self.model.base_model_prefix)
        text_config = self.model.config.get_text_config()
        self.pad_token_id: int | None = text_config.pad_token_id
        self._vocab = int(text_config.vocab_size)

    def load_model(self, folder: str, dtype: torch.dtype) -> Any:
        """The folder's `AutoModelForSequenceClassification`; ValueError unless it has one label."""
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype)
        if int(model.config.num_labels) != 1:
            raise ValueError(
                f"--reward-model: {folder!r} has {model.config.num_labels} labels; a reward model has exactly one"
            )
        return model

    def score(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One score per token sequence (prompt + response), in input order, as float.

        Raises `RewardModelAsleepError` while asleep, and ValueError naming the sample
        for an empty sequence or a token id outside the model's vocabulary.
        """
        with self._lock:
            self.awake_for("score")
            rows = checked_rows(sequences, self._vocab, "the reward model")
            scores = [0.0] * len(rows)
            batches = token_budget_batches([len(r) for r in rows], self.options.max_tokens_per_batch)
            with torch.no_grad(), self.measured():
                for batch in batches:
                    for i, value in zip(batch, self._score_batch([rows[i] for i in batch]), strict=True):
                        scores[i] = value
            return scores

    def _score_batch(self, rows: list[list[int]]) -> list[float]:
        ids, mask = right_padded(rows, self.pad_token_id if self.pad_token_id is not None else 0)
        hidden = self._backbone(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
        ).last_hidden_state
        logits = self.model.score(hidden)  # every position, as transformers computes it
        positions = torch.tensor([score_position(r, self.pad_token_id) for r in rows], device=self.device)
        picked = logits[torch.arange(len(rows), device=self.device), positions, 0]
        return [float(v) for v in picked.float().cpu()]
