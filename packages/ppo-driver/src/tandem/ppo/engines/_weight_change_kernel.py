"""The weight sync's copy that counts what it changes: one Triton launch for many tensors (CUDA).

`copy_and_count(copies, bits, counts)` does for every (target, source) what
`_weight_changes.count_and_copy` does with torch operations, in one pass and, per group of
tensors of one (target dtype, source dtype), in one kernel launch (as a multi-tensor apply
does): the host writes a small table (a row of int64 a tensor: the target's, the source's and
the bitmask's addresses, the elements, the tensor's first program) and each program's row,
copies both to the device at once, and launches one grid over every tensor's blocks. Each
program reads its row, takes `BLOCK_BYTES` bytes of the tensor's bitmask (8 elements a byte),
loads the old and the new elements, compares their bits, packs the changes into the bytes,
counts the elements changed now and those changed for the first time (two atomic adds a
program), writes the bitmask and the new elements.

A sync of a 0.5B model copies about 290 tensors: a launch and a bitmask slice for each cost
more host time than the copy itself took on the H200 (about 58 us a tensor against 26 us for
a plain `copy_`), hence one launch a group. It replaces the sync's own copy: per element the
kernel reads the old value besides the copy's read and write, and reads and writes an eighth
of a byte. tests/ppo/engines/test_weight_change_kernel.py compares it with the torch path (on
a GPU, or in Triton's interpreter, which reads the same addresses in host memory).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["BLOCK_BYTES", "DTYPES", "copy_and_count"]

BLOCK_BYTES = 1024
"""Bitmask bytes a program covers (8192 elements): few programs, so few atomic adds on the two counts."""

DTYPES: dict[torch.dtype, tl.dtype] = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}
"""The target and source dtypes the kernel takes (the weights' floating-point ones)."""

_COLUMNS = 5
"""int64 a table row: target address, source address, bitmask address, elements, first program."""

_ALIGN = 16
"""Bytes: a group whose addresses are all multiples of it, and whose sizes are multiples of 8, is
compiled with hints that let the loads and stores of a byte's 8 elements be vectorized."""


@triton.jit
def _copy_count_kernel(
    table_ptr,
    row_of_ptr,
    counts_ptr,
    TARGET: tl.constexpr,
    SOURCE: tl.constexpr,
    BITS: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    pid = tl.program_id(0)
    row = table_ptr + tl.load(row_of_ptr + pid).to(tl.int64) * 5
    dst_ptr = tl.load(row).to(tl.pointer_type(TARGET))
    src_ptr = tl.load(row + 1).to(tl.pointer_type(SOURCE))
    n = tl.load(row + 3)
    if ALIGNED:  # the hints go on the pointers: on the integers before the cast they are lost
        dst_ptr = tl.multiple_of(dst_ptr, 16)
        src_ptr = tl.multiple_of(src_ptr, 16)
        n = tl.multiple_of(n, 8)
    bits_ptr = tl.load(row + 2).to(tl.pointer_type(tl.uint8))
    block = pid - tl.load(row + 4)
    byte = block * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    lane = tl.arange(0, 8)
    elem = byte[:, None] * 8 + lane[None, :]
    valid = elem < n
    old = tl.load(dst_ptr + elem, mask=valid)
    new = tl.load(src_ptr + elem, mask=valid).to(TARGET)
    if BITS == 16:
        changed = old.to(tl.int16, bitcast=True) != new.to(tl.int16, bitcast=True)
    elif BITS == 32:
        changed = old.to(tl.int32, bitcast=True) != new.to(tl.int32, bitcast=True)
    else:
        changed = old.to(tl.int64, bitcast=True) != new.to(tl.int64, bitcast=True)
    changed = changed & valid
    byte_valid = byte < (n + 7) // 8
    before = tl.load(bits_ptr + byte, mask=byte_valid, other=0).to(tl.int32)
    was_set = ((before[:, None] >> lane[None, :]) & 1) != 0
    packed = tl.sum(changed.to(tl.int32) << lane[None, :], axis=1)
    tl.store(bits_ptr + byte, (before | packed).to(tl.uint8), mask=byte_valid)
    tl.store(dst_ptr + elem, new, mask=valid)
    now = tl.sum(tl.sum(changed.to(tl.int64), axis=1), axis=0)
    fresh = tl.sum(tl.sum(tl.where(was_set, 0, changed.to(tl.int64)), axis=1), axis=0)
    tl.atomic_add(counts_ptr, now)
    tl.atomic_add(counts_ptr + 1, fresh)


def copy_and_count(
    copies: Sequence[tuple[torch.Tensor, torch.Tensor, int]], bits: torch.Tensor, counts: torch.Tensor
) -> None:
    """`_weight_changes.count_and_copy` for each `(target, source, offset)`, one launch a dtype pair.

    `target` and `source`: contiguous, of one size, on `bits`' device, their dtypes in `DTYPES`;
    the target's bitmask is `bits[offset : offset + ceil(target.numel() / 8)]`. `counts` (int64, 2)
    gets the sums over all copies. Targets must not overlap each other or any source.
    """
    groups: dict[tuple[torch.dtype, torch.dtype, bool], list[int]] = {}
    numels = [target.numel() for target, _, _ in copies]
    addresses = [(target.data_ptr(), source.data_ptr()) for target, source, _ in copies]
    for i, (target, source, _) in enumerate(copies):
        if source.numel() != numels[i]:
            raise ValueError(
                f"copy_and_count: {source.numel()} source elements for {numels[i]} target elements"
            )
        if numels[i] == 0:
            continue
        aligned = (addresses[i][0] | addresses[i][1]) % _ALIGN == 0 and numels[i] % 8 == 0
        groups.setdefault((target.dtype, source.dtype, aligned), []).append(i)
    if not groups:
        return
    order = [i for members in groups.values() for i in members]
    numel = np.array([numels[i] for i in order], dtype=np.int64)
    programs = -(-numel // (8 * BLOCK_BYTES))
    table = np.empty((len(order), _COLUMNS), dtype=np.int64)
    table[:, 0:2] = [addresses[i] for i in order]
    table[:, 2] = bits.data_ptr() + np.array([copies[i][2] for i in order], dtype=np.int64)
    table[:, 3] = numel
    # Each group's grid counts its programs from 0: a tensor's first program within its group.
    sizes = [len(members) for members in groups.values()]
    ends = np.cumsum(sizes)
    group_of_row = np.repeat(np.arange(len(sizes)), sizes)
    first = np.cumsum(programs) - programs
    group_start = np.concatenate([[0], np.cumsum(programs)[ends[:-1] - 1]])
    table[:, 4] = first - group_start[group_of_row]
    row_of_program = np.repeat(np.arange(len(order), dtype=np.int32), programs)
    # One host-to-device copy for the whole call: the table (8-byte aligned), then each program's row.
    host = np.concatenate([table.reshape(-1).view(np.uint8), row_of_program.view(np.uint8)])
    on_device = torch.from_numpy(host).to(bits.device)
    table_on_device = on_device[: table.nbytes].view(torch.int64)
    rows_on_device = on_device[table.nbytes :].view(torch.int32)
    for (target_dtype, source_dtype, aligned), start, stop in zip(
        groups, group_start.tolist(), [*group_start[1:].tolist(), int(programs.sum())], strict=True
    ):
        _copy_count_kernel[(stop - start,)](
            table_on_device,
            rows_on_device[start:stop],
            counts,
            TARGET=DTYPES[target_dtype],
            SOURCE=DTYPES[source_dtype],
            BITS=8 * target_dtype.itemsize,
            ALIGNED=aligned,
            BLOCK_BYTES=BLOCK_BYTES,
        )
