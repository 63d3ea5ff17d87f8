"""The command lines' shared parts: one flag per Workload field, and argparse that fails in one line.

The flags are generated from the metadata of the Workload fields (estimator/workload.py): the
flag is `--` plus the field name with dashes; `help`, `choices`, `metavar` and `parse` (text ->
value; default: the type of the field's default) come from the metadata; a bool field is a switch
(`--grad-ckpt`; `--no-double-quant` for one defaulting to True). Adding a Workload field with its
metadata adds its flag to scripts/estimate.py and scripts/profile.py; a field without metadata
fails at import (and tests/test_flags.py).

Flags default to None: `given(args)` is the Workload keyword arguments of the flags given on the
command line (`model` stays the reference string), `workload_from_args(args)` the validated
Workload (defaults from the dataclass, plus `method_defaults`: qlora -> nf4).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import MISSING, dataclass, fields
from typing import Callable

from estimator.configs import load_spec
from estimator.errors import InputError
from estimator.workload import Workload, method_defaults


class OneLineParser(argparse.ArgumentParser):
    """argparse for our command lines: a usage error is one line on stderr and exit code 2."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


@dataclass(frozen=True)
class Flag:
    """The command-line flag of one Workload field."""

    field: str
    option: str                           # --batch, --grad-ckpt, --no-double-quant
    help: str
    default: object                       # the Workload default (None: no default, i.e. model)
    parse: Callable[[str], object] | None  # text -> value; None for a switch
    switch_value: object = None           # the value a switch sets
    choices: tuple | None = None
    metavar: str | None = None

    def add_to(self, parser, help: str | None = None) -> None:
        text = help or self.help
        if self.parse is None:
            parser.add_argument(self.option, dest=self.field, action="store_const", const=self.switch_value,
                                default=None, help=text)
            return
        if self.default is not None and "default" not in text:
            shown = ",".join(self.default) if isinstance(self.default, tuple) else self.default
            text = f"{text} (default {shown})"
        parser.add_argument(self.option, dest=self.field, type=self.parse, choices=self.choices,
                            metavar=self.metavar, default=None, help=text)

    def argv(self, value) -> list[str]:
        """The command-line words that give this field `value` (the inverse of parsing)."""
        if self.parse is None:
            if value != self.switch_value:
                raise ValueError(f"{self.option} sets {self.field} to {self.switch_value!r} only")
            return [self.option]
        return [self.option, ",".join(value) if isinstance(value, tuple) else str(value)]


def _flag(f) -> Flag:
    meta = f.metadata
    if "help" not in meta:
        raise TypeError(f"Workload field '{f.name}' has no flag metadata (field(metadata=dict(help=...)))")
    default = None if f.default is MISSING else f.default
    option = "--" + f.name.replace("_", "-")
    if isinstance(default, bool):
        return Flag(f.name, "--no-" + option[2:] if default else option, meta["help"], default, None,
                    switch_value=not default)
    parse = meta.get("parse") or (int if isinstance(default, int) else str)
    choices = meta.get("choices")
    return Flag(f.name, option, meta["help"], default, parse,
                choices=tuple(choices) if choices else None, metavar=meta.get("metavar"))


FLAGS: tuple[Flag, ...] = tuple(_flag(f) for f in fields(Workload))
BY_FIELD: dict[str, Flag] = {flag.field: flag for flag in FLAGS}


def add_workload_flags(parser, help: dict[str, str] | None = None) -> None:
    """Add one flag per Workload field to `parser` (or an argument group); `help` overrides the
    text of some flags (a command line whose flag means a little more, e.g. profile.py --gpus)."""
    help = help or {}
    unknown = set(help) - set(BY_FIELD)
    if unknown:
        raise ValueError(f"help for unknown Workload fields: {', '.join(sorted(unknown))}")
    for flag in FLAGS:
        flag.add_to(parser, help.get(flag.field))


def bounded(name: str, integer: bool = False, low: float = 0.0, low_open: bool = True) -> Callable[[str], object]:
    """An argparse type for a job number: finite, above `low` and within estimator/data/limits.csv
    (NaN, infinity or 10^12 hours are refused in one line naming the limit)."""
    from estimator.limits import check_count, check_number

    def parse(text: str):
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {'an integer' if integer else 'a number'}") \
                from None
        try:
            if integer:
                return check_count(name, value, "value", low=int(low) + (1 if low_open else 0))
            return check_number(name, value, "value", low=low, low_open=low_open)
        except InputError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name    # argparse names the type in "invalid <name> value"
    return parse


def given(args: argparse.Namespace) -> dict:
    """Workload keyword arguments of the workload flags given on the command line (parsed values;
    `model` is the reference string as given)."""
    return {flag.field: getattr(args, flag.field) for flag in FLAGS
            if getattr(args, flag.field, None) is not None}


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The validated Workload of the workload flags (InputError: one line)."""
    settings = given(args)
    ref = settings.pop("model", None)
    if not ref:
        raise InputError("--model is required (a config.json path, catalog name or Hub id)")
    return Workload(model=load_spec(ref), **method_defaults(settings)).validate()


def to_argv(settings: dict) -> list[str]:
    """The flags that give these Workload keyword arguments (`model`: the reference string)."""
    out = []
    for name, value in settings.items():
        out += BY_FIELD[name].argv(value)
    return out


def print_stdout(text: str) -> None:
    """Print the answer; a reader that closed the pipe (`| head`) is not an error of ours."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
