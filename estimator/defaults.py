"""Uncalibrated overheads (CUDA context, allocator reserve, library buffer sizes) from
`data/overheads.csv`, each row with its source and date. A calibration table replaces the
assumption rows with measured values."""

from __future__ import annotations

import csv
from functools import lru_cache
from pathlib import Path

from estimator.errors import InputError

_PATH = Path(__file__).with_name("data") / "overheads.csv"


@lru_cache(maxsize=1)
def overheads() -> dict[str, tuple[float, str, str]]:
    """name -> (value, source, date). Integers stay int (bytes, element counts)."""
    table = {}
    with _PATH.open(newline="") as f:
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
