"""Checks of the public functions' arguments: a wrong type or value is a TypeError or ValueError naming it.

Without them a numpy array, a single tensor or a list of floats would fail deep inside
(an AttributeError from `.detach`, a RuntimeError from `torch.cat`, or worse, a tensor's
truth value), far from the argument that caused it.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

# Ray turns a timeout into milliseconds in a C long; a century is far below that limit.
_LONGEST_TIMEOUT_S = 100 * 365 * 24 * 3600


def type_name(value: object) -> str:
    """The type of `value` as a message shows it (`numpy.ndarray`, `Tensor`, `generator`)."""
    kind = type(value)
    module = kind.__module__
    return (
        kind.__qualname__
        if module in ("builtins", "torch")
        else f"{module.split('.')[0]}.{kind.__qualname__}"
    )


def tensor_list(name: str, values: object) -> Sequence[Tensor]:
    """`values` as a list or tuple of tensors, one per sample; TypeError naming `name` otherwise."""
    if isinstance(values, Tensor):
        raise TypeError(
            f"{name} must be a list of tensors, one per sample, got a single Tensor of shape "
            f"{tuple(values.shape)}; pass [tensor] for one sample, or list(tensor) for one value per row"
        )
    if not isinstance(values, list | tuple):
        raise TypeError(
            f"{name} must be a list (or tuple) of torch.Tensor, one per sample, got {type_name(values)}"
        )
    for i, v in enumerate(values):
        if not isinstance(v, Tensor):
            raise TypeError(
                f"{name}[{i}] is a {type_name(v)}, not a torch.Tensor; convert with torch.as_tensor"
            )
    return values


def index(name: str, value: object, *, minimum: int = 0) -> int:
    """`value` as an int >= `minimum` (bools refused); TypeError or ValueError naming `name`."""
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an int, not a bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name}={value!r} must be an int, got {type_name(value)}") from None
    if number < minimum:
        raise ValueError(f"{name}={number} must be at least {minimum}")
    return number


def index_list(name: str, values: object, *, unique: bool = False) -> tuple[int, ...]:
    """`values` as a tuple of ints >= 0 (a list, tuple or range); TypeError or ValueError naming `name`."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a list of sample indices (ints), got {type_name(values)}")
    indices = tuple(index(f"{name}[{i}]", v) for i, v in enumerate(values))
    if unique and len(set(indices)) != len(indices):
        twice = sorted(i for i, n in Counter(indices).items() if n > 1)
        raise ValueError(f"{name} lists samples {twice[:10]} more than once; each sample has one value")
    return indices


def flag(name: str, value: object) -> bool:
    """`value` as a bool; TypeError naming `name` otherwise (a truthy list or string is a mistake)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False, got {type_name(value)}")
    return value


def device(name: str, value: Any) -> torch.device:
    """`value` as a CPU or (available) CUDA device; TypeError or ValueError naming `name` otherwise."""
    if not isinstance(value, str | torch.device):
        raise TypeError(
            f"{name} must be a torch.device or a string such as 'cpu' or 'cuda:0', got {type_name(value)}"
        )
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a device; give 'cpu', 'cuda' or 'cuda:<index>'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}={value!r}: values are unpacked to 'cpu' or 'cuda' only")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={value!r} but CUDA is not available here; unpack to 'cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{name}={value!r} but this process sees {torch.cuda.device_count()} CUDA devices")
    return dev


def timeout(name: str, value: object) -> float | None:
    """`value` as None (wait forever) or seconds >= 0; TypeError or ValueError naming `name`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}={value!r} must be seconds (a number) or None, got {type_name(value)}")
    if not value >= 0:  # also catches NaN
        raise ValueError(f"{name}={value!r} must be >= 0 seconds, or None to wait forever")
    if value == math.inf:
        return None
    if value > _LONGEST_TIMEOUT_S:
        raise ValueError(f"{name}={value!r} seconds is more than Ray accepts; give None to wait forever")
    return float(value)
