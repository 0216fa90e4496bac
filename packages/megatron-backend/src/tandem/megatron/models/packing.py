"""Sequence packing: the samples of a micro-batch as one row with no padding between them.

Instead of padding every sample to the micro-batch's longest one, a packed
micro-batch concatenates its samples into a single row of `sum(len_i)` tokens
(Megatron's THD layout: tokens, heads, head dim, no batch dimension). The
boundaries travel as cumulative lengths, `cu_seqlens = [0, len_0, len_0 + len_1, ...]`;
every sample keeps the positions it has alone (they restart at 0 at each
boundary) and attends only to itself, causally, so each sample's outputs are
those of the padded path.

When the row must be a multiple of some size (sequence parallelism splits it
over the tensor-parallel ranks), trailing filler tokens are added as one more
segment of their own: they attend only to each other and their outputs are
never read.

Everything here is pure (torch only); `packed_seq_params` builds the Megatron
object that carries the boundaries to the attention layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from tandem.megatron.batch import to_device


@dataclass(frozen=True)
class PackedRow:
    """Where each sample of a packed micro-batch lies in its one row.

    Attributes:
        lengths: tokens of each sample, in order.
        pad: filler tokens after the last sample (0 unless the row must be a multiple of some size).
    """

    lengths: tuple[int, ...]
    pad: int = 0

    @property
    def offsets(self) -> tuple[int, ...]:
        """The first position of each sample in the row."""
        return tuple(self.cu_seqlens[: len(self.lengths)])

    @property
    def segments(self) -> tuple[int, ...]:
        """Lengths of the row's attention blocks: the samples, then the filler if any."""
        return (*self.lengths, self.pad) if self.pad else self.lengths

    @property
    def cu_seqlens(self) -> list[int]:
        """Cumulative block lengths `[0, ..., total]`, one boundary per block (filler included)."""
        bounds = [0]
        for n in self.segments:
            bounds.append(bounds[-1] + n)
        return bounds

    @property
    def total(self) -> int:
        """Tokens of the whole row, filler included."""
        return sum(self.lengths) + self.pad

    @property
    def max_seqlen(self) -> int:
        """The longest block (what the rotary table must cover)."""
        return max(self.segments, default=0)


def pack_lengths(lengths: Sequence[int], multiple: int = 1) -> PackedRow:
    """The packed layout of samples of `lengths` tokens, filled up to a multiple of `multiple`."""
    if multiple < 1:
        raise ValueError(f"pack_lengths: multiple is {multiple}; it must be at least 1")
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"pack_lengths: lengths {list(lengths)[:8]} must be one or more positive integers")
    total = sum(lengths)
    return PackedRow(tuple(int(n) for n in lengths), pad=-total % multiple)


def position_ids(row: PackedRow) -> torch.Tensor:
    """Positions of the row's tokens, restarting at 0 at each block. Shape `(row.total,)`, int64."""
    return torch.cat([torch.arange(n) for n in row.segments])


def block_ids(row: PackedRow) -> torch.Tensor:
    """Which block each token belongs to (samples 0.., then the filler). Shape `(row.total,)`, int64."""
    return torch.repeat_interleave(torch.arange(len(row.segments)), torch.tensor(row.segments))


def block_causal_mask(row: PackedRow, device: torch.device | str | None = None) -> torch.Tensor:
    """The row's attention mask, `True` where attention is NOT allowed (Megatron's convention).

    Query `i` may attend to key `j` iff both lie in the same block and `j <= i`:
    block-diagonal and causal. Shape `(row.total, row.total)`, bool.
    """
    ids = to_device(block_ids(row), device)
    index = torch.arange(row.total, device=device)
    allowed = (ids[:, None] == ids[None, :]) & (index[None, :] <= index[:, None])
    return ~allowed


def pack_tokens(tokens: Sequence[torch.Tensor], row: PackedRow) -> torch.Tensor:
    """The samples' tokens concatenated, filler token 0 after them. Shape `(row.total,)`."""
    parts = [t.reshape(-1) for t in tokens]
    if row.pad:
        parts.append(parts[0].new_zeros(row.pad))
    return torch.cat(parts)


def packed_seq_params(row: PackedRow, device: torch.device | str | None = None) -> Any:
    """Megatron's `PackedSeqParams` (THD) for the row: its block boundaries for RoPE and attention.

    Megatron's attention layer applies RoPE per block from these (positions restart
    at each sample) and hands them to the core attention, which must keep blocks apart.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = to_device(torch.tensor(row.cu_seqlens, dtype=torch.int32), device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=row.max_seqlen,
        max_seqlen_kv=row.max_seqlen,
    )
    # The blocks' lengths as the host knows them: `segments_of` reads them here rather than copying
    # `cu_seqlens` back from the GPU, which would make the host wait for the GPU at every layer.
    params.tandem_segments = tuple(row.segments)
    return params


def segments_of(params: Any) -> list[int]:
    """Block lengths from a THD `PackedSeqParams` (its `cu_seqlens_q`); ValueError for other layouts."""
    if getattr(params, "qkv_format", None) != "thd":
        raise ValueError(f"packed attention: qkv_format {getattr(params, 'qkv_format', None)!r}; only 'thd'")
    q, kv = params.cu_seqlens_q, params.cu_seqlens_kv
    known = getattr(params, "tandem_segments", None)
    if known is not None and q is kv and params.cu_seqlens_q_padded is None:
        return list(known)  # `packed_seq_params`' own: no copy back from the device
    same = q is kv or torch.equal(q, kv)
    if params.cu_seqlens_q_padded is not None or not same:
        raise ValueError("packed attention: self-attention needs the same unpadded cu_seqlens for q and kv")
    bounds = params.cu_seqlens_q.tolist()
    return [b - a for a, b in pairwise(bounds)]
