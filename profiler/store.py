"""The run folder: record rows in one table file, written atomically, plus the run's own files.

Layout of a run folder (default `runs/<gpu-slug or cpu>-<UTC timestamp>/`):

    results.csv        every record row (profiler/record.py columns), one per configuration and rank
    run.json           one entry per invocation: command line, start/end time, environment
    sweep.yaml|json    a copy of the sweep file (a changed file on resume: sweep-<timestamp>.yaml)
    logs/              stdout and stderr of every child process
    compare.*, parity.png, max_batch.json   written after the sweep (profiler/compare.py, search.py)

Atomic: every write goes to a temporary file in the same folder, is flushed and fsync'ed, then
`os.replace`d over the target, so a killed sweep leaves either the previous complete file or the
new complete file, never half of one.

Resume semantics (the key is the Workload id of the configuration):
- finished = the id has rows and none of them is `error`: ok, oom and skipped are results;
- an id with an `error` row (crash, timeout, a bug) is kept as it is on a plain rerun and run
  again only with `retry_errors` (--retry-errors), since errors are often not transient;
- `force` (--force) runs every configuration of the sweep again;
- a configuration that runs again has all its old rows replaced (never duplicated); rows of ids
  the current sweep does not name are never dropped.

CSV is the default format; Parquet (`results.parquet`) needs pyarrow. In memory a row is a dict:
int bytes and counts, float seconds, bool flags, str text, None for "not measured" (the types
are profiler.record's: `record.parse_value` reads each cell back).
"""

from __future__ import annotations

from pathlib import Path

from estimator import schema as sch
from estimator.errors import InputError
from estimator.files import atomic_write, atomic_write_json, atomic_write_text, parse_json, utc_stamp
from profiler import record
from profiler.case import Case
from profiler.record import COLUMN_NAMES, check_row


# ---- value conversion (reading back: record.parse_value) ------------------------------------------

def _to_cell(value):
    """A row value as stored: tuples/lists as comma strings, the rest unchanged (None stays empty)."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return value


# run.json: {"invocations": [{...}, ...]}, each invocation an object (session.invocation writes them)
_RUN_JSON = sch.Obj({"invocations": sch.List(sch.Map(sch.ANY))})


# ---- the store --------------------------------------------------------------------------------

class RunStore:
    """Rows of one run folder, held in memory and rewritten atomically after each change."""

    def __init__(self, run_dir: str | Path, fmt: str | None = None):
        """Open (and check) a run folder. Everything it holds is read and validated before the
        folder is created or anything in it changes: a refused folder is left as it was."""
        self.run_dir = Path(run_dir)
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise InputError(f"--run {self.run_dir} is a file, not a run folder")
        found = [f for f in ("csv", "parquet") if (self.run_dir / f"results.{f}").exists()]
        self.fmt = fmt or (found[0] if found else "csv")
        if self.fmt not in ("csv", "parquet"):
            raise InputError(f"result format must be csv or parquet; got {self.fmt!r}")
        if found and self.fmt not in found:  # resuming must read the rows already there
            raise InputError(f"{self.run_dir} holds results.{found[0]}: resume it in that format")
        if self.fmt == "parquet":
            _require_pyarrow()
        self._rows: list[dict] = self._read()
        self._run_json()                      # a corrupt run.json is refused now, not after writing
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create run folder {self.run_dir}: {exc.strerror}") from None
        self._clean_temporaries()

    @property
    def path(self) -> Path:
        return self.run_dir / f"results.{self.fmt}"

    def _clean_temporaries(self) -> None:
        """Temporary files a killed writer left behind (never the results themselves)."""
        for stale in self.run_dir.glob(".results.*.tmp"):
            stale.unlink(missing_ok=True)

    def _read(self) -> list[dict]:
        if not self.path.exists():
            return []
        import pandas as pd

        try:
            if self.fmt == "csv":
                frame = pd.read_csv(self.path, dtype=str, keep_default_na=False)
            else:
                frame = pd.read_parquet(self.path).astype("string").fillna("")
        except Exception as exc:  # a corrupt table is bad input: say which file
            raise InputError(f"cannot read results {self.path}: {exc}") from None
        unknown = sorted(set(frame.columns) - set(COLUMN_NAMES))
        if unknown or not {"id", "status", "backend"} <= set(frame.columns):
            what = f"unknown columns {', '.join(map(str, unknown[:5]))}" if unknown else "no id, status or backend column"
            raise InputError(f"cannot read results {self.path}: {what} (not a profiler results file)")
        rows = []
        try:
            for line, rec in enumerate(frame.to_dict("records"), start=2):
                row = {k: record.parse_value(k, v) for k, v in rec.items()}
                if not row.get("id"):
                    raise InputError(f"row {line} has no id")
                try:
                    check_row(row)
                except ValueError as exc:
                    raise InputError(f"row {line}: {exc}") from None
                rows.append(row)
        except InputError as exc:  # a cell not of its column's type, a row without an id
            raise InputError(f"cannot read results {self.path}: {exc}") from None
        return rows

    def _write(self) -> None:
        import pandas as pd

        columns = list(COLUMN_NAMES) + sorted({k for r in self._rows for k in r} - set(COLUMN_NAMES))
        frame = pd.DataFrame({c: pd.Series([_to_cell(r.get(c)) for r in self._rows], dtype=object)
                              for c in columns}, columns=columns)
        if self.fmt == "csv":
            atomic_write(self.path, lambda tmp: frame.to_csv(tmp, index=False))
        else:
            atomic_write(self.path, lambda tmp: frame.astype("string").to_parquet(tmp, index=False))

    # ---- queries ----

    def rows(self) -> list[dict]:
        """Copies of every stored row, in the order they were stored."""
        return [dict(r) for r in self._rows]

    def rows_of(self, case_id: str) -> list[dict]:
        return [dict(r) for r in self._rows if r.get("id") == case_id]

    def statuses(self) -> dict[str, set[str]]:
        """id -> the set of statuses of its rows."""
        out: dict[str, set[str]] = {}
        for r in self._rows:
            out.setdefault(r.get("id"), set()).add(r.get("status"))
        return out

    def is_finished(self, case_id: str, retry_errors: bool = False) -> bool:
        """True when the id has rows and (with retry_errors) none of them is an error."""
        statuses = self.statuses().get(case_id)
        if not statuses:
            return False
        return not (retry_errors and "error" in statuses)

    def pending(self, cases: list[Case], force: bool = False, retry_errors: bool = False) -> list[Case]:
        """The cases still to run, in order (see the module docstring for the rules)."""
        if force:
            return list(cases)
        statuses = self.statuses()
        return [c for c in cases
                if not statuses.get(c.id) or (retry_errors and "error" in statuses[c.id])]

    # ---- changes ----

    def put(self, case_id: str, rows: list[dict]) -> None:
        """Replace every stored row of `case_id` by `rows` and rewrite the file atomically."""
        if not rows:
            raise ValueError("put() needs at least one row")
        for row in rows:
            if row.get("id") != case_id:
                raise ValueError(f"row id {row.get('id')!r} is not {case_id!r}")
            check_row({k: v for k, v in row.items() if k in COLUMN_NAMES})
        self._rows = [r for r in self._rows if r.get("id") != case_id] + [dict(r) for r in rows]
        self._write()

    # ---- the run's own files ----

    def write_json(self, name: str, data) -> Path:
        path = self.run_dir / name
        atomic_write_json(path, data)
        return path

    def write_text(self, name: str, text: str) -> Path:
        path = self.run_dir / name
        atomic_write_text(path, text)
        return path

    def keep_sweep_copy(self, source: Path | None = None, text: str | None = None,
                        suffix: str = ".yaml") -> str:
        """Copy the sweep file (or write `text`) as sweep<suffix>; if a different one is already
        there (a resumed run with an edited sweep), keep both: the new one as sweep-<stamp>."""
        if source is not None:
            text, suffix = Path(source).read_text(), Path(source).suffix or suffix
        target = self.run_dir / f"sweep{suffix}"
        if target.exists() and target.read_text() != text:
            target = self.run_dir / f"sweep-{utc_stamp()}{suffix}"
        if not target.exists():
            atomic_write_text(target, text)
        return target.name

    def log_invocation(self, info: dict) -> int:
        """Append one invocation record to run.json; returns its index (for `finish_invocation`)."""
        data = self._run_json()
        data.setdefault("invocations", []).append(info)
        self.write_json("run.json", data)
        return len(data["invocations"]) - 1

    def finish_invocation(self, index: int, **info) -> None:
        """Add end-of-run facts (finished_at, counts) to one invocation of run.json."""
        data = self._run_json()
        data["invocations"][index].update(info)
        self.write_json("run.json", data)

    def _run_json(self) -> dict:
        path = self.run_dir / "run.json"
        if not path.exists():
            return {"invocations": []}
        try:
            data = parse_json(path.read_bytes(), str(path), "run file")
            sch.check(_RUN_JSON, data, "run.json")
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror}") from None
        except InputError as exc:
            raise InputError(f"{path} is corrupt: {exc}") from None
        return data


def default_run_dir(label: str, parent: str | Path = "runs") -> Path:
    """runs/<label>-<UTC timestamp>, with a numeric suffix if that folder exists."""
    base = Path(parent) / f"{label}-{utc_stamp()}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _require_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise InputError("Parquet results need pyarrow, which is not installed; use csv") from None

