"""Sweep files: many configurations described once (YAML or JSON), expanded into `Case`s.

Format (YAML shown; a JSON file has the same structure)::

    name: default                  # optional, free text
    description: ...               # optional, free text
    timeout_s: 300                 # optional: seconds per configuration (--timeout overrides)
    skip_predicted_over: 1.3       # optional: drop configurations the estimator predicts need more
                                   # than this multiple of the GPU's memory (device_used_bytes);
                                   # applied only when a GPU slug is known
    defaults:                      # optional: Workload fields, warmup, steps for every entry
      precision: bf16
      warmup: 2
      steps: 5
    grid:                          # a list of entries (a single mapping is one entry)
      - model: [qwen2.5-0.5b, tests/data/tiny-llama.json]   # a list = alternatives
        method: [full, lora]
        grad_ckpt: [false, true]
        batch: 2
        seq: [512, 2048]
    exclude:                       # optional: drop every configuration matching all keys of a rule
      - {method: lora, grad_ckpt: true}
      - {model: qwen2.5-0.5b, seq: [2048, 4096]}            # a list = any of these

Each grid entry is laid over `defaults` and its lists are multiplied out (cartesian product), in
the order written. Keys are the Workload fields (estimator/workload.py) plus `model`, `warmup` and
`steps`. `model` is a catalog alias, a Hub id or a config path; paths are resolved against the
sweep file's folder first, then the repository root. Conveniences shared with scripts/estimate.py:
`method: qlora` without `quant` gets `quant: nf4`; `lora_targets` is a comma string or
`all-linear`.

What is dropped is counted, never silent: combinations `Workload.validate` refuses (grouped by
reason), configurations an `exclude` rule matches, and duplicates (same Workload id). An unknown
model, an unknown key, an empty list or a malformed file raise InputError (one line).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, fields
from itertools import product
from pathlib import Path

from estimator import tables
from estimator.api import estimate
from estimator.configs import load_spec
from estimator.errors import InputError
from estimator.files import parse_json
from estimator.units import gib
from estimator.workload import Workload, method_defaults
from profiler.case import Case
from profiler.record import parse_lora_targets

ROOT = Path(__file__).resolve().parents[1]
SWEEPS_DIR = Path(__file__).with_name("sweeps")
DEFAULT_SWEEP = SWEEPS_DIR / "default.yaml"
CPU_SWEEP = SWEEPS_DIR / "cpu-tiny.yaml"

_WORKLOAD_DEFAULTS = {f.name: f.default for f in fields(Workload) if f.name != "model"}
_CASE_KEYS = ("model", "warmup", "steps")
_ENTRY_KEYS = frozenset(_WORKLOAD_DEFAULTS) | frozenset(_CASE_KEYS)
_TOP_KEYS = ("name", "description", "timeout_s", "skip_predicted_over", "defaults", "grid", "exclude")


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file. `path` is where it was read from (None when built in memory)."""

    grid: tuple[dict, ...]
    defaults: dict = field(default_factory=dict)
    exclude: tuple[dict, ...] = ()
    name: str = ""
    description: str = ""
    timeout_s: float | None = None
    skip_predicted_over: float | None = None
    path: Path | None = None

    @property
    def base_dir(self) -> Path:
        """Folder that relative model paths are resolved against first."""
        return self.path.parent if self.path else Path.cwd()


@dataclass
class Expansion:
    """The Cases of a sweep and everything left out, each with the reason (one line)."""

    cases: list[Case] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (what, why)

    def drop(self, what: str, why: str) -> None:
        self.dropped.append((what, why))

    def reasons(self) -> Counter:
        """How many configurations were dropped for each reason."""
        return Counter(why for _, why in self.dropped)

    def summary_lines(self) -> list[str]:
        """`N configurations` then one line per drop reason with its count."""
        lines = [f"{len(self.cases)} configurations to run; {len(self.dropped)} dropped"]
        lines += [f"  dropped {n} x {why}" for why, n in self.reasons().most_common()]
        return lines


# ---- reading ----------------------------------------------------------------------------------

def _parse_text(text: str, path: Path) -> object:
    if path.suffix.lower() == ".json":
        return parse_json(text, str(path), "sweep")
    import yaml

    try:
        value = yaml.safe_load(text)
    except RecursionError:
        raise InputError(f"sweep {path}: malformed YAML: nested too deep") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"sweep {path}: malformed YAML: {problem}{where}") from None
    # YAML is a superset of JSON: the same limits (depth, NaN, huge integers) through one owner
    try:
        return parse_json(json.dumps(value, default=str), str(path), "sweep")
    except (ValueError, RecursionError):
        raise InputError(f"sweep {path}: malformed YAML: values JSON cannot hold (NaN, infinity or too deep)") \
            from None


def _mapping(value, what: str, path: Path) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"sweep {path}: {what} must be a mapping; got {type(value).__name__}")
    return dict(value)


def _entries(value, what: str, path: Path) -> tuple[dict, ...]:
    """A list of mappings (a single mapping is a list of one)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list):
        raise InputError(f"sweep {path}: {what} must be a list of mappings")
    return tuple(_mapping(item, f"{what} entry {i + 1}", path) for i, item in enumerate(items))


def _check_keys(entry: dict, what: str, path: Path) -> None:
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise InputError(f"sweep {path}: {what}: unknown key '{unknown[0]}'; known: "
                             f"{', '.join(sorted(_ENTRY_KEYS))}")
    for key, value in entry.items():
        if isinstance(value, list) and not value:
            raise InputError(f"sweep {path}: {what}: '{key}' is an empty list")


def _positive(value, name: str, path: Path) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise InputError(f"sweep {path}: {name} must be a positive number; got {value!r}")
    return float(value)


def sweep_from_dict(data, path: Path) -> Sweep:
    """Check the structure of a parsed sweep file and build the Sweep."""
    if not isinstance(data, dict):
        raise InputError(f"sweep {path}: the file must hold a mapping with a 'grid' list")
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise InputError(f"sweep {path}: unknown key '{unknown[0]}'; known: {', '.join(_TOP_KEYS)}")
    defaults = _mapping(data.get("defaults"), "defaults", path)
    _check_keys(defaults, "defaults", path)
    grid = _entries(data.get("grid"), "grid", path)
    if not grid:
        raise InputError(f"sweep {path}: 'grid' is missing or empty")
    for i, entry in enumerate(grid):
        _check_keys(entry, f"grid entry {i + 1}", path)
        if "model" not in entry and "model" not in defaults:
            raise InputError(f"sweep {path}: grid entry {i + 1} has no model")
    exclude = _entries(data.get("exclude"), "exclude", path)
    for i, rule in enumerate(exclude):
        _check_keys(rule, f"exclude rule {i + 1}", path)
    return Sweep(grid, defaults, exclude, str(data.get("name") or path.stem), str(data.get("description") or ""),
                 _positive(data.get("timeout_s"), "timeout_s", path),
                 _positive(data.get("skip_predicted_over"), "skip_predicted_over", path), path)


def load_sweep(path: str | Path) -> Sweep:
    """Read a sweep file (.yaml/.yml or .json); every problem is one InputError line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"sweep file not found: {path}") from None
    except OSError as exc:
        raise InputError(f"cannot read sweep {path}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"sweep {path}: not UTF-8 text (byte {exc.start})") from None
    data = _parse_text(text, path)
    try:
        return sweep_from_dict(data, path)
    except InputError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as exc:
        raise InputError(f"sweep {path}: malformed: {type(exc).__name__}: {exc}"[:300]) from None


# ---- expansion --------------------------------------------------------------------------------

def resolve_model(ref: str, base_dirs: list[Path]) -> str:
    """A model reference as the child should get it: an existing config path (folder or file,
    relative to the first of `base_dirs` where it exists) becomes absolute; catalog aliases and
    Hub ids pass unchanged. A missing `.json` path raises InputError."""
    if not isinstance(ref, str) or not ref.strip():
        raise InputError(f"model must be a non-empty string; got {ref!r}")
    candidate = Path(ref).expanduser()
    if candidate.is_absolute():
        return str(candidate)
    for base in base_dirs:
        if (base / candidate).exists():
            return str((base / candidate).resolve())
    if ref.endswith(".json") or ref.startswith("."):
        raise InputError(f"model config not found: {ref} (looked in {', '.join(map(str, base_dirs))})")
    return ref


def field_value(key: str, value):
    """A sweep value in the form Case/Workload take (lora_targets: a tuple of roles, by
    record.parse_lora_targets)."""
    if key == "lora_targets" and isinstance(value, (str, list, tuple)):
        return parse_lora_targets(value)
    return value


def _matches(rule: dict, values: dict) -> bool:
    """True when every key of the rule equals (or, for a list, is one of) the configuration's
    value; missing fields compare as their Workload default; models compare case-insensitively."""
    for key, wanted in rule.items():
        options = wanted if isinstance(wanted, list) else [wanted]
        have = values.get(key, _WORKLOAD_DEFAULTS.get(key))
        if key == "model":
            if str(have).lower() not in {str(o).lower() for o in options}:
                return False
        elif field_value(key, have) not in [field_value(key, o) for o in options]:
            return False
    return True


def _combinations(entry: dict):
    """Every configuration of one grid entry (defaults already merged), as dicts."""
    keys = list(entry)
    axes = [entry[k] if isinstance(entry[k], list) else [entry[k]] for k in keys]
    for combo in product(*axes):
        yield dict(zip(keys, combo))


def _describe(values: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


def _case(values: dict, resolved: dict[str, str]) -> Case:
    settings = {k: field_value(k, v) for k, v in values.items() if k not in _CASE_KEYS}
    kwargs = {k: values[k] for k in ("warmup", "steps") if k in values}
    return Case(resolved[values["model"]], settings, **kwargs)


def _resolve_models(sweep: Sweep) -> dict[str, str]:
    """Raw reference -> resolved reference for every model named in the sweep; an unknown model
    raises InputError (a sweep with a wrong name is bad input, not a dropped case)."""
    refs = []
    for entry in sweep.grid:
        value = entry.get("model", sweep.defaults.get("model"))
        refs += value if isinstance(value, list) else [value]
    bases = [sweep.base_dir, ROOT]
    resolved = {}
    for ref in refs:
        if ref not in resolved:
            resolved[ref] = resolve_model(ref, bases)
            load_spec(resolved[ref])
    return resolved


def expand(sweep: Sweep) -> Expansion:
    """All Cases of the sweep, in file order, with invalid, excluded and duplicate ones dropped
    and counted by reason."""
    resolved = _resolve_models(sweep)
    out, seen = Expansion(), set()
    for entry in sweep.grid:
        for values in _combinations({**sweep.defaults, **entry}):
            values = method_defaults(values)
            what = _describe(values)
            if any(_matches(rule, values) for rule in sweep.exclude):
                out.drop(what, "excluded by a rule")
                continue
            try:
                case = _case(values, resolved)
                case.workload()
            except InputError as exc:
                out.drop(what, f"invalid: {exc}")
                continue
            if case.id in seen:
                out.drop(what, "duplicate of an earlier configuration")
                continue
            seen.add(case.id)
            out.cases.append(case)
    return out


# ---- filters applied after expansion ------------------------------------------------------------

def keep_if(expansion: Expansion, test) -> Expansion:
    """A new Expansion keeping the cases for which `test(case)` returns None; a string return
    value is the reason the case is dropped."""
    out = Expansion(dropped=list(expansion.dropped))
    for case in expansion.cases:
        why = test(case)
        if why is None:
            out.cases.append(case)
        else:
            out.drop(case.id, why)
    return out


def gpu_count_test(max_gpus: int):
    """Drop cases needing more GPUs than this machine may use, and multi-node cases."""
    def test(case: Case) -> str | None:
        w = case.workload()
        if w.nodes > 1:
            return "multi-node: the profiler runs on one machine"
        if w.gpus > max_gpus:
            return f"needs more GPUs than --gpus {max_gpus}"
        return None
    return test


def predicted_fit_test(gpu_slug: str, ratio: float, calibration: str = "auto"):
    """Drop cases the estimator predicts need more than `ratio` x the GPU's memory
    (device_used_bytes per GPU), and cases the GPU cannot run at all (no bf16 tensor cores...).
    Cases between 1x and `ratio` x are kept: an OOM near the boundary is a measurement."""
    memory_bytes = tables.gpu(gpu_slug).memory_bytes

    def test(case: Case) -> str | None:
        try:
            predicted = estimate(case.workload(), gpu_slug, calibration=calibration).memory.device_used_bytes
        except InputError as exc:
            return f"cannot run on {gpu_slug}: {exc}"
        if predicted > ratio * memory_bytes:
            return f"predicted over {ratio:g} x the {gib(memory_bytes):.0f} GiB of {gpu_slug}"
        return None
    return test
