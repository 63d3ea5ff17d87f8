"""`profile.py import FILE` (`gpu-budget import FILE`): measurements from anywhere, in the profiler's
own row schema (profiler/record.py), stored under calibrations/measurements/<source>/.

The input is CSV or JSON (a list of objects), one measurement per row:
- required: `model` (catalog name, Hub id or config path), `gpu_slug` (a row of
  estimator/data/gpus.csv), `metric` (allocated, reserved, active, device, capacity, oom),
  `value` and `unit` as printed (GiB, GB, MiB, MB, B; not needed for oom), `source` (a short name:
  letters, digits, `.`, `_`, `-`; the folder the rows go to), `locator` (repository, path, commit and
  line or table, or a URL);
- optional: any Workload field (estimator/workload.py; absent = the Workload default, counted as
  guessed), `stated` (comma list of the Workload fields the source stated; default: those the row
  gives), library versions (`torch`, `transformers`, `peft`, `bitsandbytes`, `deepspeed`, `driver`,
  `cuda`), `step_s`, `tokens_per_s`, `window` (`decode`: the peak covers a generate's decode
  alone, without the prefill's working set; absent: the whole step or generate), `message` (a note), `use` (`fit`, the default, or `skip: <why>`:
  a transcribed row whose measured quantity the estimator cannot express; it is checked like the
  others, not stored, and counted with its reason, so the transcription keeps every row it read).
Every row is checked (its Workload validates, its value converts to positive bytes) before anything
is written; one bad row refuses the file with one line naming the row, and nothing is stored.
The stored file keeps the printed value, the unit and the conversion beside the bytes.
"""

from __future__ import annotations

import csv
import io
import re
import sys
from pathlib import Path

from estimator import flags, tables
from estimator.errors import InputError
from estimator.files import atomic_write_text, parse_json, utc_now
from profiler import record

MEASUREMENTS = Path(__file__).resolve().parents[1] / "calibrations" / "measurements"
UNITS = {"GiB": 2**30, "GB": 10**9, "MiB": 2**20, "MB": 10**6, "B": 1, "bytes": 1}
REQUIRED = ("model", "gpu_slug", "metric", "source", "locator")
_OWN = {"value", "unit", "stated", "use"} | set(record.COLUMN_NAMES)
_SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PROG = "import"


def read_rows(path: Path) -> list[dict]:
    """The raw rows of a CSV or JSON file (values as text or JSON scalars)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from None
    if path.suffix.lower() == ".json":
        data = parse_json(raw, str(path), "measurement file")
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise InputError(f"malformed measurement file {path}: a JSON list of objects, one per measurement")
        return data
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"malformed measurement file {path}: not UTF-8 text (byte {exc.start})") from None
    try:
        return list(csv.DictReader(io.StringIO(text)))
    except csv.Error as exc:
        raise InputError(f"malformed measurement file {path}: {exc}") from None


def _text(row: dict, name: str) -> str | None:
    value = row.get(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return str(value).strip()


def to_record(raw: dict, line: str, base_dirs: list[Path]) -> dict:
    """One measurement as a record row (InputError naming the row and the problem)."""
    try:
        return _to_record({k: v for k, v in raw.items() if k != "use"}, base_dirs)
    except InputError as exc:
        raise InputError(f"{line}: {exc}") from None


def skip_reason(raw: dict, line: str) -> str | None:
    """None for a row to store (`use` empty or `fit`); the reason for one marked `skip: <why>`."""
    use = _text(raw, "use")
    if use is None or use == "fit":
        return None
    if use.startswith("skip:") and use[len("skip:"):].strip():
        return use[len("skip:"):].strip()
    raise InputError(f"{line}: use {use!r} must be 'fit' or 'skip: <why>'")


def _to_record(raw: dict, base_dirs: list[Path]) -> dict:
    unknown = sorted(k for k in raw if k not in _OWN)
    if unknown:
        raise InputError(f"unknown columns {', '.join(map(str, unknown[:5]))} (the columns are profiler/record.py's "
                         f"plus value, unit, stated)")
    missing = [k for k in REQUIRED if _text(raw, k) is None]
    if missing:
        raise InputError(f"missing {', '.join(missing)}")
    source, metric, slug = _text(raw, "source"), _text(raw, "metric"), _text(raw, "gpu_slug")
    if not _SOURCE_NAME.match(source):
        raise InputError(f"source {source!r} must be a short name (letters, digits, '.', '_', '-')")
    if source in tables.gpus() or source in ("trace", "published"):
        raise InputError(f"source {source!r} names a folder of the profiler's own rows (a GPU slug, trace or "
                         f"published): choose the source's own name")
    if metric not in record.METRICS:
        raise InputError(f"metric {metric!r} must be one of {', '.join(record.METRICS)}")
    gpu = tables.gpu(slug)
    w = record.workload_from_row(raw, base_dirs)
    window = _text(raw, "window")
    if window is not None:
        if window not in record.WINDOWS:
            raise InputError(f"window {window!r} must be one of {', '.join(record.WINDOWS)} (or absent: the whole run)")
        if w.training or metric not in ("allocated", "active"):
            raise InputError(f"window {window!r} is an inference peak of allocated or active memory; this row is "
                             f"{w.method}, metric {metric}")
    given = [name for name in record.WORKLOAD_COLUMNS if _text(raw, name) is not None]
    stated = _text(raw, "stated")
    stated_fields = [s.strip() for s in stated.split(",")] if stated else given
    bad = [s for s in stated_fields if s not in record.WORKLOAD_COLUMNS]
    if bad:
        raise InputError(f"stated names {', '.join(bad)}, not Workload fields")
    columns = {"source": source, "locator": _text(raw, "locator"), "metric": metric,
               "stated": ",".join(stated_fields), "gpu_slug": gpu.slug, "gpu_name": gpu.name,
               "gpu_memory_bytes": gpu.memory_bytes, "status": "oom" if metric == "oom" else "ok",
               "world_size": w.world_size, "started_at": None, "message": _text(raw, "message"), "window": window}
    value, unit = _text(raw, "value"), _text(raw, "unit")
    if metric != "oom" or value is not None:
        if value is None or unit is None:
            raise InputError("value and unit are required (as the source printed them)")
        if unit not in UNITS:
            raise InputError(f"unit {unit!r} must be one of {', '.join(UNITS)}")
        try:
            number = float(value)
        except ValueError:
            raise InputError(f"value {value!r} is not a number") from None
        if not 0 < number < 1e6 * (2**30 / UNITS[unit]):
            raise InputError(f"value {value} {unit} is not a positive memory size a GPU can hold")
        size = round(number * UNITS[unit])
        columns.update(value_as_printed=value, unit_as_printed=unit,
                       conversion=f"{value} {unit} x {UNITS[unit]} = {size} B")
        target = record.METRICS[metric]
        if target:
            columns[target] = size
    for name in ("step_s", "tokens_per_s") + tuple(c for c in record.COLUMN_NAMES if c in (
            "torch", "transformers", "peft", "bitsandbytes", "deepspeed", "driver", "cuda")):
        if _text(raw, name) is not None:
            columns[name] = record.parse_value(name, raw[name])
    row = record.new_row(None, "published", workload=w, model=_text(raw, "model"), **columns)
    try:
        record.check_row(row)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return row


def import_file(path: str | Path, root: Path = MEASUREMENTS, force: bool = False) -> list[Path]:
    """Validate every row, then store them by source as <root>/<source>/<file stem>.csv."""
    path = Path(path)
    raws = read_rows(path)
    if not raws:
        raise InputError(f"{path} holds no measurements")
    base_dirs = [path.resolve().parent, Path.cwd(), record_root()]
    rows = []
    for i, raw in enumerate(raws, start=1):
        line = f"{path.name} row {i}"
        row, why = to_record(raw, line, base_dirs), skip_reason(raw, line)   # skipped rows are checked too
        if why is None:
            rows.append(row)
    if not rows:
        raise InputError(f"{path}: every row is marked 'use: skip', nothing to store")
    by_source: dict[str, list[dict]] = {}
    for row in rows:
        by_source.setdefault(row["source"], []).append(row)
    targets = {source: root / source / f"{path.stem}.csv" for source in by_source}
    clash = [str(t) for t in targets.values() if t.exists()]
    if clash and not force:
        raise InputError(f"{clash[0]} exists (already imported?): remove it, or pass --force to replace it")
    written = []
    for source, rows_of in by_source.items():
        targets[source].parent.mkdir(parents=True, exist_ok=True)
        written.append(atomic_write_text(targets[source], to_csv(rows_of)))
    return written


def record_root() -> Path:
    return Path(__file__).resolve().parents[1]


def to_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=record.COLUMN_NAMES, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ",".join(v) if isinstance(v, tuple) else ("" if v is None else v) for k, v in row.items()})
    return out.getvalue()


def main(argv: list[str] | None = None, prog: str = "profile.py import") -> int:
    p = flags.OneLineParser(prog=prog, description="Import measurements (CSV or JSON) into "
                                                   "calibrations/measurements/<source>/.")
    p.add_argument("file", help="CSV or JSON file of measurements (columns: see profiler/imports.py)")
    p.add_argument("--force", action="store_true", help="replace an earlier import of the same file")
    p.add_argument("--into", help="measurements folder (default calibrations/measurements)")
    args = p.parse_args(argv)
    try:
        written = import_file(args.file, Path(args.into) if args.into else MEASUREMENTS, args.force)
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"stored {path} ({utc_now()})")
    left_out = skipped(Path(args.file))
    for why, n in left_out.items():
        print(f"left out {n} row{'s' if n > 1 else ''} marked skip: {why}")
    return 0


def skipped(path: Path) -> dict[str, int]:
    """How many rows of a (valid) measurement file are marked `use: skip: <why>`, by reason."""
    out: dict[str, int] = {}
    for i, raw in enumerate(read_rows(path), start=1):
        why = skip_reason(raw, f"{path.name} row {i}")
        if why is not None:
            out[why] = out.get(why, 0) + 1
    return out
