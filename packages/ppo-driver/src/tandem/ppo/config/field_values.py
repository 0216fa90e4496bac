"""Config values from a YAML file, read as the flag parser reads them, or refused naming the field.

YAML has its own idea of types: `lr: 1e-3` is the *string* "1e-3" in YAML 1.1
(PyYAML's), `gamma: high` is a string where a number belongs. Each value is
turned into its field's type the way `--lr 1e-3` would be (a number written as
a string is a number, `None` is None for an optional field, a list is a tuple),
and anything that the flag would refuse is a ValueError naming the file, the
line, the field and its flag, and what it must be.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from tandem.ppo.config.fields import RunFields, flag

__all__ = ["coerce_fields", "field_types"]


@functools.cache
def field_types() -> dict[str, Any]:
    """Each config field's type (Annotated metadata stripped)."""
    return typing.get_type_hints(RunFields)


class _Refused(Exception):
    def __init__(self, expected: str) -> None:
        self.expected = expected


def _optional(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        allows_none = len(args) < len(typing.get_args(tp))
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), allows_none  # noqa: UP007
    return tp, False


def _coerce(value: Any, tp: Any) -> Any:
    inner, allows_none = _optional(tp)
    if value is None or (allows_none and isinstance(value, str) and value.strip() in ("None", "null")):
        if allows_none:
            return None
        raise _Refused(_describe(inner))
    tp = inner
    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise _Refused("true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise _Refused("an integer")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise _Refused("a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise _Refused("a string")
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            if value == choice or (
                isinstance(choice, str) and isinstance(value, int | float) and str(value) == choice
            ):
                return choice
        raise _Refused("one of " + ", ".join(repr(c) for c in choices))
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise _Refused(_describe(tp))
        item = args[0] if args else Any
        try:
            return tuple(_coerce(v, item) for v in value)
        except _Refused as exc:
            raise _Refused(f"a list of items each {exc.expected}") from None
    return value


def _describe(tp: Any) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if tp in names:
        return names[tp]
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return "a list"
    return str(tp)


def coerce_fields(
    values: Mapping[str, Any], *, source: str, lines: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """`values` (field -> value, from `source`) in their fields' types; unknown fields pass through.

    `lines`: the line of each field in the file, for the message. ValueError naming the
    file, line, field and flag when a value cannot be read as its field's type.
    """
    hints = field_types()
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name not in hints:
            out[name] = value
            continue
        try:
            out[name] = _coerce(value, hints[name])
        except _Refused as exc:
            where = f"{source}, line {lines[name]}" if lines and name in lines else source
            raise ValueError(
                f"{where}: {name}: got {value!r}; it must be {exc.expected} (as for {flag(name)}); fix that value"
            ) from None
    return out
