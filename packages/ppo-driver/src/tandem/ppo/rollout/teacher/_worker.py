"""The teacher's worker: a Hugging Face causal LM on one device that gives the log-prob of every response token.

Forward only, with transformers' own model code: samples (prompt + response) are
right-padded into batches of at most `max_tokens_per_batch` padded tokens (longest
first) and the backbone runs with an attention mask; the output head runs only on
the positions that predict response tokens, `logits_chunk_tokens` rows at a time,
each chunk's log-softmax in float32 under the sampling temperature, so that no
logits of a whole batch are ever held (a 152k vocabulary makes 0.6 MB a token in
float32). Right padding under a causal mask leaves every real token as it is alone,
so a sample's log-probs do not depend on its batch.

The device, the dtype, sleep and wake are the forward-only worker's
(`tandem.ppo.rollout.forward.ForwardWorker`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tandem.ppo.rollout.forward._batching import token_budget_batches
from tandem.ppo.rollout.forward._worker import ForwardWorker, checked_rows, right_padded

from ._options import TeacherOptions


class TeacherAsleepError(RuntimeError):
    """The teacher was asked for log-probs while asleep."""


class TeacherWorker(ForwardWorker):
    """One teacher on one device (CPU or a CUDA GPU): `log_probs`, `sleep`, `wake_up`; see the module docstring.

    Args:
        folder: a causal-LM Hugging Face folder (`AutoModelForCausalLM`).
        options: worker options; None: the defaults.
        memory_backend: where the sleeping weights go; None: built from `options.offload_backend`.
    """

    asleep_error = TeacherAsleepError
    options: TeacherOptions

    def __init__(
        self, folder: str, options: TeacherOptions | None = None, *, memory_backend: Any = None
    ) -> None:
        super().__init__(folder, options or TeacherOptions(), memory_backend=memory_backend)
        self._backbone = getattr(self.model, self.model.base_model_prefix)
        self._head = self.model.get_output_embeddings()
        self._vocab = int(self.model.config.get_text_config().vocab_size)
        pad = self.model.config.get_text_config().pad_token_id
        self._fill = int(pad) if isinstance(pad, int) else 0

    def load_model(self, folder: str, dtype: torch.dtype) -> Any:
        """The folder's `AutoModelForCausalLM`."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)

    def log_probs(
        self, sequences: Sequence[Sequence[int]], response_lengths: Sequence[int], temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """The log-prob of each response token under `temperature`, one float32 CPU tensor per sample.

        `sequences[i]` is sample i's prompt then response, whose last `response_lengths[i]`
        tokens are the response; its tensor has that many entries, entry t the log-prob of
        response token t given every token before it. Raises `TeacherAsleepError` while asleep,
        ValueError naming the sample for an empty sequence, an id outside the vocabulary or a
        response length that leaves no prompt token.
        """
        if not temperature > 0:
            raise ValueError(f"temperature: got {temperature}; log-probs need a temperature > 0")
        with self._lock:
            self.awake_for("log_probs")
            rows = checked_rows(sequences, self._vocab, "the teacher")
            lengths = [int(n) for n in response_lengths]
            if len(lengths) != len(rows):
                raise ValueError(f"{len(rows)} samples but {len(lengths)} response lengths")
            for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
                if not 0 < n < len(row):
                    raise ValueError(
                        f"sample {i}: a response of {n} tokens in a sequence of {len(row)}; a sample needs at "
                        "least one prompt token and one response token"
                    )
            out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
            batches = token_budget_batches([len(r) for r in rows], self.options.max_tokens_per_batch)
            with torch.no_grad(), self.measured():
                for batch in batches:
                    picked = self._batch([rows[i] for i in batch], [lengths[i] for i in batch], temperature)
                    for i, values in zip(batch, picked, strict=True):
                        out[i] = values
            return out

    def _batch(self, rows: list[list[int]], lengths: list[int], temperature: float) -> list[torch.Tensor]:
        ids, mask = right_padded(rows, self._fill)
        hidden = self._backbone(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
        ).last_hidden_state
        # Position p predicts token p + 1: a response of n tokens ending at L is predicted by L - n - 1 .. L - 2.
        row_of = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])
        at = torch.cat([torch.arange(len(r) - n - 1, len(r) - 1) for r, n in zip(rows, lengths, strict=True)])
        targets = ids[row_of, at + 1].to(self.device)
        states = hidden[row_of.to(self.device), at.to(self.device)]
        values = torch.empty(len(at), dtype=torch.float32, device=self.device)
        step = self.options.logits_chunk_tokens
        for lo in range(0, len(at), step):
            logits = self._head(states[lo : lo + step]).float() / temperature
            chosen = logits.gather(-1, targets[lo : lo + step, None]).squeeze(-1)
            values[lo : lo + step] = chosen - torch.logsumexp(logits, dim=-1)
        return list(values.cpu().split(lengths))
