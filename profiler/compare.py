"""Predicted vs measured, quantity by quantity, with the error statistics users need.

Error of a prediction (docs/design.md section 7): (predicted - measured) / measured, signed, on the
same named quantity. Per quantity the summary gives n, median |error|, p90 |error| (linear
interpolation between order statistics, numpy's default), the under-estimate rate (share of
cases predicted below measured: those cost a user an OOM) and the mean signed error (bias).

Which rows are compared: a configuration run on several ranks is compared once, on its ranks
merged by `profiler.record.merge_ranks` (each memory quantity the largest over the ranks, the step
times of the slowest rank), and only when that merged status is `ok` (no rank ran out of memory or
failed). What each backend measures (anything else is "not measured", never 0 and never a 100 % error):
- cuda: every quantity below;
- trace: peak_allocated_bytes only (a fake-tensor trace has neither allocator segments nor time);
- cpu: nothing comparable (no device memory; CPU step time says nothing about a GPU).
Predictions use estimator.api.estimate on the row's GPU (--gpu overrides; trace rows without a
GPU use estimator.calibration.TRACE_PREDICTION_GPU, which only the time would depend on). A training
step is predicted as the row's loop ran it (profiler.steps.loop_step_s): the estimate's step less
the fixed host work between steps (data loading, logging: the profiler's loop has none), and less
the gradient clipping where the row did not clip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from estimator.api import estimate
from estimator.calibration import TRACE_PREDICTION_GPU
from estimator.errors import InputError
from estimator.files import atomic_write, atomic_write_json, atomic_write_text
from estimator.units import gib
from estimator.workload import Workload
from profiler.plot import parity_plot
from profiler.record import measured_value, merge_ranks, workload_from_row
from profiler import steps


@dataclass(frozen=True)
class Quantity:
    """A compared quantity: record column, unit, the Estimate value, backends that measure it."""

    name: str
    unit: str                       # "bytes" or "s"
    predicted: Callable             # Estimate -> int | float | None
    backends: tuple[str, ...]
    inference_only: bool = False
    training_only: bool = False


def _prefill(e):
    return e.time.prefill_s if e.workload.new_tokens else None


def _decode(e):
    return e.time.decode_s_per_token if e.workload.new_tokens else None


def _nosync(e):
    return e.time.microbatch_s if steps.reduction_timed_apart(e.workload) else None


def _sync(e):
    return e.time.microbatch_s + e.time.reduction_exposed_s if steps.reduction_timed_apart(e.workload) else None


QUANTITIES = (
    Quantity("peak_allocated_bytes", "bytes", lambda e: e.memory.peak_allocated_bytes, ("cuda", "trace")),
    Quantity("peak_reserved_bytes", "bytes", lambda e: e.memory.peak_reserved_bytes, ("cuda",)),
    Quantity("device_used_bytes", "bytes", lambda e: e.memory.device_used_bytes, ("cuda",)),
    Quantity("step_s", "s", lambda e: e.time.step_s, ("cuda",)),
    Quantity("prefill_s", "s", _prefill, ("cuda",), inference_only=True),
    Quantity("decode_token_s", "s", _decode, ("cuda",), inference_only=True),
    Quantity("optimizer_s", "s", lambda e: e.time.optimizer_s, ("cuda",), training_only=True),
    Quantity("clip_s", "s", lambda e: e.time.clip_s, ("cuda",), training_only=True),
    Quantity("overhead_s", "s", lambda e: e.time.overhead_s, ("cuda",), training_only=True),
    Quantity("nosync_microbatch_s", "s", _nosync, ("cuda",), training_only=True),
    Quantity("sync_microbatch_s", "s", _sync, ("cuda",), training_only=True),
)


@dataclass(frozen=True)
class Point:
    """One quantity of one configuration. `error` is None when either side is missing, and
    `note` then says why ("not measured on cpu", "not predicted: ...")."""

    id: str
    backend: str
    gpu_slug: str
    quantity: str
    unit: str
    predicted: float | None
    measured: float | None
    error: float | None
    note: str = ""


def signed_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; measured must be positive."""
    return (predicted - measured) / measured


# ---- rows -> configurations -------------------------------------------------------------------

def ok_configurations(rows: list[dict]) -> list[dict]:
    """One row per configuration (record.merge_ranks), those whose merged status is ok."""
    return [row for row in merge_ranks(rows) if row.get("status") == "ok"]


def estimate_predictor(gpu: str | None = None, calibration: str = "auto") -> Callable:
    """predict(row) -> (gpu slug, {quantity: value}) from estimator.api.estimate; raises
    InputError when the row names no GPU or the estimator refuses the workload. A trace row (exact
    tensor bytes on fake CPU tensors) is set against the raw formulas under `auto`: a GPU's or the
    published table corrects what a real GPU adds, which a trace never has."""

    def predict(row: dict) -> tuple[str, dict]:
        traced = row.get("backend") == "trace"
        slug = gpu or row.get("gpu_slug") or (TRACE_PREDICTION_GPU if traced else None)
        if not slug:
            raise InputError("the row names no GPU (pass --gpu)")
        workload: Workload = workload_from_row(row)
        table = "none" if (traced and calibration == "auto") else calibration
        est = estimate(workload, slug, calibration=table, cpu_trace=traced)
        values = {q.name: q.predicted(est) for q in QUANTITIES}
        if workload.training:   # what the row's loop ran: no host work between steps, its clipping
            values["step_s"] = steps.loop_step_s(est.time, steps.clipped(row))
        return slug, values
    return predict


def compare_rows(rows: list[dict], predict: Callable) -> list[Point]:
    """Points for every ok configuration and every quantity that applies to its method."""
    points = []
    for row in ok_configurations(rows):
        backend = row.get("backend") or ""
        inference = row.get("method") == "inference"
        wanted = [q for q in QUANTITIES if (not q.inference_only or inference) and (not q.training_only or not inference)]
        measured = {q.name: measured_value(row.get(q.name)) if backend in q.backends else None for q in wanted}
        slug, predicted, failure = row.get("gpu_slug") or "", {}, ""
        if any(v is not None for v in measured.values()):
            try:
                slug, predicted = predict(row)
            except InputError as exc:
                failure = f"not predicted: {exc}"
        for q in wanted:
            points.append(_point(row, backend, slug, q, predicted.get(q.name), measured[q.name], failure))
    return points


def _point(row, backend, slug, q: Quantity, predicted, measured, failure) -> Point:
    if measured is None:
        note = "not measured" + ("" if backend in q.backends else f" on {backend or 'this backend'}")
    elif predicted is None:
        note = failure or "not predicted"
    else:
        note = ""
    error = signed_error(float(predicted), measured) if not note else None
    return Point(row["id"], backend, slug or "", q.name, q.unit,
                 None if predicted is None else float(predicted), measured, error, note)


# ---- statistics ---------------------------------------------------------------------------------

def percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between order statistics (numpy's default method)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * pct / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(points: list[Point]) -> dict:
    """Per quantity: n compared, n not measured/predicted, median and p90 |error|, under-estimate
    rate, mean signed error. Statistics are None when nothing was compared."""
    out = {}
    for q in QUANTITIES:
        mine = [p for p in points if p.quantity == q.name]
        errors = [p.error for p in mine if p.error is not None]
        absolute = [abs(e) for e in errors]
        out[q.name] = {
            "unit": q.unit,
            "n": len(errors),
            "not_measured": sum(p.measured is None for p in mine),
            "not_predicted": sum(p.measured is not None and p.error is None for p in mine),
            "median_abs_error": percentile(absolute, 50) if errors else None,
            "p90_abs_error": percentile(absolute, 90) if errors else None,
            "under_estimate_rate": sum(e < 0 for e in errors) / len(errors) if errors else None,
            "mean_error": sum(errors) / len(errors) if errors else None,
        }
    return out


# ---- text ---------------------------------------------------------------------------------------

def fmt_value(value: float | None, unit: str) -> str:
    """GiB with two decimals for bytes, milliseconds or seconds for time."""
    if value is None:
        return "-"
    if unit == "bytes":
        return f"{gib(value):.2f} GiB"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def fmt_pct(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "-"
    return f"{value * 100:+.1f}%" if signed else f"{value * 100:.1f}%"


def points_text(points: list[Point], width: int = 70) -> list[str]:
    """One line per compared quantity; one line per configuration with nothing measured."""
    lines, by_id = [], {}
    for p in points:
        by_id.setdefault(p.id, []).append(p)
    for case_id, mine in by_id.items():
        name = case_id if len(case_id) <= width else case_id[:width - 3] + "..."
        if all(p.measured is None for p in mine):
            lines.append(f"{name:<{width}}  not measured (backend {mine[0].backend})")
            continue
        for p in mine:
            shown = p.note or f"{fmt_pct(p.error)}"
            lines.append(f"{name:<{width}}  {p.quantity:<21} {fmt_value(p.predicted, p.unit):>11} "
                         f"{fmt_value(p.measured, p.unit):>11}  {shown}")
    return lines


def summary_text(summary: dict) -> list[str]:
    head = (f"{'quantity':<21} {'n':>4} {'not measured':>13} {'median |err|':>13} {'p90 |err|':>10} "
            f"{'under-est.':>10} {'bias':>8}")
    lines = [head]
    for name, s in summary.items():
        lines.append(f"{name:<21} {s['n']:>4} {s['not_measured']:>13} {fmt_pct(s['median_abs_error'], False):>13} "
                     f"{fmt_pct(s['p90_abs_error'], False):>10} {fmt_pct(s['under_estimate_rate'], False):>10} "
                     f"{fmt_pct(s['mean_error']):>8}")
    return lines


def report_text(points: list[Point], summary: dict, calibration: str) -> str:
    """The whole comparison as text: per-configuration lines, then the summary table."""
    header = (f"predicted vs measured (error = (predicted - measured) / measured; calibration: {calibration})\n"
              f"{'configuration':<70}  {'quantity':<21} {'predicted':>11} {'measured':>11}  error")
    body = points_text(points) or ["(no ok rows to compare)"]
    return "\n".join([header, *body, "", *summary_text(summary)]) + "\n"


# ---- the whole step, on a run folder --------------------------------------------------------------

def write_comparison(rows: list[dict], run_dir: Path, gpu: str | None = None,
                     calibration: str = "auto", predict: Callable | None = None) -> dict:
    """Compare, then write compare.csv (one line per point), compare.json (summary + points),
    compare.txt and parity.png into run_dir. Returns the summary dict (with file names)."""
    import pandas as pd

    points = compare_rows(rows, predict or estimate_predictor(gpu, calibration))
    summary = summarize(points)
    run_dir = Path(run_dir)
    frame = pd.DataFrame([p.__dict__ for p in points], columns=list(Point.__dataclass_fields__))
    atomic_write(run_dir / "compare.csv", lambda tmp: frame.to_csv(tmp, index=False))
    text = report_text(points, summary, calibration)
    atomic_write_text(run_dir / "compare.txt", text)
    parity_plot(points, run_dir / "parity.png")
    result = {"calibration": calibration, "gpu": gpu, "quantities": summary,
              "files": ["compare.csv", "compare.json", "compare.txt", "parity.png"],
              "points": [p.__dict__ for p in points]}
    atomic_write_json(run_dir / "compare.json", result)
    return {**result, "text": text}
