"""The published calibration: memory factors fitted from what public sources measured (issue 12).

Rows: the imported measurements under calibrations/measurements/<source>/ (backend `published`,
profiler/imports.py; the folders `trace` and `published` hold other data and are not read). Each
row measured one thing (`metric`), and the fit uses exactly that:
- `allocated`, `active`, `reserved`, `device`: the relative error of that quantity;
- `capacity` ("it fit within X"): a bound from above: only a prediction of device memory above X
  is penalised;
- `oom`: a bound from below: only a prediction of device memory that fits the card is penalised.
A row's weight is the share of the setup it stated (profiler/record.py `stated`; the other
Workload fields are guessed defaults), at least MIN_WEIGHT.

The model mirrors estimator.memory.assemble, as fitting.models does for GPU tables:
    allocated = persistent + max(fwd + (a - 1) acts + (l - 1) logits, step) + c
    reserved  = allocated x (1 + f[method]) + g[method]
    device    = reserved + (everything outside the allocator, unchanged)
with a = activation_scale["*"], l = logits_scale, c = allocated_constant_bytes and one reserve
(f, g) per method with at least MIN_POINTS rows that see it. These are device-independent
(PyTorch's caching allocator and the saved tensors do not depend on the card), so one table
serves every GPU: calibrations/published.json, `gpu` "published". Context and non-PyTorch bytes
are not fitted (no source measured them apart) and stay the estimator's defaults.

Validation is leave-one-source-out: each source is predicted by the estimator itself
(estimator.api.estimate with the table fitted on the other sources), since a new user is a new
source. The safe bound (estimator/bounds.py) is point + k x the uncertain part of that prediction
(what is not an exactly counted model state); k is the 95th percentile of (measured - predicted)
/ uncertain part over the held-out rows whose source stated the batch and the sequence length
(BOUND_FIELDS: a row that left them to a guess measured a workload the estimate was not given;
its coverage is reported apart), pooled over the memory metrics (the allocated rows come
from two sources, device rows from none: a k per quantity could not be validated leave one
source out; each quantity keeps its own uncertain part). Its coverage and median over-provision
are measured one level further out (k from the other sources' held-out rows, checked on this
source's), beside the older form point x factor (the 95th percentile of measured / predicted),
measured the same way; the table keeps the form that covers at least as much with less
over-provision.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from estimator import tables
from estimator.api import estimate
from estimator.bounds import uncertain_bytes
from estimator.calibration import PUBLISHED_GPU, SCHEMA, Calibration, published_path  # noqa: F401
from estimator.defaults import overhead
from estimator.errors import InputError
from estimator.files import utc_now
from estimator.units import GiB
from fitting import calibration_table
from fitting.cv import covering_scale
from fitting.data import MEASUREMENTS_DIR, SourceFile, _features, read_rows, workload_from_row
from profiler import record

NOT_SOURCES = ("trace", "published")   # folders of calibrations/measurements/ that are not imports
MIN_POINTS = 3
MIN_WEIGHT = 0.25
PRIOR_WEIGHT = 0.05
F_SCALE = 0.05
QUANTILE = 0.95
BOUND_QUANTITIES = ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes")
# metric -> the predicted quantity it is compared with
METRIC_QUANTITY = {"allocated": "peak_allocated_bytes", "active": "peak_allocated_bytes",
                   "reserved": "peak_reserved_bytes", "device": "device_used_bytes",
                   "capacity": "device_used_bytes", "oom": "device_used_bytes"}
MEASURED_METRICS = ("allocated", "active", "reserved", "device")
# the Workload fields that change memory most; a row's weight is the share of them it stated
KEY_FIELDS = ("method", "precision", "optimizer", "batch", "seq", "grad_accum", "grad_ckpt", "attn",
              "quant", "gpus", "zero", "fsdp", "lora_rank", "lora_targets")
# the Workload fields that size the working set: a row whose source stated both measured the
# workload the estimator is given; one that left either to a guess measured another one (the
# estimate is for the guess), so its residual says how good the guess was, not how good the
# estimator is. The bound's scale is fitted and scored on the stated rows; the rest are scored apart.
BOUND_FIELDS = ("batch", "seq")
FITTER = ("fitting.published: bounded robust least squares (soft-L1, 5 % scale) on what each row measured "
          "(relative error; capacity rows bound from above, OOM rows from below), rows weighted by the share "
          "of their setup they stated; validation leave-one-source-out")


@dataclass
class Points:
    """The published rows usable for a fit, aligned: `frame` (one row per measurement) and the
    Workloads."""

    frame: pd.DataFrame
    workloads: list
    files: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)

    def subset(self, mask) -> "Points":
        mask = np.asarray(mask, dtype=bool)
        return Points(self.frame[mask].reset_index(drop=True),
                      [w for w, keep in zip(self.workloads, mask) if keep], self.files, self.skipped)


def source_folders(root: Path = MEASUREMENTS_DIR) -> list[Path]:
    """The folders of imported sources: calibrations/measurements/<source>/, not the profiler's
    own <gpu>/ folders, nor `trace` and `published`."""
    root = Path(root)
    own = set(tables.gpus()) | set(NOT_SOURCES)
    return sorted(d for d in root.iterdir() if d.is_dir() and d.name not in own
                  and any(d.glob("*.csv"))) if root.is_dir() else []


def weight_of(row, method: str) -> float:
    stated = {s.strip() for s in str(row.get("stated", "") or "").split(",") if s.strip()}
    keys = [k for k in KEY_FIELDS if not (k.startswith("lora_") and method not in ("lora", "qlora"))
            and not (k == "quant" and method != "qlora")]
    return max(MIN_WEIGHT, sum(k in stated for k in keys) / len(keys))


def input_stated(stated) -> bool:
    """Whether a row's source stated every BOUND_FIELDS field (its `stated` column)."""
    fields = {f.strip() for f in str(stated if isinstance(stated, str) else "").split(",")}
    return all(f in fields for f in BOUND_FIELDS)


def load_points(root: Path = MEASUREMENTS_DIR) -> Points:
    """Every imported row of every source folder, with the estimator's uncalibrated components."""
    files = [f for d in source_folders(root) for f in sorted(d.glob("*.csv"))]
    if not files:
        raise InputError(f"no imported measurements under {root} (scripts/profile.py import FILE)")
    rows, sources = read_rows(files)
    skipped: dict = {}
    records, workloads = [], []
    for _, row in rows.iterrows():
        if row.get("backend", "") != "published":
            skipped["not an imported row"] = skipped.get("not an imported row", 0) + 1
            continue
        metric = str(row.get("metric", ""))
        if metric not in METRIC_QUANTITY:
            skipped[f"metric {metric!r}"] = skipped.get(f"metric {metric!r}", 0) + 1
            continue
        try:
            w = workload_from_row(row)
            gpu = tables.gpu(row["gpu_slug"])
            feats = _features(w, gpu.slug, row)
        except (InputError, ValueError) as exc:
            reason = f"cannot rebuild the workload: {str(exc)[:80]}"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        quantity = METRIC_QUANTITY[metric]
        if metric in MEASURED_METRICS:
            column = record.METRICS[metric]
            value = record.measured_value(row.get(column, ""))
            if value is None:
                skipped["no value"] = skipped.get("no value", 0) + 1
                continue
        elif metric == "capacity":
            value = record.measured_value(row.get("capacity_bytes", ""))
        else:
            value = float(gpu.memory_bytes)
        feats.update(source=str(row["source"]), metric=metric, quantity=quantity, value=float(value),
                     window=_window(row),
                     gpu_slug=gpu.slug, weight=weight_of(row, w.method), locator=str(row.get("locator", "")),
                     stated=str(row.get("stated", "")))
        records.append(feats)
        workloads.append(w)
    frame = pd.DataFrame.from_records(records)
    used = frame["source_file"].value_counts().to_dict() if len(frame) else {}
    files_out = [SourceFile(f.path, f.sha256, f.rows, int(used.get(f.path, 0)), f.first, f.last) for f in sources]
    return Points(frame, workloads, files_out, skipped)


def _window(row) -> str:
    """A row's `window` (profiler/record.py): "decode", or "" for the whole run."""
    value = row.get("window", "")
    return value.strip() if isinstance(value, str) else ""


class JointProblem:
    """The memory model of the module docstring as a function of the factor vector."""

    def __init__(self, frame: pd.DataFrame):
        self.frame = frame
        train = frame["training"].to_numpy(bool)
        self.use_logits = int((train & (frame["logits"] > 0).to_numpy()).sum()) >= MIN_POINTS
        sees_reserve = frame["metric"] != "allocated"
        self.methods = sorted(m for m, n in frame.loc[sees_reserve, "method"].value_counts().items()
                              if n >= MIN_POINTS)
        self.names = ["act"] + (["logits"] if self.use_logits else []) + ["const"]
        for m in self.methods:
            self.names += [f"f:{m}", f"g:{m}"]
        self.train = train
        self.method = frame["method"].to_numpy()
        self.acts, self.logits = frame["acts"].to_numpy(float), frame["logits"].to_numpy(float)
        self.persistent, self.fwd, self.step = (frame[c].to_numpy(float) for c in ("persistent", "fwd", "step"))
        # a peak over the decode alone (window "decode") has no prefill working set in it
        self.decode = (frame["window"] == "decode").to_numpy() if "window" in frame else np.zeros(len(frame), bool)
        raw_alloc = frame["raw_peak_allocated_bytes"].to_numpy(float)
        self.raw_reserve = frame["raw_peak_reserved_bytes"].to_numpy(float) / raw_alloc - 1.0
        self.outside = (frame["raw_device_used_bytes"] - frame["raw_peak_reserved_bytes"]).to_numpy(float)
        self.metric = frame["metric"].to_numpy()
        self.value = frame["value"].to_numpy(float)
        self.weight = frame["weight"].to_numpy(float)

    def x0(self) -> np.ndarray:
        out = []
        for name in self.names:
            if name.startswith("f:"):
                out.append(float(overhead(f"reserve_fraction_{name[2:]}")))
            else:
                out.append(0.0 if name in ("const",) or name.startswith("g:") else 1.0)
        return np.array(out)

    def bounds(self):
        lo = [0.2 if n in ("act", "logits") else 0.0 for n in self.names]
        hi = [5.0 if n in ("act", "logits") else 8.0 if n == "const" else 2.0 if n.startswith("f:") else 16.0
              for n in self.names]
        return np.array(lo), np.array(hi)

    def _get(self, x, name, default):
        return x[self.names.index(name)] if name in self.names else default

    def predict(self, x) -> dict:
        a = np.where(self.train, self._get(x, "act", 1.0), 1.0)
        fwd = self.fwd + (a - 1.0) * self.acts + (self._get(x, "logits", 1.0) - 1.0) * self.logits
        fwd = np.where(self.decode, 0.0, fwd)
        alloc = self.persistent + np.maximum(fwd, self.step) + self._get(x, "const", 0.0) * GiB
        f = np.array([self._get(x, f"f:{m}", r) for m, r in zip(self.method, self.raw_reserve)])
        g = np.array([self._get(x, f"g:{m}", 0.0) for m in self.method]) * GiB
        reserved = alloc * (1.0 + f) + g
        return {"peak_allocated_bytes": alloc, "peak_reserved_bytes": reserved,
                "device_used_bytes": reserved + self.outside}

    def residuals(self, x) -> np.ndarray:
        p = self.predict(x)
        out = np.zeros(len(self.value))
        for i, metric in enumerate(self.metric):
            pred = p[METRIC_QUANTITY[metric]][i]
            v = self.value[i]
            if metric == "capacity":
                r = max(0.0, pred - v) / v
            elif metric == "oom":
                r = max(0.0, v - pred) / v
            else:
                r = (pred - v) / v
            out[i] = self.weight[i] * r
        return np.concatenate([out, PRIOR_WEIGHT * (x - self.x0())])

    def solve(self) -> np.ndarray:
        lo, hi = self.bounds()
        return least_squares(self.residuals, np.clip(self.x0(), lo, hi), bounds=(lo, hi), loss="soft_l1",
                             f_scale=F_SCALE).x


def fit_factors(frame: pd.DataFrame) -> tuple[dict, dict]:
    """(factors, factor_points) of the joint fit (estimator.calibration's factor names)."""
    problem = JointProblem(frame)
    x = problem.solve()
    r4 = lambda v: float(f"{float(v):.4g}")  # noqa: E731
    n_train = int(problem.train.sum())
    factors = {"activation_scale": {"*": r4(problem._get(x, "act", 1.0))},
               "allocated_constant_bytes": int(round(problem._get(x, "const", 0.0) * GiB))}
    points = {"activation_scale": {"*": n_train}, "allocated_constant_bytes": len(frame)}
    if problem.use_logits:
        factors["logits_scale"], points["logits_scale"] = r4(problem._get(x, "logits", 1.0)), n_train
    if problem.methods:
        factors["reserve"] = {m: {"fraction": r4(problem._get(x, f"f:{m}", 0.0)),
                                  "bytes": int(round(problem._get(x, f"g:{m}", 0.0) * GiB))} for m in problem.methods}
        counts = frame.loc[frame["metric"] != "allocated", "method"].value_counts()
        points["reserve"] = {m: int(counts[m]) for m in problem.methods}
    return factors, points


def calibration_of(factors: dict, label: str = "<published fit>") -> Calibration:
    return Calibration.from_table({"schema": SCHEMA, "gpu": PUBLISHED_GPU, "factors": factors}, label)


def predict_points(points: Points, calibration) -> tuple[np.ndarray, np.ndarray]:
    """The estimator's prediction of each row's own quantity (estimator.api.estimate) and the
    uncertain part of that prediction (estimator.bounds.uncertain_bytes); a row whose peak covers the
    decode alone (window "decode") is predicted by the decode's own peak."""
    pred, uncertain = [], []
    for w, (_, row) in zip(points.workloads, points.frame.iterrows()):
        m = estimate(w, row["gpu_slug"], calibration).memory
        if row.get("window") == "decode":
            point = m.decode_peak_allocated_bytes
            pred.append(float(point))
            uncertain.append(float(uncertain_bytes(m)[row["quantity"]] - m.peak_allocated_bytes + point))
            continue
        pred.append(float(getattr(m, row["quantity"])))
        uncertain.append(float(uncertain_bytes(m)[row["quantity"]]))
    return np.array(pred), np.array(uncertain)


def _stats(pred, meas) -> dict | None:
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    if not len(pred):
        return None
    err = (pred - meas) / meas
    return {"median_abs": float(np.median(np.abs(err))), "p90_abs": float(np.quantile(np.abs(err), 0.9)),
            "under_rate": float(np.mean(err < 0)), "signed_median": float(np.median(err)), "points": int(len(err))}


def _factor(ratios) -> float:
    return covering_scale(ratios, 1.0, QUANTILE)


def _scale(z) -> float:
    return covering_scale(z, 0.0, QUANTILE)


def _cover(bound, value) -> tuple[float, float]:
    """(coverage, median over-provision) of `bound` against measured `value`."""
    bound, value = np.asarray(bound, float), np.asarray(value, float)
    return float(np.mean(bound >= value)), float(np.median((bound - value) / value))


@dataclass
class Validation:
    """Leave-one-source-out results: held-out and uncalibrated predictions per row, the pooled
    bound factor, its nested coverage and over-provision."""

    frame: pd.DataFrame       # points.frame + pred_cv, pred_raw, bound_cv (nested)
    by_quantity: dict
    by_quantity_raw: dict
    by_gpu: dict
    by_source: dict
    by_regime: dict           # regime -> (calibrated, uncalibrated) stats
    factor: float             # point x factor (the older form), pooled over every source
    coverage: float           # of the form kept (`form`), nested
    over_provision: float
    raw_coverage: float       # the uncalibrated default bound (point + k0 x uncertain part)
    raw_over_provision: float
    oom_rows: int
    oom_flagged: int          # OOM rows whose held-out bound of device memory exceeds the card
    sources: int
    scale: float = 0.0        # k of point + k x uncertain part, pooled over every source
    form: str = "uncertain"   # "uncertain" or "factor": the form the table keeps
    factor_coverage: float = 0.0
    factor_over_provision: float = 0.0
    uncertain_coverage: float = 0.0
    uncertain_over_provision: float = 0.0
    raw_factor_coverage: float = 0.0      # the former uncalibrated default, point x 1.3
    raw_factor_over_provision: float = 0.0
    oom_point_over: int = 0   # OOM rows whose held-out point already exceeds the card ("does not fit")
    by_quantity_bound: dict = field(default_factory=dict)   # quantity -> coverage, over-provision, points
    # coverage and over-provision are on the rows whose batch and seq were stated (BOUND_FIELDS);
    # these are the same bound on every measured row, guessed inputs included
    stated_points: int = 0
    all_points: int = 0
    by_quantity_stated: dict = field(default_factory=dict)   # by_quantity on the stated rows only
    coverage_all: float = 0.0
    over_provision_all: float = 0.0


def validate_loso(points: Points) -> Validation:
    frame = points.frame.copy()
    sources = sorted(set(frame["source"]))
    if len(sources) < 2:
        raise InputError("leave-one-source-out needs measurements from at least 2 sources")
    frame["pred_cv"] = np.nan
    frame["unc_cv"] = np.nan
    for s in sources:
        held = (frame["source"] == s).to_numpy()
        factors, _ = fit_factors(frame[~held].reset_index(drop=True))
        pred, unc = predict_points(points.subset(held), calibration_of(factors, f"<without {s}>"))
        frame.loc[held, "pred_cv"], frame.loc[held, "unc_cv"] = pred, unc
    frame["pred_raw"], frame["unc_raw"] = predict_points(points, "none")
    measured = frame["metric"].isin(MEASURED_METRICS)
    stated = measured & frame["stated"].map(input_stated).astype(bool)
    if not stated.any():
        raise InputError(f"no measured row states {' and '.join(BOUND_FIELDS)}: the bound cannot be fitted")
    ratio = frame["value"] / frame["pred_cv"]
    z = (frame["value"] - frame["pred_cv"]) / frame["unc_cv"]
    # nested: each source's bound comes from the other sources' held-out stated rows, in both forms
    frame["bound_factor_cv"] = np.nan
    frame["bound_uncertain_cv"] = np.nan
    for s in sources:
        mine = frame["source"] == s
        others = stated & ~mine
        if others.any():
            frame.loc[mine, "bound_factor_cv"] = frame.loc[mine, "pred_cv"] * _factor(ratio[others])
            frame.loc[mine, "bound_uncertain_cv"] = (frame.loc[mine, "pred_cv"]
                                                     + _scale(z[others]) * frame.loc[mine, "unc_cv"])
    ms = frame[stated]
    f_cov, f_over = _cover(ms["bound_factor_cv"], ms["value"])
    u_cov, u_over = _cover(ms["bound_uncertain_cv"], ms["value"])
    # keep the form that is honest: it covers at least as much, with less over-provision
    form = "uncertain" if (u_cov >= f_cov and u_over <= f_over) else "factor"
    frame["bound_cv"] = frame[f"bound_{form}_cv"]
    m, ms = frame[measured], frame[stated]
    covered = (ms["bound_cv"] >= ms["value"]).to_numpy()
    over = ((ms["bound_cv"] - ms["value"]) / ms["value"]).to_numpy()
    cov_all, over_all = _cover(m["bound_cv"], m["value"])
    raw_bound = ms["pred_raw"] + float(overhead("uncalibrated_bound_uncertain_scale")) * ms["unc_raw"]
    raw_factor_bound = ms["pred_raw"] * float(overhead("uncalibrated_bound_factor"))
    by_q_bound = {}
    for q in BOUND_QUANTITIES:
        sub = ms[ms["quantity"] == q]
        if len(sub):
            cov, ovr = _cover(sub["bound_cv"], sub["value"])
            by_q_bound[q] = {"coverage": cov, "over_provision_median": ovr, "points": float(len(sub))}
    by_q = {q: s for q in BOUND_QUANTITIES if (s := _stats(m.loc[m["quantity"] == q, "pred_cv"],
                                                            m.loc[m["quantity"] == q, "value"]))}
    by_q_raw = {q: s for q in BOUND_QUANTITIES if (s := _stats(m.loc[m["quantity"] == q, "pred_raw"],
                                                                m.loc[m["quantity"] == q, "value"]))}
    for q, s in by_q.items():
        sub = m[m["quantity"] == q]
        s["models"], s["sources"] = int(sub["group"].nunique()), int(sub["source"].nunique())
    by_q_stated = {q: s for q in BOUND_QUANTITIES if (s := _stats(ms.loc[ms["quantity"] == q, "pred_cv"],
                                                                   ms.loc[ms["quantity"] == q, "value"]))}
    by_gpu = {g: _stats(sub["pred_cv"], sub["value"]) for g, sub in m.groupby("gpu_slug")}
    by_source = {s: _stats(sub["pred_cv"], sub["value"]) for s, sub in m.groupby("source")}
    regimes = pd.Series([regime_label(w) for w in points.workloads], index=frame.index)[m.index]
    by_regime = {r: (_stats(sub["pred_cv"], sub["value"]), _stats(sub["pred_raw"], sub["value"]))
                 for r, sub in m.groupby(regimes)}
    oom = frame[frame["metric"] == "oom"]
    gpu_bytes = oom["value"]
    raw_cov, raw_over = _cover(raw_bound, ms["value"])
    raw_f_cov, raw_f_over = _cover(raw_factor_bound, ms["value"])
    return Validation(frame, by_q, by_q_raw, by_gpu, by_source, by_regime, _factor(ratio[stated]),
                      float(np.mean(covered)), float(np.median(over)), raw_cov, raw_over,
                      int(len(oom)), int((oom["bound_cv"] > gpu_bytes).sum()), len(sources),
                      scale=_scale(z[stated]), form=form, factor_coverage=f_cov, factor_over_provision=f_over,
                      uncertain_coverage=u_cov, uncertain_over_provision=u_over,
                      raw_factor_coverage=raw_f_cov, raw_factor_over_provision=raw_f_over,
                      oom_point_over=int((oom["pred_cv"] > gpu_bytes).sum()), by_quantity_bound=by_q_bound,
                      stated_points=int(len(ms)), all_points=int(len(m)), coverage_all=cov_all,
                      over_provision_all=over_all, by_quantity_stated=by_q_stated)


def regime_label(w) -> str:
    """The stack a row ran: method, parallelism and, for QLoRA, whether peft's kbit preparation ran
    (estimator.regimes decides it as the estimate does)."""
    from estimator.regimes import kbit_preparation_runs
    if w.fsdp != "none":
        stack = f"FSDP {w.fsdp}"
    elif w.zero:
        stack = f"ZeRO-{w.zero}"
    else:
        stack = "DDP" if w.world_size > 1 else "1 GPU"
    label = f"{w.method} {stack}"
    if w.method == "qlora":
        label += f" kbit-prep {'on' if kbit_preparation_runs(w) else 'off'}"
    return label


def _counts(values) -> dict:
    out: dict = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def build_table(points: Points, factors: dict, factor_points: dict, v: Validation,
                created: str | None = None) -> dict:
    frame = points.frame
    sources = []
    for s, sub in frame.groupby("source"):
        sources.append({"source": s, "rows": int(len(sub)), "metrics": _counts(sub["metric"]),
                        "gpus": sorted(set(sub["gpu_slug"])), "locators": sorted(set(sub["locator"]))})
    cv_error = {q: {**s, "uncalibrated": {k: v.by_quantity_raw[q][k] for k in ("median_abs", "p90_abs", "under_rate")}}
                for q, s in v.by_quantity.items()}
    n_measured = int(frame["metric"].isin(MEASURED_METRICS).sum())
    upper = {}
    for q in BOUND_QUANTITIES:
        row = {"factor": math.ceil(v.factor * 1e4) / 1e4, "quantile": QUANTILE, "coverage": v.coverage,
               "points": v.stated_points, "models": int(frame["group"].nunique()), "sources": v.sources,
               "factor_coverage": v.factor_coverage, "over_provision_median": v.over_provision,
               "factor_over_provision_median": v.factor_over_provision}
        if v.form == "uncertain":   # rounded up: never below what was measured
            row.update(uncertain_scale=math.ceil(v.scale * 1e4) / 1e4,
                       uncertain_floor_bytes=int(overhead("bound_uncertain_floor_bytes")))
        upper[q] = row
    rng = calibration_table.range_of(frame)
    rng["gpus"] = _counts(frame["gpu_slug"])
    notes = [f"{n} rows left out: {reason}" for reason, n in sorted(points.skipped.items())]
    notes.append(f"the bound's scale is fitted on the held-out rows whose source stated {' and '.join(BOUND_FIELDS)} "
                 "(a row with a guessed one measured another workload than the one estimated); "
                 "its coverage is scored on them, and apart on every row")
    notes.append("one bound scale k for the three memory quantities, each applied to its own uncertain part "
                 "(estimator/bounds.py): the held-out rows measured peak reserved and allocated only, the allocated "
                 "ones from two sources (pooled over every metric)")
    notes.append("device-independent factors only (allocator reserve, saved activations, logits, a constant): "
                 "CUDA context and non-PyTorch bytes stay the estimator's defaults")
    table = {
        "schema": SCHEMA, "gpu": PUBLISHED_GPU, "created": created or utc_now(), "fitter": FITTER,
        "versions": {lib: list(c) for lib, c in calibration_table.versions_of(frame).items()},
        "provenance": {"runs": [f.to_dict() for f in points.files], "points": int(len(frame)),
                       "points_by_quantity": _counts(frame["metric"]), "models": int(frame["group"].nunique()),
                       "versions": calibration_table.versions_of(frame), "sources": sources},
        "range": rng, "factors": factors, "factor_points": factor_points, "cv_error": cv_error,
        "upper_bound": upper,
        "validation": {"method": "leave-one-source-out", "sources": v.sources, "points": n_measured,
                       "coverage": v.coverage, "over_provision_median": v.over_provision,
                       "bound_rows": f"the {v.stated_points} measured rows whose source stated "
                                     f"{' and '.join(BOUND_FIELDS)} (fitted and scored on); on all "
                                     f"{v.all_points}, guessed inputs included: coverage {v.coverage_all:.4f}, "
                                     f"median over-provision {v.over_provision_all:.4f}",
                       "coverage_all_rows": v.coverage_all, "over_provision_median_all_rows": v.over_provision_all,
                       "uncalibrated_coverage": v.raw_coverage,
                       "uncalibrated_over_provision_median": v.raw_over_provision,
                       "oom_rows": v.oom_rows, "oom_flagged": v.oom_flagged,
                       "bound_form": v.form, "factor_coverage": v.factor_coverage,
                       "factor_over_provision_median": v.factor_over_provision,
                       "uncalibrated_factor_coverage": v.raw_factor_coverage,
                       "uncalibrated_factor_over_provision_median": v.raw_factor_over_provision,
                       "by_quantity_bound": v.by_quantity_bound,
                       "by_gpu": {g: s for g, s in v.by_gpu.items() if s},
                       "by_source": {s: x for s, x in v.by_source.items() if x}},
        "notes": notes,
    }
    return json.loads(json.dumps(table, default=calibration_table._plain))


def fit_published(root: Path = MEASUREMENTS_DIR, created: str | None = None) -> tuple[dict, Validation, Points]:
    """Load, fit on every source, validate leave-one-source-out; the table dict (validated)."""
    points = load_points(root)
    if points.frame.empty:
        raise InputError(f"no usable imported rows under {root}")
    factors, factor_points = fit_factors(points.frame)
    v = validate_loso(points)
    table = build_table(points, factors, factor_points, v, created)
    return calibration_table.validate(table), v, points


def parity_plot(v: Validation, path: Path) -> Path:
    """Predicted (held out, and uncalibrated) against published measured, one marker per source;
    each row's held-out safe bound. Written atomically as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from estimator.files import atomic_write_bytes
    import io

    m = v.frame[v.frame["metric"].isin(MEASURED_METRICS)]
    fig, ax = plt.subplots(figsize=(6.4, 6.0), dpi=100)
    markers = "osD^vP*X"
    for i, (source, sub) in enumerate(m.groupby("source")):
        ax.scatter(sub["value"] / GiB, sub["pred_cv"] / GiB, marker=markers[i % len(markers)], s=36,
                   label=f"{source} (held out)", alpha=0.8)
    ax.scatter(m["value"] / GiB, m["pred_raw"] / GiB, marker=".", color="grey", s=14, label="uncalibrated", alpha=0.6)
    top = float(max(m["value"].max(), m["pred_cv"].max(), m["pred_raw"].max()) / GiB) * 1.05
    ax.plot([0, top], [0, top], color="black", lw=1, label="predicted = measured")
    ax.scatter(m["value"] / GiB, m["bound_cv"] / GiB, marker="_", color="black", s=30, alpha=0.7,
               label="safe bound (held out); below the diagonal: not covered")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("published measured memory (GiB)")
    ax.set_ylabel("predicted memory (GiB)")
    ax.set_title(f"Leave-one-source-out: {len(m)} published measurements, {v.sources} sources")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_bytes(path, buf.getvalue())
