"""The tracer against real GPU measurements: each single-process row of a GPU's committed
measurements (calibrations/measurements/<gpu>/) traced whole with the allocator model
(`trace(..., reserved=True)`), its traced peak allocated and peak reserved beside the measured ones,
and the raw estimate's reserved for comparison. `scripts/bench_tracer.py --measured <gpu>` prints it.

The trace has no CUDA context and no cuBLAS workspaces (allocated by the caching allocator on a GPU,
tens of MiB), so it sits a little under; rows the tracer cannot run (bitsandbytes optimizers,
several GPUs) are left out with their reason."""

from __future__ import annotations

import csv
from dataclasses import dataclass, fields



def measured_files(gpu: str) -> list:
    """calibrations/measurements/<gpu>/*.csv (fitting.data.committed_files)."""
    from fitting.data import committed_files

    return committed_files(gpu)


@dataclass(frozen=True)
class MeasuredRow:
    """One measured row and its trace (bytes)."""

    label: str
    source_file: str
    measured_allocated_bytes: int
    measured_reserved_bytes: int
    traced_allocated_bytes: int
    traced_reserved_bytes: int
    estimated_reserved_bytes: int | None   # the raw estimator (no calibration), for comparison; None
                                           # for a superseded row (it ran a regime the estimator left)
    trace_s: float

    def error(self, what: str) -> float | None:
        """(traced or estimated - measured) / measured: what is allocated, reserved or estimated
        (None: not estimated)."""
        got = {"allocated": self.traced_allocated_bytes, "reserved": self.traced_reserved_bytes,
               "estimated": self.estimated_reserved_bytes}[what]
        if got is None:
            return None
        measured = self.measured_allocated_bytes if what == "allocated" else self.measured_reserved_bytes
        return got / measured - 1.0

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(allocated_error=self.error("allocated"), reserved_error=self.error("reserved"),
                 estimated_reserved_error=self.error("estimated"))
        return d


def case_of(row: dict):
    """The Case a measured row ran, and its Workload (profiler.record.case_from_row)."""
    from profiler.record import case_from_row

    case = case_from_row(row)
    return case, case.workload()


def regime_of(path, row_id: str):
    """The context a row of `path` is traced in: the regime it ran when
    calibrations/measurements/superseded.csv lists it (fitting.data.superseded_regime; TRL
    0.25.0-1.7.x's offloading: profiler.offload.legacy_dedupe), else nothing."""
    from contextlib import nullcontext

    from fitting.data import superseded_regime
    from profiler.offload import legacy_dedupe

    regime = superseded_regime(path, row_id)
    if regime is None:
        return nullcontext()
    if regime == "trl-legacy-dedupe":
        return legacy_dedupe()
    raise ValueError(f"calibrations/measurements/superseded.csv: unknown regime {regime!r}")


def against_measurements(gpu: str, match: str | None = None, log=print) -> tuple[list[MeasuredRow], list[tuple]]:
    """(rows traced, [(label, reason)] left out) for `gpu`'s committed measurements; `match` keeps
    the rows whose id contains it."""
    from estimator.api import estimate
    from fitting.data import superseded_regime
    from profiler.trace.step import trace

    rows, left_out = [], []
    for path in measured_files(gpu):
        for row in csv.DictReader(path.open()):
            if row["status"] != "ok" or (match and match.lower() not in row["id"].lower()):
                continue
            label = row["id"]
            if int(row.get("world_size") or 1) != 1:
                left_out.append((label, "several processes: not traced"))
                continue
            case, w = case_of(row)
            superseded = superseded_regime(path, row["id"]) is not None
            try:
                with regime_of(path, row["id"]):
                    result = trace(case, reserved=True)
            except NotImplementedError as exc:
                left_out.append((label, f"not traceable: {exc}"))
                continue
            est = None if superseded else estimate(w, gpu, calibration="none").memory.peak_reserved_bytes
            r = MeasuredRow(label, path.name, int(row["peak_allocated_bytes"]), int(row["peak_reserved_bytes"]),
                            result.peak_allocated_bytes, result.peak_reserved_bytes, est, result.trace_s)
            rows.append(r)
            if log:
                versus = ("estimator: superseded regime" if est is None
                          else f"estimator {100 * r.error('estimated'):+6.2f}%")
                log(f"{label[:70]:70} allocated {100 * r.error('allocated'):+6.2f}%  reserved "
                    f"{100 * r.error('reserved'):+6.2f}%  ({versus})  {r.trace_s:5.1f} s")
    return rows, left_out
