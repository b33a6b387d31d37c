"""The value checks of ``RunConfig``'s fields: each converted to its field's kind (int, float,
bool, str, a pair of floats) and checked against the bounds and choices in the field's metadata
(``runconfig._spec``); a bad one is a ``UsageError`` naming the flag and what is allowed."""

from __future__ import annotations

import dataclasses
import math
from enum import Enum
from typing import Any, Mapping

from ddiloco_cli.errors import UsageError


def bad(flag_name: str, why: str) -> UsageError:
    return UsageError(f"--{flag_name}: {why}")


def checked(f: dataclasses.Field, value: Any) -> Any:
    """``value`` converted to the field's kind, or UsageError saying what is allowed."""
    m = f.metadata
    name, kind = m["flag"], m["kind"]
    if value is None and m["optional"]:
        return None
    if isinstance(value, Enum):
        value = value.value
    if kind is tuple:
        if isinstance(value, str):
            value = value.split(",")
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise bad(name, "give two comma-separated numbers, e.g. 0.9,0.95")
        return tuple(_number(name, x, m) for x in value)
    if kind is bool:
        if not isinstance(value, bool):
            raise bad(name, f"must be true or false, got {value!r}")
        return value
    if kind is str:
        if not isinstance(value, str) or not value:
            raise bad(name, f"must be a non-empty string, got {value!r}")
        choices = m["choices"]
        if choices is not None and value not in {c.value for c in choices}:
            raise bad(name, f"use one of {', '.join(c.value for c in choices)}; got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(name, f"must be an integer, got {value!r}")
        _in_range(name, value, m)
        return value
    return _number(name, value, m)


def _number(name: str, value: Any, m: Mapping[str, Any]) -> float:
    if isinstance(value, bool):
        raise bad(name, f"must be a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise bad(name, f"must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise bad(name, f"must be a finite number, got {value!r}")
    _in_range(name, x, m)
    return x


def _in_range(name: str, x: float, m: Mapping[str, Any]) -> None:
    lo, hi = m["lo"], m["hi"]
    low_ok = lo is None or (x > lo if m["lo_open"] else x >= lo)
    high_ok = hi is None or (x < hi if m["hi_open"] else x <= hi)
    if not (low_ok and high_ok):
        if hi is None:
            want = f"> {lo:g}" if m["lo_open"] else f">= {lo:g}"
        else:
            want = f"in {'(' if m['lo_open'] else '['}{lo:g}, {hi:g}{')' if m['hi_open'] else ']'}"
        raise bad(name, f"must be {want}, got {x:g}")
