"""Leave-one-model-out cross-validation, error statistics and the safe upper bound.

Error of a prediction (docs/design.md section 7): (predicted - measured) / measured, on the same
named quantity. Statistics per quantity: median |error|, p90 |error|, under-estimate rate (share of
points predicted below measured), points and models.

Leave one model out: for every architecture (fingerprint) in the data, fit on the others and
predict its points with the estimator itself (estimator.api.estimate with the fitted table), so
the error is the error of what users get. The upper bound of a memory quantity is point + k x the
uncertain part of that prediction (estimator.bounds: what is not an exactly counted model state),
k the QUANTILE of (measured - predicted) / uncertain part over those held-out points (at least 0),
or the older point x factor, the QUANTILE of measured / predicted (at least 1): each with its
coverage and median over-provision measured one level out (for each model, the scale taken from
the other models' points, checked on that model's), and the table keeps the form that covers at
least as much with less over-provision, as fitting/published.py does. Step time keeps the factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from estimator.api import estimate
from estimator.bounds import BOUND_QUANTITIES, uncertain_bytes
from estimator.calibration import SCHEMA, TRACE_GPU, Calibration
from estimator.defaults import overhead
from estimator.quantities import FITTED_QUANTITIES as QUANTITIES
from fitting.data import Dataset
from fitting.models import Fit, fit_all
from profiler import steps

QUANTILE = 0.95
# the factors that correct step time, by the steps that judge them: GEMM fractions on training steps,
# the decode factors on inference steps (prefill + decode)
TIME_GROUPS = ((("mfu", "training_host_s_per_op", "comm_bandwidth_fraction"), True),
               (("decode_bandwidth_fraction", "decode_host_s_per_layer"), False))


def calibration_of(factors: dict, gpu: str, label: str = "<fit>") -> Calibration:
    """A Calibration object holding `factors` (used without writing a file)."""
    return Calibration.from_table({"schema": SCHEMA, "gpu": gpu, "factors": factors}, label)


def predict(data: Dataset, calibration, uncertain: bool = False) -> pd.DataFrame:
    """Predicted quantities of every point with `calibration` ("none", a path or a Calibration);
    with `uncertain`, also each memory quantity's uncertain part (column "u_<quantity>")."""
    rows = []
    clipped = data.frame["clipped"].to_numpy(bool) if "clipped" in data.frame else [False] * len(data.workloads)
    for w, clips in zip(data.workloads, clipped):
        est = estimate(w, data.slug, calibration, cpu_trace=data.gpu == TRACE_GPU)
        m = est.memory
        step = steps.loop_step_s(est.time, bool(clips)) if w.training else est.time.step_s
        row = {"peak_allocated_bytes": float(m.peak_allocated_bytes),
               "peak_reserved_bytes": float(m.peak_reserved_bytes),
               "device_used_bytes": float(m.device_used_bytes),
               "context_bytes": float(m.cuda_context_bytes), "step_s": step}
        if uncertain:
            row.update({f"u_{q}": float(v) for q, v in uncertain_bytes(m).items()})
        rows.append(row)
    columns = list(QUANTITIES) + ([f"u_{q}" for q in BOUND_QUANTITIES] if uncertain else [])
    return pd.DataFrame(rows, columns=columns)


def metrics(pred, meas, groups=None) -> dict | None:
    """{median_abs, p90_abs, under_rate, points, models} over the points measured, or None."""
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    ok = np.isfinite(pred) & np.isfinite(meas) & (meas > 0)
    if not ok.any():
        return None
    err = (pred[ok] - meas[ok]) / meas[ok]
    out = {"median_abs": float(np.median(np.abs(err))), "p90_abs": float(np.quantile(np.abs(err), 0.9)),
           "under_rate": float(np.mean(err < 0)), "points": int(ok.sum())}
    if groups is not None:
        out["models"] = int(len(set(np.asarray(groups)[ok])))
    return out


def error_table(data: Dataset, pred: pd.DataFrame) -> dict:
    """{quantity: metrics} of `pred` against the measurements of `data`."""
    out = {}
    for q in QUANTITIES:
        m = metrics(pred[q], data.frame[f"m_{q}"], data.frame["group"])
        if m:
            out[q] = m
    return out


def covering_scale(values, at_least: float, quantile: float = QUANTILE) -> float:
    """The one place a bound's scale is fitted: the `quantile` of held-out `values` (an observed
    point's measured / predicted for a factor, (measured - predicted) / uncertain part for the
    scale k of estimator.bounds), never below `at_least` (1 for a factor, 0 for k: a bound is
    never below the point)."""
    values = np.asarray(values, float)
    values = values[np.isfinite(values)]
    return max(at_least, float(np.quantile(values, quantile, method="higher")))


def upper_bound(ratio: np.ndarray, groups: np.ndarray, quantile: float = QUANTILE,
                predicted: np.ndarray | None = None, uncertain: np.ndarray | None = None) -> dict | None:
    """The bound covering `quantile` of held-out points, with nested coverage and median
    over-provision: point x factor from `ratio` (measured / predicted), and, given the points'
    `predicted` values and `uncertain` parts, point + k x uncertain part; the form that covers at
    least as much with less over-provision is kept."""
    ok = np.isfinite(ratio)
    if uncertain is not None:
        ok &= np.isfinite(uncertain) & (np.asarray(uncertain, float) > 0)
    ratio, groups = ratio[ok], groups[ok]
    models = sorted(set(groups))
    if len(models) < 2 or len(ratio) < 3:
        return None
    factor = covering_scale(ratio, 1.0, quantile)
    covered, over = [], []
    for g in models:
        mine = groups == g
        u = covering_scale(ratio[~mine], 1.0, quantile)
        covered.extend(ratio[mine] <= u)
        over.extend(u / ratio[mine] - 1)       # bound / measured - 1, measured = ratio x predicted
    row = {"factor": math.ceil(factor * 1e4) / 1e4,  # rounded up: never below what was measured
           "quantile": quantile, "coverage": float(np.mean(covered)), "points": int(len(ratio)),
           "models": len(models), "over_provision_median": float(np.median(over))}
    if uncertain is None or predicted is None:
        return row
    pred, unc = np.asarray(predicted, float)[ok], np.asarray(uncertain, float)[ok]
    measured = ratio * pred
    z = (measured - pred) / unc
    k_covered, k_over = [], []
    for g in models:
        mine = groups == g
        k = covering_scale(z[~mine], 0.0, quantile)
        bound = pred[mine] + k * unc[mine]
        k_covered.extend(bound >= measured[mine])
        k_over.extend(bound / measured[mine] - 1)
    k_coverage, k_over_provision = float(np.mean(k_covered)), float(np.median(k_over))
    if k_coverage >= row["coverage"] and k_over_provision <= row["over_provision_median"]:
        row.update(uncertain_scale=math.ceil(covering_scale(z, 0.0, quantile) * 1e4) / 1e4,
                   uncertain_floor_bytes=int(overhead("bound_uncertain_floor_bytes")),
                   factor_coverage=row["coverage"], factor_over_provision_median=row["over_provision_median"],
                   coverage=k_coverage, over_provision_median=k_over_provision)
    return row


@dataclass
class CvResult:
    """Held-out predictions and their statistics, next to the uncalibrated ones."""

    oof: pd.DataFrame                 # out-of-fold calibrated predictions, aligned with data.frame
    raw: pd.DataFrame                 # uncalibrated predictions
    calibrated: dict = field(default_factory=dict)    # quantity -> metrics
    uncalibrated: dict = field(default_factory=dict)
    upper: dict = field(default_factory=dict)         # quantity -> upper bound row
    folds: int = 0


def leave_one_model_out(data: Dataset, fitter=fit_all) -> CvResult:
    """Fit on all models but one, predict that one, for every model."""
    frame = data.frame
    raw = predict(data, "none")
    columns = list(QUANTITIES) + [f"u_{q}" for q in BOUND_QUANTITIES]
    oof = pd.DataFrame(np.nan, index=range(len(frame)), columns=columns)
    groups = frame["group"].to_numpy() if len(frame) else np.array([])
    for g in sorted(set(groups)):
        held = groups == g
        fit: Fit = fitter(data.subset(~held).frame, data.gpu)
        cal = calibration_of(fit.factors, data.gpu, f"<cv without {g}>")
        oof.loc[held, :] = predict(data.subset(held), cal, uncertain=True).to_numpy()
    result = CvResult(oof, raw, error_table(data, oof), error_table(data, raw), folds=len(set(groups)))
    for q in QUANTITIES:
        if q in result.calibrated:
            ratio = frame[f"m_{q}"].to_numpy(float) / oof[q].to_numpy(float)
            memory = q in BOUND_QUANTITIES
            bound = upper_bound(ratio, groups, predicted=oof[q].to_numpy(float) if memory else None,
                                uncertain=oof[f"u_{q}"].to_numpy(float) if memory else None)
            if bound:
                result.upper[q] = bound
    return result


def without(fit: Fit, names, note: str = "") -> Fit:
    """`fit` less the factors `names` (and their point counts), with `note` added."""
    return Fit({k: v for k, v in fit.factors.items() if k not in names},
               {k: v for k, v in fit.points.items() if k not in names},
               list(fit.notes) + ([note] if note else []))


def fit_and_validate(data: Dataset) -> tuple[Fit, CvResult]:
    """Every factor the points support, judged by leaving one model out. Each group of time factors
    is kept only when, held out, it predicts the step time of the steps it corrects (training steps
    for the GEMM fractions, inference steps for the decode factors) better (a lower median |error|;
    a tie is no evidence that they help) than the raw formulas: a run whose steps are bound by host
    work (small models on a slow host) gives GEMM fractions that would make every GPU-bound step of
    that GPU far too slow."""
    fit = fit_all(data.frame, data.gpu)
    cv = leave_one_model_out(data)
    dropped, notes = [], []
    training = data.frame["training"].to_numpy(bool) if len(data.frame) else np.zeros(0, bool)
    for names, on_training in TIME_GROUPS:
        if not any(n in fit.factors for n in names):
            continue
        rows = training if on_training else ~training
        measured = data.frame["m_step_s"].to_numpy(float)[rows]
        held = metrics(cv.oof["step_s"].to_numpy(float)[rows], measured)
        raw = metrics(cv.raw["step_s"].to_numpy(float)[rows], measured)
        if held and raw and held["median_abs"] >= raw["median_abs"]:   # a tie is no evidence it helps
            present = [n for n in names if n in fit.factors]
            dropped += present
            kind = "training" if on_training else "inference"
            notes.append(f"time factors dropped ({', '.join(present)}): held out (leave one model out) they "
                         f"predicted {kind} step time with median |error| {held['median_abs']:.1%}, the raw "
                         f"formulas {raw['median_abs']:.1%}")
    if dropped:
        fit = without(fit, dropped, "; ".join(notes))
        cv = leave_one_model_out(data, fitter=lambda frame, gpu: without(fit_all(frame, gpu), dropped))
    return fit, cv
