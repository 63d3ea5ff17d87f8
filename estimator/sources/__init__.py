"""Read the files users already have and map them, field by field, to a Workload (issue 15).

One module per file kind, each a pure function from the file's parsed content (a dict) to a
`Reading`: the Workload keyword arguments it sets, where each came from (`origin`: field ->
"file: key"), the keys it read but the estimator does not model (`unmodelled`, said in the output),
the keys it did not use (`ignored`, listed, never dropped silently), and job numbers (`epochs`).

- training_args: HF `TrainingArguments` / TRL `SFTConfig` (JSON or YAML). `workload_fields(dict)`
  is also what a Trainer callback uses (issue 12): one mapping of TrainingArguments.
- deepspeed: a DeepSpeed config, `"auto"` values resolved as transformers' integration does.
- peft: `adapter_config.json`.
- quantization: a bitsandbytes `BitsAndBytesConfig` dict, or a model config's `quantization_config`.
- accelerate: an `accelerate config` YAML (FSDP, DeepSpeed, processes, machines, precision).
- axolotl, llamafactory: their recipe YAMLs (which may point to a DeepSpeed file).

`combine(readings)` merges several (two files giving one field different values is an error
naming both); explicit command-line flags override files (estimator/flags.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from estimator.errors import InputError


@dataclass
class Reading:
    fields: dict = field(default_factory=dict)       # Workload keyword arguments ("model": a reference)
    origin: dict = field(default_factory=dict)       # field -> "file: key"
    unmodelled: list = field(default_factory=list)   # "file: key = value (why)"
    ignored: list = field(default_factory=list)      # "file: key"
    job: dict = field(default_factory=dict)          # {"epochs": float}

    def to_dict(self) -> dict:
        return {"fields": {k: list(v) if isinstance(v, tuple) else v for k, v in self.fields.items()},
                "origin": dict(self.origin), "unmodelled": list(self.unmodelled),
                "ignored": list(self.ignored), "job": dict(self.job)}


def _is(value, kind) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, kinds)


class Mapper:
    """Maps keys of one file's dict onto a Reading, remembering which keys it used."""

    def __init__(self, data: dict, name: str, reading: Reading | None = None):
        if not isinstance(data, dict):
            raise InputError(f"{name}: must hold a mapping of settings, got {type(data).__name__}")
        self.data, self.name, self.used = data, name, set()
        self.reading = reading or Reading()

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, kind=None, default=None):
        """The value of `key` (marked used), checked against `kind` (a type or tuple of types)."""
        if key not in self.data:
            return default
        self.used.add(key)
        value = self.data[key]
        if value is None:
            return default
        if kind is not None and not _is(value, kind):
            want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise InputError(f"{self.name}: {key} must be {want}, got {value!r}"[:200])
        return value

    def set(self, field_name: str, value, key: str) -> None:
        self.reading.fields[field_name] = value
        self.reading.origin[field_name] = f"{self.name}: {key}"

    def take(self, key: str, field_name: str, kind=None, convert=None) -> None:
        value = self.get(key, kind)
        if value is not None:
            self.set(field_name, convert(value) if convert else value, key)

    def unmodelled(self, key: str, why: str) -> None:
        if key in self.data:
            self.used.add(key)
            if self.data[key] not in (None, False, [], {}, ""):
                self.reading.unmodelled.append(f"{self.name}: {key} = {self.data[key]!r} ({why})"[:300])

    def quiet(self, *keys: str) -> None:
        """Keys that do not change memory, time or cost (learning rate, logging, ...): not listed."""
        self.used.update(k for k in keys if k in self.data)

    def finish(self) -> Reading:
        self.reading.ignored += [f"{self.name}: {k}" for k in self.data if k not in self.used]
        return self.reading


def take_lora_dropout(m: Mapper, key: str, dora_key: str) -> None:
    """peft's lora_dropout (a probability) -> Workload.lora_dropout: any p > 0 makes each adapted
    linear keep its dropped-out copy and mask. With DoRA (its `dora_key` true) it is listed as not
    modelled (DoRA recomputes the base output on the dropped-out input)."""
    p = m.get(key, (int, float))
    if p is None:
        return
    if isinstance(p, bool) or not 0 <= p < 1:
        raise InputError(f"{m.name}: {key} must be a probability in [0, 1); got {p!r}"[:200])
    if p == 0:
        return
    if m.data.get(dora_key) is True:
        m.reading.unmodelled.append(f"{m.name}: {key} = {p!r} (DoRA with dropout recomputes the base output on "
                                    f"the dropped-out input: modelled as lora_dropout 0)")
        return
    m.set("lora_dropout", True, key)


def combine(readings: list[Reading]) -> Reading:
    """One Reading of several files; a field two files set to different values is an error."""
    out = Reading()
    for r in readings:
        for name, value in r.fields.items():
            if name in out.fields and out.fields[name] != value:
                raise InputError(f"{out.origin[name]} gives {name} = {out.fields[name]!r} but {r.origin[name]} "
                                 f"gives {value!r}: make them agree or pass --{name.replace('_', '-')}")
            out.fields[name] = value
            out.origin.setdefault(name, r.origin[name])
        out.unmodelled += r.unmodelled
        out.ignored += r.ignored
        for name, value in r.job.items():
            if name not in out.job:
                out.job[name] = value
                out.origin[name] = r.origin.get(name, "file")
    return out


def load(path: str | Path, what: str) -> dict:
    """A JSON or YAML file as a dict (one InputError line for anything wrong)."""
    from estimator.files import parse_json

    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"malformed {what} {path}: not UTF-8 text (byte {exc.start})") from None
        import yaml

        try:
            data = yaml.safe_load(text)
        except (yaml.YAMLError, RecursionError) as exc:
            raise InputError(f"malformed {what} {path}: {str(exc).splitlines()[0] if str(exc) else 'YAML'}") from None
        import json

        try:     # the same limits as JSON (NaN, depth, huge integers)
            data = parse_json(json.dumps(data, default=str), str(path), what)
        except (ValueError, RecursionError):
            raise InputError(f"malformed {what} {path}: values JSON cannot hold (NaN, infinity or too deep)") \
                from None
    else:
        data = parse_json(raw, str(path), what)
    if not isinstance(data, dict):
        raise InputError(f"malformed {what} {path}: not a mapping of settings")
    return data
