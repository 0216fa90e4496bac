"""A micro-batch's response tensors from the model's output: the actor's log-probs (and entropy), the critic's values.

The positions that predict each sample's response tokens are picked with one index
(`ResponseIndex`: padded rows, or one packed row), so the prompts never reach the softmax
and the backward adds one gradient of the picked rows, not one logits-sized gradient a
sample. The actor's log-probs over the vocabulary-parallel logits come from the Triton
kernels (`fused_log_probs.py`, CUDA), `chunked_log_probs` (a chunk of rows at a time) or
plain autograd (`vocab_parallel_log_probs`, the reference of both); every path returns
the same `(b, max_response_len)` tensors, 0 past each response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.megatron.algorithms.entropy import entropy_of_shifted
from tandem.megatron.batch import RolloutBatch, to_device
from tandem.megatron.choices import Role
from tandem.megatron.models.packing import PackedRow
from tandem.megatron.worker.fused_log_probs import fused_log_probs
from tandem.megatron.worker.log_probs import chunked_log_probs


@dataclass
class ResponseOutputs:
    """The model's response tensors of one micro-batch, each `(b, max_response_len)`, 0 past each response.

    Attributes:
        log_probs: actor only: log-probs of the response tokens under `logits / temperature`.
        entropy: actor only, when asked: entropy of that distribution at each response token.
        values: critic only: fp32 values of the state before each response token.

    Also readable as a mapping (`outputs["log_probs"]`).
    """

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        value = getattr(self, key, None) if key in ("log_probs", "entropy", "values") else None
        if value is None:
            raise KeyError(key)
        return value


def response_rows(mb: RolloutBatch, packed: PackedRow | None = None) -> list[tuple[int, int, int]]:
    """(row, first position, last position + 1) of the positions that predict each sample's response.

    Padded: sample `i` is row `i`, from position 0. Packed: every sample is in row 0, from its offset.
    """
    rows = []
    offsets = packed.offsets if packed is not None else (0,) * len(mb)
    for i, (toks, rlen, offset) in enumerate(zip(mb.tokens, mb.response_lengths, offsets, strict=True)):
        end = offset + int(toks.numel())
        rows.append((0 if packed is not None else i, end - rlen - 1, end - 1))
    return rows


@dataclass(frozen=True)
class ResponseIndex:
    """Where a micro-batch's response positions are, as flat indices for one gather and one scatter.

    `source[k]`: the k-th response position (samples in order) in the model output
    flattened over `(rows, seq)`; the response token it predicts is at `source[k] + 1`
    of the flattened tokens. `dest[k]`: where that position goes in the flattened
    `(samples, longest response)` result. One `index_select` and one `index_put`
    instead of a slice per sample: autograd then scatters the gradient of the whole
    micro-batch into the model output at once, where per-sample slices would each
    allocate and add an output-sized gradient (the vocabulary's logits, gigabytes).
    """

    source: torch.Tensor
    dest: torch.Tensor
    samples: int
    longest: int

    @classmethod
    def of(cls, rows: Sequence[tuple[int, int, int]], seq_len: int, device: torch.device) -> ResponseIndex:
        """The index of `_response_rows`' `rows` in an output of `seq_len` positions a row, on `device`."""
        lengths = [end - begin for _, begin, end in rows]
        longest = max(lengths, default=0)
        source = torch.cat(
            [torch.arange(row * seq_len + begin, row * seq_len + end) for row, begin, end in rows]
        )
        dest = torch.cat([torch.arange(i * longest, i * longest + n) for i, n in enumerate(lengths)])
        return cls(to_device(source, device), to_device(dest, device), len(rows), longest)

    def hidden_rows(self, rows: int, seq_len: int) -> torch.Tensor:
        """The same positions in Megatron's hidden states `(seq, rows, ...)` flattened: `position * rows + row`.

        What `head_rows.HeadRows.only` takes, so that the output layer computes these positions alone."""
        return (self.source % seq_len) * rows + torch.div(self.source, seq_len, rounding_mode="floor")

    def gather(self, output: torch.Tensor) -> torch.Tensor:
        """The response positions of `output` (`(rows, seq, ...)`) as `(positions, ...)`."""
        return output.reshape(-1, *output.shape[2:]).index_select(0, self.source)

    def targets(self, tokens: torch.Tensor) -> torch.Tensor:
        """The response tokens that the positions predict, from `tokens` (`(rows, seq)`)."""
        return tokens.reshape(-1).index_select(0, self.source + 1)

    def padded(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position `values` as `(samples, longest)`, 0 past each response (differentiable)."""
        flat = values.new_zeros(self.samples * self.longest).index_put((self.dest,), values)
        return flat.view(self.samples, self.longest)


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    with_entropy: bool = False,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` (and entropies) from this TP rank's vocabulary slice of `logits`.

    Shape: logits `(n, padded_vocab / tp)`, targets `(n,)` global token ids; returns `(n,)` tensors.
    `vocab_size`: the tokenizer's vocabulary; the columns of the padding rows past it
    (`ModelSpec.padded_vocab_size`) are left out of the softmax, so the distribution is
    the Hugging Face model's. None: every column is a token.
    Differentiable: the sums over the vocabulary are all-reduced with Megatron's
    `reduce_from_tensor_model_parallel_region` (identity backward), so each rank's
    gradient reaches only its own slice, as Megatron's vocab-parallel cross entropy does.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_size = mpu.get_tensor_model_parallel_world_size()
    vocab_local = logits.shape[-1]
    start = mpu.get_tensor_model_parallel_rank() * vocab_local
    if vocab_size is not None and start + vocab_local > vocab_size:
        # The finite floor, not -inf: exp gives exactly 0, and 0 * floor stays 0 in the entropy.
        padding = torch.arange(start, start + vocab_local, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padding, torch.finfo(logits.dtype).min)
    # A shift for stability only: no gradient flows through it.
    shift = logits.detach().max(dim=-1).values
    if tp_size > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    shifted = logits - shift.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    log_z = sum_exp.log()
    in_slice = (targets >= start) & (targets < start + vocab_local)
    local_target = (targets - start).clamp(0, vocab_local - 1)
    picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_slice
    log_probs = reduce_from_tensor_model_parallel_region(picked) - log_z
    if not with_entropy:
        return log_probs, None
    return log_probs, entropy_of_shifted(shifted, exp, sum_exp, reduce_from_tensor_model_parallel_region)


def response_outputs(
    mb: RolloutBatch,
    tokens: torch.Tensor,
    output: torch.Tensor,
    *,
    role: Role,
    temperature: float,
    with_entropy: bool,
    packed: PackedRow | None = None,
    vocab_size: int | None = None,
    log_probs_chunk_tokens: int = 0,
    fused: bool = False,
    index: ResponseIndex | None = None,
    head_at_responses: bool = False,
) -> ResponseOutputs:
    """The response tensors of a micro-batch from the model `output` (`(rows, seq, vocab / tp)` or
    `(rows, seq, 1)`) of `tokens` (`(rows, seq)`): padded rows, or one `packed` row.

    `fused`: the actor's log-probs through `fused_log_probs` (Triton, CUDA); else
    `log_probs_chunk_tokens`: rows of the actor's logits at a time through `chunked_log_probs`;
    0: all of them through `vocab_parallel_log_probs` (plain autograd, fp32 copies of them all).
    `index`: the micro-batch's `ResponseIndex` where the caller has it; `head_at_responses`: the
    actor's `output` is already the response positions' logits alone, `(1, positions, vocab / tp)`
    in `index`'s order (the model's head ran within `HeadRows.only(index.hidden_rows(...))`)."""
    if index is None:
        index = ResponseIndex.of(response_rows(mb, packed), tokens.shape[1], output.device)
    if role == "critic":
        return ResponseOutputs(values=index.padded(index.gather(output[..., 0]).float()))
    # Only the positions that predict response tokens: prompts never reach the softmax.
    if head_at_responses:
        if output.shape[:2] != (1, index.source.numel()):
            raise ValueError(
                f"response_outputs: head_at_responses expects logits of shape (1, {index.source.numel()}, "
                f"vocab), one row a response position; got {tuple(output.shape)}"
            )
        logits = output[0]
    else:
        logits = index.gather(output)
    targets = index.targets(tokens)
    if fused:
        log_probs, entropy = fused_log_probs(
            logits, targets, temperature=temperature, with_entropy=with_entropy, vocab_size=vocab_size
        )
    elif log_probs_chunk_tokens:
        log_probs, entropy = chunked_log_probs(
            logits,
            targets,
            temperature=temperature,
            with_entropy=with_entropy,
            vocab_size=vocab_size,
            chunk_tokens=log_probs_chunk_tokens,
        )
    else:
        log_probs, entropy = vocab_parallel_log_probs(
            logits.float() / temperature, targets, with_entropy=with_entropy, vocab_size=vocab_size
        )
    return ResponseOutputs(
        log_probs=index.padded(log_probs), entropy=None if entropy is None else index.padded(entropy)
    )
