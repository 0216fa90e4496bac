"""The weight sync's copy that counts what it changes, as one Triton kernel a tensor (CUDA).

`copy_and_count(target, source, bits, counts)` does what `_weight_changes.count_and_copy`
does with torch operations, in one pass: each program takes `BLOCK_BYTES` bytes of the
bitmask (8 elements a byte), loads the old and the new elements, compares their bits,
packs the changes into the bytes, counts the elements changed now and those changed for
the first time (two atomic adds a program), writes the bitmask and the new elements. It
replaces the sync's own copy, so the count adds no launch: per element it reads the old
value besides the copy's read and write, and reads and writes an eighth of a byte.
tests/ppo/engines/test_weight_change_kernel.py compares it with the torch path (on a GPU,
or in Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_BYTES = 1024
"""Bitmask bytes a program covers (8192 elements): few programs, so few atomic adds on the two counts."""

_BITS = {1: 8, 2: 16, 4: 32, 8: 64}


@triton.jit(do_not_specialize=["n"])  # one compilation for every tensor size
def _copy_count_kernel(
    dst_ptr, src_ptr, bits_ptr, counts_ptr, n, BITS: tl.constexpr, BLOCK_BYTES: tl.constexpr
):
    pid = tl.program_id(0)
    byte = pid.to(tl.int64) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    lane = tl.arange(0, 8)
    elem = byte[:, None] * 8 + lane[None, :]
    valid = elem < n
    old = tl.load(dst_ptr + elem, mask=valid)
    new = tl.load(src_ptr + elem, mask=valid).to(old.dtype)
    if BITS == 8:
        changed = old.to(tl.int8, bitcast=True) != new.to(tl.int8, bitcast=True)
    elif BITS == 16:
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
    target: torch.Tensor, source: torch.Tensor, bits: torch.Tensor, counts: torch.Tensor
) -> None:
    """`_weight_changes.count_and_copy` for contiguous `target` and `source` on one device, in one kernel."""
    n = target.numel()
    if n == 0:
        return
    if source.numel() != n:
        raise ValueError(f"copy_and_count: {source.numel()} source elements for {n} target elements")
    grid = (triton.cdiv(n, 8 * BLOCK_BYTES),)
    _copy_count_kernel[grid](
        target, source, bits, counts, n, BITS=_BITS[target.element_size()], BLOCK_BYTES=BLOCK_BYTES
    )
