"""CPU tensors that cross Ray without a copy: numpy views in the object store, torch tensors again on arrival.

Ray keeps numpy arrays out of band (pickle protocol 5) in its shared-memory object
store and hands the receiver a view of them, while a torch tensor is pickled as
bytes and copied on both sides: about ten times slower for the weight chunks that
`update_weights` sends to an engine on another GPU. `zero_copy(t)` wraps a CPU
tensor so that it travels as a numpy view of its bytes (an integer type of the
same width, so bf16 goes too) and is unpickled as a plain `torch.Tensor` of the
same dtype and shape. What arrives is read-only shared memory: copy it before
writing (an engine copies the weights into its own parameters anyway).

Torch and numpy only: the receiving process unpickles `_rebuild` from here.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["zero_copy"]

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _ZeroCopy:
    """Pickles as `_rebuild(numpy view of the bytes, dtype name, shape)`."""

    __slots__ = ("array", "dtype", "shape")

    def __init__(self, tensor: torch.Tensor) -> None:
        flat = tensor.detach().contiguous().reshape(-1)
        self.array = flat.view(_INT_OF_WIDTH[flat.element_size()]).numpy()
        self.dtype = str(tensor.dtype).removeprefix("torch.")
        self.shape = tuple(tensor.shape)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _rebuild, (self.array, self.dtype, self.shape)


def zero_copy(tensor: torch.Tensor) -> Any:
    """`tensor` (on the CPU) as an object that Ray passes without a copy and that unpickles as the tensor."""
    if tensor.device.type != "cpu":
        raise ValueError(f"zero_copy: the tensor is on {tensor.device}; copy it to the CPU first")
    if tensor.element_size() not in _INT_OF_WIDTH or tensor.is_complex():
        raise ValueError(f"zero_copy: dtype {tensor.dtype} is not supported (1, 2, 4 or 8-byte real types)")
    return _ZeroCopy(tensor)


def _rebuild(array: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():
        # Ray's zero-copy arrays are read-only; torch warns that it cannot mark the tensor so.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array).view(getattr(torch, dtype)).reshape(shape)
