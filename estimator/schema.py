"""A small typed schema for the JSON files the project reads (calibration tables, run folders).

A schema is a plain value:
- a Python type (`str`, `int`, `bool`) or `NUM` (a finite int or float, never bool), `ANY`;
- `List(item)`, `Pair(item)` (a two-entry list, first <= second), `Map(value)` (an object with any
  text keys, each value of `value`), `Obj({key: schema}, optional=(...))` (exactly these keys;
  those in `optional` may be missing), `Optional(schema)` (also null), `Either(a, b)`.
`check(schema, value, where)` returns None or raises InputError naming the first wrong field by its
path (`provenance.runs[0].rows`) and what it must be. It never raises anything else, whatever the
value (random JSON included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from estimator.errors import InputError


class _Num:
    def __repr__(self) -> str:
        return "a finite number"


class _Any:
    def __repr__(self) -> str:
        return "anything"


NUM = _Num()
ANY = _Any()


@dataclass(frozen=True)
class List:
    item: object


@dataclass(frozen=True)
class Pair:
    item: object


@dataclass(frozen=True)
class Map:
    value: object


@dataclass(frozen=True)
class Optional:
    schema: object


@dataclass(frozen=True)
class Either:
    first: object
    second: object


@dataclass(frozen=True)
class Obj:
    keys: dict
    optional: tuple = field(default=())


_NAMES = {str: "text", int: "an integer", bool: "true or false"}


def describe(schema) -> str:
    """What a value of `schema` is, in words (for the error line)."""
    if isinstance(schema, type) and schema in _NAMES:
        return _NAMES[schema]
    if isinstance(schema, List):
        return f"a list of {describe(schema.item)}"
    if isinstance(schema, Pair):
        return f"[min, max] of {describe(schema.item)}"
    if isinstance(schema, Map):
        return f"an object of {describe(schema.value)}"
    if isinstance(schema, Optional):
        return f"{describe(schema.schema)} or null"
    if isinstance(schema, Obj):
        return "an object with " + ", ".join(schema.keys)
    if isinstance(schema, Either):
        return f"{describe(schema.first)} or {describe(schema.second)}"
    return repr(schema)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fail(where: str, schema, value) -> InputError:
    shown = repr(value)
    if len(shown) > 60:
        shown = type(value).__name__
    return InputError(f"{where} must be {describe(schema)}, got {shown}")


def check(schema, value, where: str) -> None:
    """Raise InputError at the first field of `value` that does not have `schema`."""
    if schema is ANY:
        return
    if isinstance(schema, Optional):
        if value is not None:
            check(schema.schema, value, where)
        return
    if isinstance(schema, Either):
        try:
            check(schema.first, value, where)
        except InputError:
            try:
                check(schema.second, value, where)
            except InputError:
                raise _fail(where, schema, value) from None
        return
    if schema is NUM:
        if not _is_number(value):
            raise _fail(where, schema, value)
        return
    if schema is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _fail(where, schema, value)
        return
    if schema in (str, bool):
        if type(value) is not schema:
            raise _fail(where, schema, value)
        return
    if isinstance(schema, (List, Pair)):
        if not isinstance(value, list):
            raise _fail(where, schema, value)
        for i, item in enumerate(value):
            check(schema.item, item, f"{where}[{i}]")
        if isinstance(schema, Pair) and (len(value) != 2 or value[0] > value[1]):
            raise _fail(where, schema, value)
        return
    if isinstance(schema, Map):
        if not isinstance(value, dict):
            raise _fail(where, schema, value)
        for key, item in value.items():
            check(schema.value, item, f"{where}[{key}]")
        return
    if isinstance(schema, Obj):
        if not isinstance(value, dict):
            raise _fail(where, schema, value)
        unknown = sorted(set(value) - set(schema.keys))
        if unknown:
            raise InputError(f"{where} has unknown keys {unknown[:5]}")
        for key, sub in schema.keys.items():
            if key in value:
                check(sub, value[key], f"{where}.{key}")
            elif key not in schema.optional:
                raise InputError(f"{where} is missing {key!r}")
        return
    raise TypeError(f"not a schema: {schema!r}")  # a programming error, not input
