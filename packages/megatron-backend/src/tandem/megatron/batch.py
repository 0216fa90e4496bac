"""The rollout batch a train worker receives, with the per-token targets the train step adds to it.

One `RolloutBatch` holds the samples of one data-parallel rank. What the
rollout produced is kept per sample (token ids, loss masks: lists of 1-D
tensors). What the train step computes per response token (old and reference
log-probs, old values, advantages, returns) is kept padded, shape
`(n, max_response_len)` with 0 past each response, because the PPO math works
on padded tensors; `select` slices those with the samples, so a micro-batch
carries its own targets.

Alignment: position `t` of a response tensor belongs to response token `t`;
its log-prob is `log p(token_t | tokens before it)` and its value is the
critic's value of the state just before token `t` (the hidden state that
predicts token `t`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

TARGETS = ("old_log_probs", "ref_log_probs", "old_values", "advantages", "returns", "token_rewards")
"""The padded per-token fields that the train step fills in (`with_targets`)."""

PER_SAMPLE = ("tokens", "loss_masks", "rollout_log_probs", "step_rewards", "teacher_log_probs")
"""The fields kept as one 1-D tensor per sample."""


class _Flat(NamedTuple):
    """A list of 1-D tensors of one dtype and device as one tensor and the lengths to cut it at (pickling)."""

    values: torch.Tensor
    lengths: list[int]

    @classmethod
    def of(cls, tensors: Any) -> Any:
        """`tensors` flat where they are a non-empty list of 1-D tensors of one dtype and device; else as given."""
        if (
            not isinstance(tensors, list)
            or not tensors
            or not all(isinstance(t, torch.Tensor) for t in tensors)
        ):
            return tensors
        first = tensors[0]
        if any(t.dim() != 1 or t.dtype != first.dtype or t.device != first.device for t in tensors):
            return tensors
        return cls(torch.cat(tensors), [int(t.numel()) for t in tensors])

    def samples(self) -> list[torch.Tensor]:
        """The tensors again, views of `values`."""
        return list(torch.split(self.values, self.lengths))


def to_device(tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """`tensor` on `device` (None: as it is); a host-to-GPU copy goes through pinned memory, asynchronously.

    A plain `.to("cuda")` of pageable host memory makes the host wait until every
    kernel already queued on the stream has run, so a copy at the start of each
    micro-batch (its tokens, its loss mask, the index that picks its targets)
    empties the GPU's queue every time, and the GPU idles while the host queues
    the next kernels. From pinned memory with `non_blocking=True` the copy is
    queued like a kernel; torch's pinned-memory cache keeps the buffer until the
    copy has run.
    """
    if device is None:
        return tensor
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass
class RolloutBatch:
    """The samples of one data-parallel rank for one rollout, and the train step's per-token targets.

    Attributes:
        tokens: prompt + response token ids of each sample, int64, shape `(prompt_len_i + response_len_i,)`.
        response_lengths: number of response tokens at the end of each sample's `tokens`.
        loss_masks: 1 for trainable response tokens, 0 for the rest, shape `(response_len_i,)`.
        rewards: one scalar reward per sample, float32, shape `(n,)`.
        sample_indices: each sample's index in the whole rollout (used to route values by sample).
        rollout_log_probs: log-probs the rollout engine reported per response token, when it did
            (one tensor per sample, its response length); truncated importance sampling
            (`WorkerConfig.use_tis`) weighs the policy loss with them.
        step_rewards: rewards at their tokens, when the rollout gave some (an episode of several turns:
            each turn's reward at that turn's last model token), one tensor per sample of its response
            length; `rewards` is then each sample's total. Estimators that take token rewards (GAE,
            REINFORCE++) use them instead of the scalar at the last trainable token
            (`targets.reward_signal`).
        teacher_log_probs: on-policy distillation (`WorkerConfig.opd_coef`): the teacher's log-probs of
            each response token under the sampling temperature (one tensor per sample, its response
            length), the other half of the reverse KL.
        old_log_probs: actor: log-probs under the weights the rollout's training started
            from. Shape `(n, max_response_len)`, 0 past each response; None until computed.
        ref_log_probs: actor with a KL loss: log-probs under the reference weights. Same shape.
        old_values: critic: values under the weights its training started from. Same shape.
        advantages: actor: GAE advantages (whitened when configured). Same shape.
        returns: critic: GAE (λ-)returns, the value loss's targets. Same shape.
        token_rewards: critic whose old values come from its update's forward
            (`WorkerConfig.reuse_old_values`): the rewards its returns are computed from, per
            token (the scalar reward at the last trainable token, KL-folded or not). Same shape.
    """

    tokens: list[torch.Tensor]
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]
    rewards: torch.Tensor
    sample_indices: list[int] = field(default_factory=list)
    rollout_log_probs: list[torch.Tensor] | None = None
    step_rewards: list[torch.Tensor] | None = None
    teacher_log_probs: list[torch.Tensor] | None = None
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not self.sample_indices:
            self.sample_indices = list(range(n))
        sizes = {
            "response_lengths": len(self.response_lengths),
            "loss_masks": len(self.loss_masks),
            "rewards": int(self.rewards.numel()),
            "sample_indices": len(self.sample_indices),
            **({"step_rewards": len(self.step_rewards)} if self.step_rewards is not None else {}),
        }
        if self.teacher_log_probs is not None:
            sizes["teacher_log_probs"] = len(self.teacher_log_probs)
        bad = {k: v for k, v in sizes.items() if v != n}
        if bad:
            raise ValueError(
                f"RolloutBatch: {n} samples in `tokens` but {bad}; every field needs one entry per sample"
            )
        for i, (toks, rlen, mask) in enumerate(
            zip(self.tokens, self.response_lengths, self.loss_masks, strict=True)
        ):
            if not 0 < rlen < toks.numel():
                raise ValueError(
                    f"RolloutBatch: sample {i} has response_length {rlen} but {toks.numel()} tokens; "
                    "a sample needs at least one prompt token and one response token"
                )
            if mask.numel() != rlen:
                raise ValueError(
                    f"RolloutBatch: sample {i} has loss_mask of {mask.numel()} entries, expected {rlen}"
                )
            if self.step_rewards is not None and self.step_rewards[i].numel() != rlen:
                raise ValueError(
                    f"RolloutBatch: sample {i} has step_rewards of {self.step_rewards[i].numel()} entries, "
                    f"expected {rlen} (one per response token)"
                )
            if self.teacher_log_probs is not None and self.teacher_log_probs[i].numel() != rlen:
                raise ValueError(
                    f"RolloutBatch: sample {i} has {self.teacher_log_probs[i].numel()} teacher log-probs for "
                    f"{rlen} response tokens; the teacher gives one per response token"
                )
        shape = (n, self.max_response_length)
        for name in TARGETS:
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(
                    f"RolloutBatch: `{name}` has shape {tuple(value.shape)}, expected {shape} "
                    "(samples, longest response), padded with 0"
                )

    def __len__(self) -> int:
        return len(self.tokens)

    # --- pickling: one tensor a per-sample field, not one a sample --------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The fields, each per-sample list of tensors as one flat tensor and its lengths (`_Flat`).

        A batch crosses processes pickled (the driver's `ray.put`, each worker's `ray.get`), and torch
        pickles every tensor on its own: a rank's 512 samples of three per-sample fields took 103 ms to
        load in a Ray task on two cores, one tensor a field 2 ms (`bench/batch_pickle_bench.py`)."""
        state = dict(self.__dict__)
        for name in PER_SAMPLE:
            state[name] = _Flat.of(state[name])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The pickled fields back, each flat field as its samples again (views of the one tensor)."""
        self.__dict__.update(
            {name: value.samples() if isinstance(value, _Flat) else value for name, value in state.items()}
        )

    @property
    def max_response_length(self) -> int:
        """The longest response of the batch: the width of its padded per-token tensors."""
        return max(self.response_lengths, default=0)

    def padded_loss_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The loss masks as `(n, max_response_len)`, 0 past each response."""
        return to_device(pad_responses(self.loss_masks), device)

    def padded_step_rewards(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """`step_rewards` as `(n, max_response_len)`, 0 past each response; None when there are none."""
        if self.step_rewards is None:
            return None
        return to_device(pad_responses(self.step_rewards), device)

    def padded_teacher_log_probs(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The teacher's log-probs as `(n, max_response_len)`, 0 past each response; ValueError naming
        `opd_coef` when the batch has none."""
        if self.teacher_log_probs is None:
            raise ValueError(
                "opd_coef: on-policy distillation needs the teacher's log-probs of every response token "
                "(RolloutBatch.teacher_log_probs), but the batch has none; start the run with a teacher "
                "(--teacher-hf-checkpoint), or set opd_coef to 0"
            )
        return to_device(pad_responses(self.teacher_log_probs), device)

    def with_targets(self, **targets: torch.Tensor | None) -> RolloutBatch:
        """A copy of this batch with the given `TARGETS` fields set (checked like the constructor's)."""
        unknown = set(targets) - set(TARGETS)
        if unknown:
            raise ValueError(f"with_targets: {sorted(unknown)} are not targets; choose among {TARGETS}")
        fields: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return RolloutBatch(**{**fields, **targets})

    def select(self, indices: Sequence[int]) -> RolloutBatch:
        """A batch of the samples at `indices` (positions in this batch), in that order, with their targets."""
        rows = list(indices)
        width = max((self.response_lengths[i] for i in rows), default=0)
        targets: dict[str, Any] = {}
        index = torch.tensor(rows, dtype=torch.long)
        for name in TARGETS:
            value = getattr(self, name)
            # `value[rows]` would copy the index to the GPU with a host sync (`to_device`).
            targets[name] = (
                None if value is None else value[:, :width].index_select(0, to_device(index, value.device))
            )
        return RolloutBatch(
            tokens=[self.tokens[i] for i in rows],
            response_lengths=[self.response_lengths[i] for i in rows],
            loss_masks=[self.loss_masks[i] for i in rows],
            rewards=self.rewards[rows],
            sample_indices=[self.sample_indices[i] for i in rows],
            rollout_log_probs=None
            if self.rollout_log_probs is None
            else [self.rollout_log_probs[i] for i in rows],
            step_rewards=None if self.step_rewards is None else [self.step_rewards[i] for i in rows],
            teacher_log_probs=None
            if self.teacher_log_probs is None
            else [self.teacher_log_probs[i] for i in rows],
            **targets,
        )


def pad_responses(per_sample: Sequence[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
    """Stack 1-D per-sample tensors into `(batch, max_len)`, right-padded with `fill`."""
    return torch.nn.utils.rnn.pad_sequence(list(per_sample), batch_first=True, padding_value=fill)


def unpad_responses(padded: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of `pad_responses`: row `i` cut to `lengths[i]`."""
    return [padded[i, :n] for i, n in enumerate(lengths)]


def resolve_batch(data: Any, *, dp_rank: int, dp_size: int) -> RolloutBatch:
    """This rank's `RolloutBatch` from any of the forms `TrainWorker.train` accepts.

    `data` is a `RolloutBatch`, an ObjectRef or `Box` of one, or a list with one
    of those per data-parallel rank (this rank, `dp_rank` of `dp_size`, takes its own).
    """
    from tandem.value_transfer import Box  # Ray: the shared data imports none itself

    if isinstance(data, list | tuple):
        if len(data) != dp_size:
            raise ValueError(
                f"data_ref: got {len(data)} per-rank batches for {dp_size} data-parallel ranks; "
                "split the rollout into one batch per data-parallel rank"
            )
        data = data[dp_rank]
    if isinstance(data, Box):
        data = data.get()
    if not isinstance(data, RolloutBatch):
        import ray

        if isinstance(data, ray.ObjectRef):
            data = ray.get(data)
    if not isinstance(data, RolloutBatch):
        raise TypeError(
            f"data_ref: expected a RolloutBatch (or a ref, Box or per-rank list of one), got {data!r}"
        )
    return data
