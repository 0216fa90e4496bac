"""Checks of the public functions' arguments: a wrong type or value is a TypeError or ValueError naming it."""

from __future__ import annotations

import math
from typing import Any

# Ray turns a timeout into milliseconds in a C long; a century is far below that limit.
_LONGEST_TIMEOUT_S = 100 * 365 * 24 * 3600


def type_name(value: object) -> str:
    """The type of `value` as a message shows it (`dict`, `numpy.ndarray`)."""
    kind = type(value)
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module.split('.')[0]}.{kind.__qualname__}"


def instance(name: str, value: Any, kind: type, hint: str = "") -> Any:
    """`value` if it is a `kind`; else TypeError naming `name` (and how to make one, `hint`)."""
    if not isinstance(value, kind):
        raise TypeError(
            f"{name} must be a {kind.__name__}, got {type_name(value)}" + (f"; {hint}" if hint else "")
        )
    return value


def count(name: str, value: object) -> int:
    """`value` as an int >= 0 (bools refused); ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an int, got {type_name(value)}")
    if value < 0:
        raise ValueError(f"{name}={value} is negative; give an int >= 0")
    return value


def role(value: object) -> str:
    """A role name: a non-empty string; TypeError or ValueError naming `role`."""
    if not isinstance(value, str):
        raise TypeError(f"role={value!r} must be a string naming the actor (e.g. 'actor', 'engine')")
    if not value.strip():
        raise ValueError(f"role={value!r} is blank; name the actor (e.g. 'actor', 'engine')")
    return value


def timeout(name: str, value: object) -> float | None:
    """`value` as seconds > 0, or None (wait forever); TypeError or ValueError naming `name`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}={value!r} must be seconds (a number) or None to wait forever")
    if not value > 0:  # also NaN
        raise ValueError(f"{name}={value!r} must be more than 0 seconds, or None to wait forever")
    if math.isinf(value):
        return None
    if value > _LONGEST_TIMEOUT_S:
        raise ValueError(f"{name}={value!r} seconds is more than Ray accepts; give None to wait forever")
    return float(value)
