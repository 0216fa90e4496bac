"""What changed in the engine's weights at each weight sync, counted on the device while the sync copies.

The engine receives every weight of the actor at each sync and copies it over its
own. `ChangeCounter.copy_in` does that copy and, in the same pass, compares each
element's bits before it overwrites them (the engine's dtype: an element counts as
changed when the value it samples with is another one). It keeps, per weight, one
bit per element that says whether the element has ever changed since the engine
loaded its weights: a packed bitmask, `ceil(numel / 8)` bytes per tensor, so 1/16
of the weights' own memory in bfloat16 and 1/32 in float32 (62 MB for a 0.5B
model). No copy of the weights is kept: "since the start" is "ever changed"
(an element that changed and changed back still counts), which is what a bitmask
of changes can say without the start's values. The bitmask lives beside the
weights and moves to the host with them when the engine releases its memory.

The counts stay on the device until `take` (one read per sync, after it). On CUDA
one Triton kernel launch for all the tensors of a call (one a dtype pair) compares,
packs the bits, counts and copies (`_weight_change_kernel.py`); elsewhere, and for
tensors the kernel does not take (not contiguous, not floating point), `count_and_copy`
does the same in slices: with NumPy on the CPU (torch's small operations there cost
many times the copy), with torch operations on another device.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["ChangeCounter", "WeightChanges", "count_and_copy", "weight_magnitudes"]

SLICE_ELEMENTS = 1 << 22
"""Elements compared at a time by the torch path (a multiple of 8: a slice packs into whole bytes)."""

_BIT_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)

_BITS_OF: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each element size: elements are compared by their bits."""


@dataclass(frozen=True)
class WeightChanges:
    """The engine's weights' changes over the syncs since the last read (`ChangeCounter.take`).

    Attributes:
        changed: elements whose value changed in those syncs (an element counts once a sync).
        changed_since_start: elements that have changed at least once since the engine loaded its weights.
        elements: elements of the engine's weights (each tensor once, tied ones included once).
    """

    changed: int
    changed_since_start: int
    elements: int

    @property
    def fraction(self) -> float:
        """`changed` over `elements` (`policy/changed_fraction`)."""
        return self.changed / self.elements if self.elements else 0.0

    @property
    def fraction_since_start(self) -> float:
        """`changed_since_start` over `elements` (`policy/changed_fraction_since_start`)."""
        return self.changed_since_start / self.elements if self.elements else 0.0


def count_and_copy(
    target: torch.Tensor, source: torch.Tensor, bits: torch.Tensor, counts: torch.Tensor
) -> None:
    """Copy `source` into `target`, counting the elements that change and marking them in `bits`.

    `bits`: `ceil(target.numel() / 8)` uint8, bit `i % 8` of byte `i // 8` set once element `i`
    of `target` (in row-major order) has changed. `counts` (int64, 2, on `target`'s device) gets
    the elements changed in this copy added to `counts[0]`, those changed for the first time to
    `counts[1]`. Elements compare by their bits in `target`'s dtype (`source` is cast first, as
    `copy_` casts it).
    """
    if not target.is_contiguous():
        # A strided view: compare on a contiguous copy, then copy as `copy_` does.
        staged = target.contiguous()
        count_and_copy(staged, source, bits, counts)
        target.copy_(staged)
        return
    if target.device.type == "cpu":
        _count_on_the_host(target, source, bits, counts)
    else:
        _count_with_torch(target, source, bits, counts)


def _count_on_the_host(
    target: torch.Tensor, source: torch.Tensor, bits: torch.Tensor, counts: torch.Tensor
) -> None:
    """`count_and_copy` of a contiguous CPU `target`, compared, packed, counted and copied by NumPy
    (on two busy cores, a slice's torch comparison took 33 ms where NumPy's took 2)."""
    flat = target.view(-1)
    incoming = source.reshape(-1)
    as_bits = np.dtype(f"int{8 * target.element_size()}")
    changed_now = fresh = 0
    for start in range(0, flat.numel(), SLICE_ELEMENTS):
        stop = min(start + SLICE_ELEMENTS, flat.numel())
        new = incoming[start:stop].to(dtype=target.dtype).contiguous()
        old_bits, new_bits = _host_view(flat[start:stop], as_bits), _host_view(new, as_bits)
        changed = old_bits != new_bits
        packed = np.packbits(changed, bitorder="little")  # element i of a byte is its bit i
        mask = _host_view(bits[start // 8 : start // 8 + packed.size], np.dtype(np.uint8))
        changed_now += int(np.count_nonzero(changed))
        fresh += int(np.count_nonzero(np.unpackbits(packed & ~mask)))
        mask |= packed
        old_bits[:] = new_bits
    counts += torch.tensor([changed_now, fresh], dtype=torch.int64)


def _host_view(tensor: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    """A NumPy array over a contiguous CPU tensor's memory, valid while the tensor lives.

    Made from the address, not with `Tensor.numpy()`: a storage that NumPy was handed through torch
    can no longer be resized, and the engine frees its weights' storages (and the bitmask's) at
    every release of its memory.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return np.empty(0, dtype=dtype)
    return np.frombuffer((ctypes.c_byte * nbytes).from_address(tensor.data_ptr()), dtype=dtype)


def _count_with_torch(
    target: torch.Tensor, source: torch.Tensor, bits: torch.Tensor, counts: torch.Tensor
) -> None:
    """`count_and_copy` of a contiguous `target` on any device, with torch operations."""
    flat = target.view(-1)
    incoming = source.reshape(-1)
    as_bits = _BITS_OF[target.element_size()]
    shifts = torch.arange(8, dtype=torch.uint8, device=target.device)
    values = torch.tensor(_BIT_VALUES, dtype=torch.uint8, device=target.device)
    for start in range(0, flat.numel(), SLICE_ELEMENTS):
        stop = min(start + SLICE_ELEMENTS, flat.numel())
        old = flat[start:stop]
        new = incoming[start:stop].to(device=target.device, dtype=target.dtype)
        changed = old.view(as_bits) != new.view(as_bits)
        tail = -(stop - start) % 8  # the last slice of a tensor whose size is no multiple of 8
        padded = (torch.cat([changed, changed.new_zeros(tail)]) if tail else changed).view(-1, 8)
        mask = bits[start // 8 : start // 8 + padded.shape[0]]
        before = ((mask.unsqueeze(1) >> shifts) & 1).bool()
        counts[0] += changed.sum()
        counts[1] += (padded & ~before).sum()
        mask |= (padded.to(torch.uint8) * values).sum(1, dtype=torch.uint8)
        old.copy_(new)


class ChangeCounter:
    """Counts the changes that weight syncs make to `weights` (name -> tensor, tied names sharing one).

    Allocates the bitmask (one bit per element, one buffer for all tensors) on the weights'
    device; `tensors()` is what a memory backend moves with the weights. `fused`: copy and count
    with `_weight_change_kernel` (by default on CUDA; the tests also run it on the CPU, in
    Triton's interpreter).
    """

    def __init__(
        self, weights: Mapping[str, torch.Tensor], device: torch.device, *, fused: bool | None = None
    ) -> None:
        self.device = device
        self._offset: dict[int, int] = {}
        self._numel: dict[int, int] = {}
        nbytes = 0
        for tensor in weights.values():
            key = id(tensor)
            if key in self._offset:
                continue
            self._offset[key] = nbytes
            self._numel[key] = tensor.numel()
            nbytes += math.ceil(tensor.numel() / 8)
        self.elements = sum(self._numel.values())
        self.bits = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)
        self._since_start = 0
        self._kernel: Any = None
        self._kernel_dtypes: Container[torch.dtype] = ()
        if device.type == "cuda" if fused is None else fused:
            from ._weight_change_kernel import DTYPES, copy_and_count  # Triton: CUDA hosts only

            self._kernel, self._kernel_dtypes = copy_and_count, DTYPES

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors the counter holds (the bitmask and the counts)."""
        return [self.bits, self.counts]

    def copy_in(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy `source` over the weight `target` (one of the counter's), counting what changes."""
        self.copy_in_many([(target, source)])

    def copy_in_many(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each `source` over its weight `target` (the counter's; each target once), counting what changes.

        The kernel takes the contiguous floating-point targets at once (their sources moved to the
        targets' device first); the others are counted one by one by `count_and_copy`.
        """
        fused: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for target, source in copies:
            offset = self._offset[id(target)]
            if (
                self._kernel is not None
                and target.dtype in self._kernel_dtypes
                and source.dtype in self._kernel_dtypes
                and target.is_contiguous()
                and target.device == self.bits.device
            ):
                if source.device != target.device:
                    source = source.to(target.device, non_blocking=True)
                fused.append((target, source.contiguous(), offset))
            else:
                bits = self.bits[offset : offset + math.ceil(self._numel[id(target)] / 8)]
                count_and_copy(target, source, bits, self.counts)
        if fused:
            self._kernel(fused, self.bits, self.counts)

    def take(self) -> WeightChanges:
        """The changes since the last `take` (one device-to-host read), and the count since the start."""
        changed, fresh = (int(x) for x in self.counts.tolist())
        self.counts.zero_()
        self._since_start += fresh
        return WeightChanges(changed=changed, changed_since_start=self._since_start, elements=self.elements)


def weight_magnitudes(weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """How large the weights are, for the spacing of their dtype: `{"dtype", "eps", "exponents", "zeros"}`.

    `exponents[e]` counts the elements with `2**e <= |w| < 2**(e + 1)` (floating-point weights,
    each tensor once); a weight's spacing in `dtype` is `2**e * eps` there. `zeros` counts the
    elements equal to 0.
    """
    counts: dict[int, int] = {}
    zeros = 0
    seen: set[int] = set()
    with torch.no_grad():
        for tensor in weights.values():
            if id(tensor) in seen or not tensor.is_floating_point():
                continue
            seen.add(id(tensor))
            for part in tensor.detach().reshape(-1).split(SLICE_ELEMENTS):
                mantissa, exponent = torch.frexp(part.float())
                nonzero = mantissa != 0
                zeros += int((~nonzero).sum())
                # frexp: |w| = m * 2**x with 0.5 <= m < 1, so 2**(x - 1) <= |w| < 2**x.
                values, numbers = torch.unique(exponent[nonzero] - 1, return_counts=True)
                for e, n in zip(values.tolist(), numbers.tolist(), strict=True):
                    counts[int(e)] = counts.get(int(e), 0) + int(n)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "eps": float(torch.finfo(dtype).eps),
        "exponents": dict(sorted(counts.items())),
        "zeros": zeros,
    }
