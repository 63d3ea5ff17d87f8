"""Build, validate, read and atomically write calibration tables (calibrations/<gpu>.json).

The schema is estimator.calibration's (`gpu-budget-calibration/2`; its module docstring lists
every key and factor). Validation is the estimator's own `validate_table`, so a table this module
writes is one the estimator reads, and one it refuses is refused here before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from estimator.calibration import SCHEMA, TRACE_GPU, table_path, validate_table
from estimator.errors import InputError
from estimator.files import atomic_write_text, parse_json, utc_now
from estimator.quantities import FITTED_QUANTITIES as QUANTITIES
from estimator.versions import VERSION_COLUMNS
from fitting.cv import CvResult
from fitting.data import Dataset
from fitting.models import Fit

FITTER = ("fitting.models: bounded robust least squares (soft-L1, 2 % scale) for allocation and reserve, "
          "medians for context, non-PyTorch bytes and MFU; fitting.cv: leave-one-model-out")


class TableError(InputError):
    """A table that cannot be used or written (corrupt, foreign, invalid)."""


def _counts(values) -> dict:
    out: dict = {}
    for v in values:
        if v != "" and v is not None:
            out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def versions_of(frame) -> dict:
    """{library: {version: points}} over the points of the fit."""
    return {lib: c for lib in VERSION_COLUMNS if lib in frame and (c := _counts(frame[lib]))}


def range_of(frame) -> dict:
    """The range of the data, for the estimator's "far outside" warnings."""
    return {"params_total": [int(frame["params_total"].min()), int(frame["params_total"].max())],
            "tokens": [int(frame["tokens"].min()), int(frame["tokens"].max())],
            "methods": _counts(frame["method"]), "model_types": _counts(frame["family"]),
            "attn": _counts(frame["attn"]),
            "world_sizes": sorted(int(v) for v in set(frame["world_size"])),
            "models": sorted(set(frame["model"]))}


def build(data: Dataset, fit: Fit, result: CvResult, created: str | None = None,
          file_paths: dict | None = None) -> dict:
    """The table dict of a fit. `file_paths` maps a source file to the path to record (the
    committed copy) when the measurements were copied under calibrations/measurements/."""
    frame = data.frame
    file_paths = file_paths or {}
    # the files that gave points (a file whose rows were all left out is no provenance)
    runs = [{**f.to_dict(), "file": file_paths.get(f.path, f.path)} for f in data.files if f.used]
    versions = versions_of(frame)
    cv_error = {}
    for q in QUANTITIES:
        if q in result.calibrated:
            cv_error[q] = {**result.calibrated[q], "uncalibrated": result.uncalibrated.get(q)}
    notes = list(fit.notes)
    notes += [f"{n} rows left out: {reason}" for reason, n in sorted(data.skipped.items())]
    if data.gpu == TRACE_GPU:
        notes.append("fitted on fake-tensor traces: peak allocated only; use with --calibration PATH")
    several = [lib for lib, c in versions.items() if len(c) > 1]
    if several:
        notes.append(f"points span several versions of {', '.join(several)} (counts in provenance.versions)")
    table = {
        "schema": SCHEMA,
        "gpu": data.gpu,
        "created": created or utc_now(),
        "fitter": FITTER,
        "versions": {lib: list(c) for lib, c in versions.items()},
        "provenance": {"runs": runs, "points": int(len(frame)),
                       "points_by_quantity": {q: data.points(q) for q in QUANTITIES if data.points(q)},
                       "models": int(frame["group"].nunique()) if len(frame) else 0,
                       "versions": versions,
                       "dates": [min((f.first for f in data.files if f.first), default=""),
                                 max((f.last for f in data.files if f.last), default="")]},
        "range": range_of(frame) if len(frame) else {},
        "factors": fit.factors,
        "factor_points": fit.points,
        "cv_error": cv_error,
        "upper_bound": result.upper,
        "notes": notes,
    }
    return json.loads(json.dumps(table, default=_plain))  # plain JSON types only


def _plain(value):
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def validate(table: dict, path="<new table>", gpu: str | None = None) -> dict:
    """The table, or TableError with the estimator's one-line reason."""
    try:
        validate_table(table, path, gpu)
    except InputError as exc:
        raise TableError(str(exc)) from None
    return table


def read(path: Path, gpu: str | None = None) -> dict | None:
    """An existing table (validated; foreign when fitted on another GPU than `gpu`), or None
    when there is no file. A corrupt or foreign table raises TableError: a refresh must not
    overwrite what it cannot read."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TableError(f"cannot read calibration {path}: {exc.strerror}") from None
    try:
        data = parse_json(raw, str(path), "calibration")
    except InputError as exc:
        reason = str(exc).removeprefix(f"malformed calibration {path}: ")
        raise TableError(f"calibration {path} is corrupt: {reason}; move it away "
                         f"or restore it from git before refreshing") from None
    return validate(data, path, gpu)


def write(path: Path, table: dict) -> Path:
    """Validate, then write atomically (estimator.files.atomic_write_text): a reader sees the
    old table or the new one, never half of one."""
    path = Path(path)
    validate(table, path)
    text = json.dumps(table, indent=1, allow_nan=False) + "\n"
    validate(json.loads(text), path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, text)


def default_path(gpu: str) -> Path:
    """calibrations/<gpu>.json (the estimator's `auto` table)."""
    return table_path(gpu)
