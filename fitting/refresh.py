"""Refresh the calibration table of one GPU after a profiling run (scripts/profile.py calls this).

`refresh(run_dirs, gpu_slug, table_path=None, write=True)`:
1. reads the existing table (a corrupt or foreign one stops the refresh: it is never overwritten);
2. fits on every measurement it knows of: the committed files calibrations/measurements/<gpu>/*.csv,
   the files the existing table's provenance lists, and the new run's CSV files (duplicates by
   content are read once). An earlier file that is gone stops the write unless
   `allow_missing=True` (then the table's notes name what was dropped): never silently;
3. compares before (uncalibrated, and the current table) and after (the new table, leave one
   model out), on all points and on the new run's points;
4. with `write`: copies the new run's CSV files under calibrations/measurements/<gpu>/ (so the
   provenance points at committed files) and writes the table atomically.
With `write=False` (profile.py --no-refresh) it only compares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from estimator.calibration import Calibration
from estimator.files import atomic_write
from estimator.versions import VERSION_COLUMNS
from fitting import calibration_table, render
from fitting.cv import error_table, fit_and_validate, predict
from fitting.data import (MEASUREMENTS_DIR, REPO_ROOT, committed_files, csv_files, display_path, load,
                          read_table_file, sha256)

NEW_LABEL = "new table (LOMO CV)"


@dataclass
class RefreshResult:
    """What a refresh found and did; `text` is the rendering profile.py prints."""

    gpu: str
    table_path: Path
    table: dict | None = None          # the new table (None when there was nothing to fit)
    before: dict = field(default_factory=dict)   # label -> {quantity: metrics}, all points
    after: dict = field(default_factory=dict)    # label -> {quantity: metrics}, all points
    this_run: dict = field(default_factory=dict)  # label -> {quantity: metrics}, the new run's points
    written: bool = False
    copied: list = field(default_factory=list)   # new run files copied under measurements/<gpu>/
    missing: list = field(default_factory=list)  # files of the earlier table that are gone
    warnings: list = field(default_factory=list)
    text: str = ""


def _earlier_files(existing: dict | None) -> tuple[list[Path], list[str], list[str]]:
    """(files still present, missing ones, warnings about changed ones) of the table's provenance."""
    present, missing, warnings = [], [], []
    for run in (existing or {}).get("provenance", {}).get("runs", []):
        path = Path(run["file"])
        path = path if path.is_absolute() else REPO_ROOT / path
        if not path.is_file():
            missing.append(run["file"])
            continue
        if run.get("sha256") and sha256(path) != run["sha256"]:
            warnings.append(f"{run['file']} changed since the current table was fitted")
        present.append(path)
    return present, missing, warnings


def _copy_destinations(new_files: list[Path], folder: Path) -> dict[Path, Path]:
    """Where each new file goes under the measurements folder (same content: existing copy)."""
    existing = {sha256(f): f for f in folder.glob("*.csv")} if folder.is_dir() else {}
    out = {}
    for f in new_files:
        digest = sha256(f)
        if f.resolve().parent == folder.resolve():
            out[f] = f
        elif digest in existing:
            out[f] = existing[digest]
        else:
            stem = f.parent.name if f.stem in ("results", "measurements", "records") else f.stem
            dest = folder / f"{stem}.csv"
            if dest.exists() or dest in out.values():
                dest = folder / f"{stem}-{digest[:8]}.csv"
            out[f] = dest  # a Parquet run is committed as CSV (_commit converts it)
    return out


def _subset_errors(data, pred, mask) -> dict:
    if not mask.any():
        return {}
    return error_table(data.subset(mask), pred[mask].reset_index(drop=True))


def refresh(run_dirs, gpu_slug: str, table_path: Path | None = None, write: bool = True,
            measurements_dir: Path | None = None, allow_missing: bool = False) -> RefreshResult:
    """Fit the table of `gpu_slug` on all its measurements plus the new run's; compare; write."""
    table_path = Path(table_path) if table_path else calibration_table.default_path(gpu_slug)
    base = Path(measurements_dir) if measurements_dir else MEASUREMENTS_DIR
    folder = base / gpu_slug
    result = RefreshResult(gpu_slug, table_path)
    existing = calibration_table.read(table_path, gpu_slug)  # TableError on a corrupt or foreign table
    new_files = csv_files(run_dirs)
    earlier, result.missing, changed = _earlier_files(existing)
    result.warnings += changed
    files = committed_files(gpu_slug, base) + earlier + new_files
    data = load(files, gpu_slug)
    new_paths = {display_path(f) for f in new_files}
    new_digests = {sha256(f) for f in new_files}
    new_source = {f.path for f in data.files if f.sha256 in new_digests}
    new_mask = (data.frame["source_file"].isin(new_source | new_paths).to_numpy() if len(data.frame)
                else np.zeros(0, bool))
    lines = [f"calibration refresh for {gpu_slug}: {len(data.frame)} points from {len(data.files)} files "
             f"({int(new_mask.sum())} from this run)"]
    for reason, n in sorted(data.skipped.items()):
        lines.append(f"  left out {n} rows: {reason}")
    if len(data.frame) == 0:
        lines.append("nothing measured on this GPU to fit: the table is unchanged")
        result.text = "\n".join(lines)
        return result

    raw = predict(data, "none")
    result.before["uncalibrated"] = error_table(data, raw)
    current = None
    if existing is not None:
        cal = Calibration.from_table(existing, str(table_path))
        current = predict(data, cal)
        result.before["current table"] = error_table(data, current)
        result.warnings += _version_warnings(cal, data.frame[new_mask]) if new_mask.any() else []
    fit, cv = fit_and_validate(data)
    result.warnings += fit.notes
    result.after[NEW_LABEL] = cv.calibrated
    if new_mask.any():
        result.this_run["uncalibrated"] = _subset_errors(data, raw, new_mask)
        if current is not None:
            result.this_run["current table"] = _subset_errors(data, current, new_mask)
        result.this_run[NEW_LABEL] = _subset_errors(data, cv.oof, new_mask)

    # only a run file that gave the fit points is committed (a run of simulated or skipped rows is not)
    used_digests = {f.sha256 for f in data.files if f.used}
    fitted_files = [f for f in new_files if sha256(f) in used_digests]
    destinations = _copy_destinations(fitted_files, folder) if write else {}
    file_paths = {display_path(src): display_path(dst) for src, dst in destinations.items()}
    result.table = calibration_table.build(data, fit, cv, file_paths=file_paths)
    if result.missing:
        result.table["notes"].append("dropped earlier measurement files that are gone: " + ", ".join(result.missing))
    lines += _comparison_lines(result, bool(new_mask.any()))
    lines += _write(result, folder, destinations, allow_missing) if write else ["compare only: nothing written"]
    result.text = "\n".join(lines)
    return result


def _comparison_lines(result: RefreshResult, this_run: bool) -> list[str]:
    """Before/after errors, this run's points, the new factors and bounds, the warnings."""
    lines = ["", "all points: before and after (|error| median, p90, under-estimate rate)",
             render.errors(list(result.before.items()) + list(result.after.items()))]
    if this_run:
        lines += ["", "this run's points", render.errors(list(result.this_run.items()))]
    lines += ["", "new factors", render.factors(result.table), "", "safe upper bounds",
              render.upper_bounds(result.table)]
    return lines + [f"warning: {w}" for w in result.warnings]


def _write(result: RefreshResult, folder: Path, destinations: dict, allow_missing: bool) -> list[str]:
    """Copy the run's measurement files under the measurements folder and write the table; refused
    while earlier measurement files of the current table are gone (unless `allow_missing`)."""
    if result.missing and not allow_missing:
        return ["NOT WRITTEN: earlier measurement files of the current table are gone ("
                + ", ".join(result.missing) + "); restore them or refresh with allow_missing=True"]
    folder.mkdir(parents=True, exist_ok=True)
    for src, dst in destinations.items():
        if src.resolve() != dst.resolve() and not dst.exists():
            _commit(src, dst)
            result.copied.append(display_path(dst))
    calibration_table.write(result.table_path, result.table)
    result.written = True
    return [f"written: {display_path(result.table_path)}"
            + (f" (measurements copied: {', '.join(result.copied)})" if result.copied else "")]


def _commit(src: Path, dst: Path) -> None:
    """Copy a run's measurement file under the measurements folder, atomically (as CSV)."""
    if src.suffix == ".parquet":
        atomic_write(dst, lambda tmp: read_table_file(src).to_csv(tmp, index=False))
    else:
        atomic_write(dst, lambda tmp: tmp.write_bytes(src.read_bytes()))


def _version_warnings(cal: Calibration, frame) -> list[str]:
    """The new run's library versions against those the current table was fitted on."""
    out = []
    for lib in VERSION_COLUMNS:
        values = sorted(set(v for v in frame.get(lib, []) if v))
        for value in values:
            out += cal.version_warnings({lib: value})
    return out
