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
from estimator.workload import Workload, loaded_attn, method_defaults


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


# the users' own files (estimator/sources): flag -> (module, what it is)
FILE_FLAGS = {
    "--training-args": ("training_args", "HF TrainingArguments / TRL SFTConfig (JSON or YAML)"),
    "--deepspeed": ("deepspeed", "DeepSpeed config JSON (\"auto\" resolved as the HF integration does)"),
    "--peft": ("peft", "peft adapter_config.json"),
    "--quant-config": ("quantization", "bitsandbytes BitsAndBytesConfig (JSON or YAML)"),
    "--accelerate-config": ("accelerate", "accelerate config YAML (FSDP, DeepSpeed, processes, machines)"),
    "--axolotl": ("axolotl", "Axolotl recipe YAML"),
    "--llamafactory": ("llamafactory", "LLaMA-Factory training YAML"),
}


def add_file_flags(parser) -> None:
    """One flag per kind of file a user already has; explicit workload flags override them."""
    group = parser.add_argument_group("read the job from your own files (explicit flags override them)")
    for option, (_, what) in FILE_FLAGS.items():
        group.add_argument(option, metavar="FILE", help=what)


@dataclass(frozen=True)
class Resolved:
    """The Workload of the flags and files, and where each setting came from."""

    workload: Workload
    origin: dict            # field -> "flag" | "file: key" | "default"
    unmodelled: tuple = ()
    ignored: tuple = ()
    job: dict = None

    def to_dict(self) -> dict:
        return {"origin": dict(self.origin), "unmodelled": list(self.unmodelled), "ignored": list(self.ignored)}

    def lines(self) -> list[str]:
        files = {k: v for k, v in self.origin.items() if v not in ("flag", "default", "model")}
        if not files and not self.unmodelled and not self.ignored:
            return []
        out = ["settings from files (explicit flags override them):"]
        out += [f"  {k:<18} {v}" for k, v in files.items()]
        out += [f"  read, not modelled: {t}" for t in self.unmodelled]
        if self.ignored:
            out.append(f"  ignored ({len(self.ignored)}): " + ", ".join(self.ignored))
        return out


def read_files(args: argparse.Namespace):
    """The combined Reading of the file flags given (None when none is)."""
    import importlib
    from pathlib import Path

    from estimator import sources

    readings = []
    for option, (module_name, what) in FILE_FLAGS.items():
        path = getattr(args, option[2:].replace("-", "_"), None)
        if not path:
            continue
        module = importlib.import_module(f"estimator.sources.{module_name}")
        data = sources.load(path, what.split(" (")[0])
        reader = module.workload_fields if module_name == "training_args" else module.read
        kwargs = {"base_dir": Path(path).resolve().parent} if module_name in (
            "training_args", "axolotl", "llamafactory") else {}
        readings.append(reader(data, str(path), **kwargs))
    return sources.combine(readings) if readings else None


def resolve(args: argparse.Namespace) -> Resolved:
    """Files first, then the explicit flags over them; the model's own quantization_config counts
    as a file. InputError (one line) for anything wrong."""
    from estimator import sources
    from estimator.configs import _source, load_config
    from estimator.sources import quantization

    reading = read_files(args) or sources.Reading()
    flags_given = given(args)
    ref = flags_given.get("model") or reading.fields.get("model")
    if not ref:
        raise InputError("--model is required (a config.json path, catalog name or Hub id)")
    if "quant" not in reading.fields and "quant" not in flags_given and _source(ref)[0] is not None:
        own = load_config(ref)[0].get("quantization_config")   # a local or catalog config (no Hub call)
        if isinstance(own, dict):
            reading = sources.combine([reading, quantization.read(own, f"{ref}: quantization_config")])
    settings = {**reading.fields, **flags_given}
    settings.pop("model", None)
    if (settings.get("quant") == "mxfp4" and "quant" not in flags_given
            and settings.get("method", "inference") != "inference"):
        # MXFP4 does not train: fine-tuning recipes load it with Mxfp4Config(dequantize=True)
        settings["quant"] = "none"     # the regime line says why (estimator/api.py _mxfp4_note)
    if settings.get("method") == "lora" and settings.get("quant") in ("nf4", "fp4") and "method" not in flags_given:
        settings["method"] = "qlora"          # a LoRA adapter on a 4-bit base is QLoRA
    origin = {name: ("flag" if name in flags_given else reading.origin.get(name, "default"))
              for name in BY_FIELD if name in settings or name == "model"}
    origin["model"] = "flag" if "model" in flags_given else reading.origin.get("model", "flag")
    if "epochs" in reading.job:
        origin["epochs"] = reading.origin.get("epochs", "file")
    spec = load_spec(ref)
    if "attn" not in settings and loaded_attn(spec.model_type) != "sdpa":   # what transformers loads it with
        settings["attn"] = loaded_attn(spec.model_type)
        origin["attn"] = "model"   # the regime line says why (estimator/api.py regime_notes)
    w = Workload(model=spec, **method_defaults(settings)).validate()
    return Resolved(w, origin, tuple(reading.unmodelled), tuple(reading.ignored), dict(reading.job))


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The validated Workload of the workload flags (and file flags, when the parser has them;
    InputError: one line)."""
    return resolve(args).workload


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
