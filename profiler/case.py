"""`Case`: one configuration to profile: a model reference plus the Workload fields that differ
from the defaults, and how many steps to run.

A Case is what crosses process boundaries (JSON), so it keeps the model as the string the user
gave (path, catalog alias or hub id) rather than the parsed ModelSpec: the child process needs the
raw config to build the transformers model. Pure Python: no torch import here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from estimator.configs import load_config, load_spec
from estimator.errors import InputError
from estimator.workload import Workload, loaded_attn
from profiler.record import parse_lora_targets

_WORKLOAD_FIELDS = {f.name: f for f in fields(Workload) if f.name != "model"}


def _normalise(values: dict) -> dict:
    """Workload fields with lists turned into tuples, lora_targets read by
    record.parse_lora_targets (a comma string, a list, or all-linear) and defaults dropped (a
    stable, short form)."""
    out = {}
    for key, value in values.items():
        if key not in _WORKLOAD_FIELDS:
            raise InputError(f"unknown workload field '{key}'; known: {', '.join(sorted(_WORKLOAD_FIELDS))}")
        if key == "lora_targets":
            value = parse_lora_targets(value)
        elif isinstance(value, list):
            value = tuple(value)
        if value != _WORKLOAD_FIELDS[key].default:
            out[key] = value
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Case:
    """A model reference, its non-default Workload fields, warm-up and timed step counts."""

    model: str
    settings: dict = field(default_factory=dict)
    warmup: int = 2
    steps: int = 5

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", _normalise(dict(self.settings)))
        for name in ("warmup", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "warmup" else 1):
                raise InputError(f"{name} must be a {'non-negative' if name == 'warmup' else 'positive'} "
                                     f"integer; got {value!r}")

    def __hash__(self) -> int:
        return hash(self.id)

    def workload(self) -> Workload:
        """The validated Workload (raises InputError with one clear line); an unstated attention is
        the one transformers builds the model with (`loaded_attn`)."""
        spec = load_spec(self.model)
        settings = self.settings if "attn" in self.settings else dict(self.settings, attn=loaded_attn(spec.model_type))
        return Workload(model=spec, **settings).validate()

    def config(self) -> dict:
        """The raw HF config dict of the model (for building the transformers model)."""
        return load_config(self.model)[0]

    @property
    def id(self) -> str:
        """The Workload id: stable across runs, the key for resuming a sweep."""
        return self.workload().id

    def with_(self, **changes) -> "Case":
        """A copy with Workload fields changed."""
        return Case(self.model, {**self.settings, **changes}, self.warmup, self.steps)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["settings"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.settings.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        unknown = set(d) - {"model", "settings", "warmup", "steps"}
        if unknown:
            raise InputError(f"unknown case keys: {', '.join(sorted(unknown))}")
        if "model" not in d:
            raise InputError("a case needs a model")
        return cls(d["model"], dict(d.get("settings", {})), int(d.get("warmup", 2)), int(d.get("steps", 5)))

    @classmethod
    def from_json(cls, text: str) -> "Case":
        return cls.from_dict(json.loads(text))
