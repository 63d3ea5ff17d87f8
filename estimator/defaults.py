"""Uncalibrated overheads (CUDA context, allocator reserve, library buffer sizes) from
`data/overheads.csv`, each row with its source and date. A calibration table replaces the
assumption rows with measured values."""

from __future__ import annotations

import csv
from functools import lru_cache
from pathlib import Path

from estimator.errors import InputError

_PATH = Path(__file__).with_name("data") / "overheads.csv"
_TIME_PATH = Path(__file__).with_name("data") / "time_constants.csv"


@lru_cache(maxsize=1)
def overheads() -> dict[str, tuple[float, str, str]]:
    """name -> (value, source, date). Integers stay int (bytes, element counts)."""
    return _load(_PATH)


@lru_cache(maxsize=1)
def time_constants() -> dict[str, tuple[float, str, str]]:
    """The step-time mechanisms' constants (`data/time_constants.csv`): name -> (value, source, date)."""
    return _load(_TIME_PATH)


def time_constant(name: str) -> float:
    try:
        return float(time_constants()[name][0])
    except KeyError:
        raise InputError(f"time_constants.csv has no row {name!r}") from None


def _load(path: Path) -> dict[str, tuple[float, str, str]]:
    table = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            raw = row["value"]
            value = int(raw) if raw.isdigit() else float(raw)
            table[row["name"]] = (value, row["source"], row["date"])
    return table


def overhead(name: str):
    """The value of one overhead row; unknown names are a programming error surfaced clearly."""
    try:
        return overheads()[name][0]
    except KeyError:
        raise InputError(f"overheads.csv has no row {name!r}") from None
