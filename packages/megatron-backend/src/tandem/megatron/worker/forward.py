"""Forward (and backward) passes of actor and critic over a rollout batch, through Megatron's pipeline schedule.

Each micro-batch is right-padded to its own longest sample (causal attention
means padding at the end never changes the real tokens, and positions start
at 0 for every sample as in the rollout engine), or, with `packed=True`
(`WorkerConfig.use_sequence_packing`), its samples are concatenated into one
row with no padding between them (`packing.py`): positions restart at every
sample and attention never crosses a boundary (Megatron's THD
`PackedSeqParams`; `attention.py` says how our core attentions honour it), so
each sample's outputs are the padded path's. On pipeline-last-stage ranks
the model output is cut down to each sample's response positions and padded
to the micro-batch's longest response, `(b, max_response_len)`, 0 past each
response (the same in both layouts):

- actor: `log_probs[t] = log softmax(logits / temperature)[token_t]` taken from
  the position that predicts response token `t`, computed vocab-parallel
  (no rank gathers the full vocabulary) a chunk of rows at a time
  (`log_probs.py`); `entropy[t]` of that same distribution when asked;
- critic: `values[t]` = the value head at that position (never divided by the
  temperature), fp32.

`run_micro_batches` hands those (with autograd when `backward`) to a
`loss_fn` in Megatron's per-token-loss form; `forward_only` returns them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from tandem.megatron.batch import RolloutBatch, pad_responses, to_device
from tandem.megatron.choices import ROLES, Role
from tandem.megatron.models._cpu_compat import enable_cpu_compat
from tandem.megatron.models.head_rows import head_rows
from tandem.megatron.models.packing import (
    PackedRow,
    pack_lengths,
    pack_tokens,
    packed_seq_params,
    position_ids,
)
from tandem.megatron.worker.fused_log_probs import fused_log_probs_available
from tandem.megatron.worker.response_outputs import (
    ResponseIndex,
    ResponseOutputs,
    response_outputs,
    response_rows,
)

LossFn = Callable[[RolloutBatch, ResponseOutputs], tuple[torch.Tensor, torch.Tensor, Mapping[str, Any]]]
"""`loss_fn(micro_batch, outputs) -> (loss_sum, count, metrics)`: Megatron's per-token-loss form."""


def micro_batches(batch: RolloutBatch, micro_batch_size: int) -> list[RolloutBatch]:
    """`batch` cut into consecutive micro-batches of `micro_batch_size` samples (the last may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size is {micro_batch_size}; it must be at least 1")
    n = len(batch)
    return [batch.select(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]


def micro_batches_by_tokens(batch: RolloutBatch, max_tokens: int, *, packed: bool) -> list[RolloutBatch]:
    """`batch` cut into consecutive micro-batches of at most `max_tokens` tokens each.

    A micro-batch's tokens are what its forward pass computes on: the packed row's length
    (`packed`), else its samples times the longest of them (padding included). Samples keep
    their order, so outputs come back in the batch's order; a sample longer than
    `max_tokens` gets a micro-batch of its own.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_gpu is {max_tokens}; it must be at least 1")
    cuts: list[range] = []
    start, longest, total = 0, 0, 0
    for i, tokens in enumerate(batch.tokens):
        n = int(tokens.numel())
        grown = total + n if packed else (i - start + 1) * max(longest, n)
        if i > start and grown > max_tokens:
            cuts.append(range(start, i))
            start, longest, total = i, 0, 0
            grown = n
        longest, total = max(longest, n), total + n
    if len(batch):
        cuts.append(range(start, len(batch)))
    return [batch.select(c) for c in cuts]


def plan_micro_batches(
    batch: RolloutBatch, *, micro_batch_size: int, max_tokens: int | None, packed: bool
) -> list[RolloutBatch]:
    """The micro-batches of `batch`: by tokens when `max_tokens` is set (dynamic batch size), else by count."""
    if max_tokens is not None:
        return micro_batches_by_tokens(batch, max_tokens, packed=packed)
    return micro_batches(batch, micro_batch_size)


def _padded_tokens(mb: RolloutBatch, device: torch.device) -> torch.Tensor:
    """Tokens of the micro-batch as `(b, max_len)`, right-padded with token 0."""
    padded = torch.nn.utils.rnn.pad_sequence(list(mb.tokens), batch_first=True, padding_value=0)
    return to_device(padded.long(), device)


def _packed_row(mb: RolloutBatch, multiple: int) -> PackedRow:
    """Where the micro-batch's samples lie in its packed row (a multiple of `multiple` tokens)."""
    return pack_lengths([int(t.numel()) for t in mb.tokens], multiple)


def run_micro_batches(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    batches: Sequence[RolloutBatch],
    *,
    role: Role,
    temperature: float = 1.0,
    backward: bool = False,
    loss_fn: LossFn | None = None,
    with_entropy: bool = False,
    packed: bool = False,
    log_probs_chunk_tokens: int = 0,
    fused_log_probs: bool | None = None,
    head_at_responses: bool = True,
) -> list[Mapping[str, Any]]:
    """Run Megatron's forward(-backward) schedule over the micro-batches `batches`; return each one's metrics.

    On pipeline-last-stage ranks, each micro-batch's `ResponseOutputs` go to
    `loss_fn(micro_batch, outputs) -> (loss_sum, count, metrics)`, Megatron's
    per-token-loss form (`TransformerConfig.calculate_per_token_loss`, which
    `models.build_model` turns on): the schedule back-propagates each
    `loss_sum` as it is, adds up the counts, and Megatron's gradient
    finalisation (`finalize_model_grads`, set up by `optimizer.wrap_ddp`)
    sums the gradients over the data-parallel ranks and divides them by the
    count of the whole step. Without DDP the gradients stay the plain sum of
    the `loss_sum`s.

    All ranks of the model (every TP and PP rank of a data-parallel group)
    must call this with the same micro-batches. Returns the metrics dicts,
    one per micro-batch, on last-stage ranks and `[]` on the others.

    Args:
        model: this rank's stage (possibly DDP-wrapped), or a one-element list of it.
        batches: the micro-batches, from `micro_batches(batch, size)`.
        role: "actor" (log-probs, entropy) or "critic" (values).
        temperature: the sampling temperature; actor logits are divided by it.
        backward: also run the backward pass (else outputs carry no autograd graph).
        loss_fn: required with `backward`; `None` without it gives empty metrics.
        with_entropy: also compute the actor's per-token entropy.
        packed: each micro-batch as one packed row instead of padded rows (module docstring).
        log_probs_chunk_tokens: rows of the actor's response logits processed at once by the
            log-prob/entropy kernel (`log_probs.chunked_log_probs`); 0: the whole micro-batch
            in one chunk through plain autograd (`vocab_parallel_log_probs`).
        fused_log_probs: the actor's log-probs through the Triton kernels of
            `fused_log_probs.fused_log_probs` (which then replace the two above); None: where
            the model is on CUDA and Triton is installed; True there only.
        head_at_responses: the actor's output layer computes logits only at the positions that
            predict a response token (`head_rows.HeadRows`), not over prompts and padding; the
            same log-probs, entropies and gradients for less work and memory.
    """
    if role not in ROLES:
        raise ValueError(f"run_micro_batches: role {role!r} is not one of {ROLES}")
    if temperature <= 0:
        raise ValueError(f"run_micro_batches: temperature is {temperature}; it must be positive")
    if backward and loss_fn is None:
        raise ValueError("run_micro_batches: a loss_fn is required when backward=True")
    if with_entropy and role != "actor":
        raise ValueError("run_micro_batches: with_entropy applies to the actor only")
    if log_probs_chunk_tokens < 0:
        raise ValueError(
            f"run_micro_batches: log_probs_chunk_tokens is {log_probs_chunk_tokens!r}; it must be an "
            "integer >= 0 (0: the whole micro-batch through plain autograd)"
        )
    if not batches:
        return []
    enable_cpu_compat()
    # Megatron-core: its modules load once the CPU path is on (`enable_cpu_compat`, just above).
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from tandem.megatron.models.networks import unwrap_model

    chunks = list(model) if isinstance(model, Sequence) else [model]
    gpt = unwrap_model(chunks)
    model_config = gpt.config
    vocab_size = getattr(gpt, "tandem_vocab_size", None)  # set by build_model (padded vocabulary)
    if backward and not model_config.calculate_per_token_loss:
        raise ValueError(
            "run_micro_batches: the model's config has calculate_per_token_loss=False, so Megatron would "
            "divide each loss_sum by its count and the number of micro-batches; build it with build_model"
        )
    device = next(chunks[0].parameters()).device
    fused = fused_log_probs_available(device) if fused_log_probs is None else fused_log_probs
    if fused and not fused_log_probs_available(device):
        raise ValueError(
            f"fused_log_probs: True needs the model on CUDA with Triton installed (the model is on "
            f"{device}); set it to None (auto) or False"
        )
    # Sequence parallelism splits the row over the tensor-parallel ranks: it must divide evenly.
    multiple = model_config.tensor_model_parallel_size if model_config.sequence_parallel else 1

    def loss_func(
        mb: RolloutBatch,
        tokens: torch.Tensor,
        row: PackedRow | None,
        index: ResponseIndex | None,
        output: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        outputs = response_outputs(
            mb,
            tokens,
            output,
            role=role,
            temperature=temperature,
            with_entropy=with_entropy,
            packed=row,
            vocab_size=vocab_size,
            log_probs_chunk_tokens=log_probs_chunk_tokens,
            fused=fused,
            index=index,
            head_at_responses=index is not None,
        )
        if loss_fn is None:
            return output.new_zeros(()), torch.zeros((), dtype=torch.int64), {}
        loss_sum, count, metrics = loss_fn(mb, outputs)
        # The schedule adds the counts up in an int32 tensor of its own.
        return loss_sum, count.to(torch.int64), metrics

    # The actor's last stage: its vocabulary head only where a response token is predicted.
    head = head_rows(gpt) if role == "actor" and head_at_responses else None

    def forward_step(data_iterator: Iterator[RolloutBatch], stage: torch.nn.Module) -> tuple[Any, Any]:
        mb = next(data_iterator)
        row: PackedRow | None = None
        extra: dict[str, Any] = {}
        if packed:
            # One row [1, t]; RoPE positions restart per sample from cu_seqlens (the attention
            # layer's THD path), the position ids say the same for any other reader.
            row = _packed_row(mb, multiple)
            tokens = to_device(pack_tokens(mb.tokens, row).long(), device).unsqueeze(0)
            positions = to_device(position_ids(row), device).unsqueeze(0)
            extra["packed_seq_params"] = packed_seq_params(row, device)
        else:
            tokens = _padded_tokens(mb, device)
            positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
        index = None if head is None else ResponseIndex.of(response_rows(mb, row), tokens.shape[1], device)
        picking = (
            head.only(index.hidden_rows(*tokens.shape))
            if head is not None and index is not None
            else contextlib.nullcontext()
        )
        with picking:
            output = stage(tokens, positions, None, **extra)
        return output, partial(loss_func, mb, tokens, row, index)

    # Stages exchange each activation's shape first (variable_seq_lengths, see hf_config), so
    # rows of any length pass; these two only bound them.
    if packed:
        seq_length = max(_packed_row(mb, multiple).total for mb in batches)
        micro_batch_size = 1
    else:
        seq_length = max(int(t.numel()) for mb in batches for t in mb.tokens)
        micro_batch_size = max(len(mb) for mb in batches)
    forward_backward = get_forward_backward_func()
    result = forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=chunks,
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=not backward,
    )
    return list(result or [])


def forward_only(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    batch: RolloutBatch,
    *,
    role: Role,
    temperature: float = 1.0,
    micro_batch_size: int = 1,
    packed: bool = False,
    max_tokens: int | None = None,
    log_probs_chunk_tokens: int = 0,
    fused_log_probs: bool | None = None,
    head_at_responses: bool = True,
) -> torch.Tensor | None:
    """Response log-probs (actor) or values (critic) of every sample of `batch`, without gradients.

    Returns `(len(batch), batch.max_response_length)`, 0 past each response, on
    pipeline-last-stage ranks (log-probs of `logits / temperature` for the
    actor; fp32 values, never divided by the temperature, for the critic),
    and None on other stages. Every rank of the model must call it. `packed`:
    each micro-batch as one packed row (`run_micro_batches`); `max_tokens`: micro-batches
    cut by tokens instead of by `micro_batch_size` (`plan_micro_batches`); `log_probs_chunk_tokens`,
    `fused_log_probs`, `head_at_responses`: how the actor's log-probs are computed (`run_micro_batches`).
    """
    from megatron.core import parallel_state as mpu

    key = "log_probs" if role == "actor" else "values"
    rows: list[torch.Tensor] = []

    def keep(
        mb: RolloutBatch, outputs: ResponseOutputs
    ) -> tuple[torch.Tensor, torch.Tensor, Mapping[str, Any]]:
        padded = outputs[key].detach()
        rows.extend(padded[i, :n] for i, n in enumerate(mb.response_lengths))
        return padded.new_zeros(()), torch.zeros((), dtype=torch.int64), {}

    with torch.no_grad():
        run_micro_batches(
            model,
            plan_micro_batches(
                batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens, packed=packed
            ),
            role=role,
            temperature=temperature,
            loss_fn=keep,
            packed=packed,
            log_probs_chunk_tokens=log_probs_chunk_tokens,
            fused_log_probs=fused_log_probs,
            head_at_responses=head_at_responses,
        )
    if not mpu.is_pipeline_last_stage():
        return None
    return pad_responses(rows)
