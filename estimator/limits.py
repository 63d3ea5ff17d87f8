"""Limits of physical sense for model dimensions, workload sizes and job numbers (one owner).

estimator/data/limits.csv holds, per name, the largest value accepted, the largest known from a
published model or system, and the source. A model config, a Workload or a command-line number
beyond its limit is refused with one line naming the value and the limit: an answer about a
10^15-layer model or a 10^12-token sequence is not an estimate, and computing it can take longer
than any user waits.
"""

from __future__ import annotations

import math
from functools import lru_cache

from estimator.errors import InputError
from estimator.tables import DATA_DIR, _read

LIMIT_COLUMNS = ("name", "max", "largest_known", "source", "date")


@lru_cache(maxsize=1)
def limits() -> dict[str, float]:
    """name -> the largest value accepted."""
    out = {}
    for row in _read(DATA_DIR / "limits.csv", LIMIT_COLUMNS):
        row.provenance()
        out[row.text("name")] = row.number("max")
    return out


def limit(name: str) -> float:
    return limits()[name]


def check_count(name: str, value, what: str = "", low: int = 1) -> int:
    """`value` as an int in [low, limit(name)], or InputError naming it (`what`: how to show it)."""
    shown = what or name
    if not isinstance(value, int) or isinstance(value, bool):
        raise InputError(f"{shown} must be an integer; got {value!r}")
    high = limit(name)
    if not low <= value <= high:
        raise InputError(f"{shown} must be between {low} and {high:,.0f}; got {value:,}")
    return value


def check_number(name: str, value, what: str = "", low: float = 0.0, low_open: bool = True) -> float:
    """A finite number in (low, limit(name)] ([low, ...] when not `low_open`), or InputError."""
    shown = what or name
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InputError(f"{shown} must be a finite number; got {value!r}")
    high = limit(name)
    if value > high or value < low or (low_open and value == low):
        side = f"above {low:g}" if low_open else f"at least {low:g}"
        raise InputError(f"{shown} must be {side} and at most {high:g}; got {value:g}")
    return float(value)
