"""The factor models: small, bounded, robust fits whose every factor has a meaning.

Each model mirrors how estimator.memory.assemble (through estimator.calibration.apply_memory) and
estimator.api apply the factor, so a fitted factor means exactly what the estimator does with it.

1. Peak allocated [B] (`_fit_allocated`), one robust least-squares fit over all points:
     persistent + max(fwd + (s-1) acts + (l-1) logits, step + (t-1) temps) + c
   persistent, fwd and step are estimator.memory.working_sets of the point's components (training:
   forward/backward and optimizer step; inference: prefill and a dequantized weight, logits and
   temps 0); s = `activation_scale["model_type|attn"]` (inference: `inference_activation_scale`),
   l = `logits_scale`, t = `optimizer_temporaries_scale`, c = `allocated_constant_bytes`.
   Residuals are relative ((pred - measured) / measured) under a soft-L1 loss (scale 2 %), so a
   few wrong points pull little; bounds keep every factor physical (scales in [0.2, 5], c >= 0);
   a weak pull towards the formula (scale 1, c 0) settles directions the data cannot tell apart.
   A factor is kept only when at least MIN_POINTS measurements bind it (the phase it acts in is
   the peak). Family entries ("llama") and "*" are medians of the fitted "family|attn" entries.
2. Peak reserved [B] (`_fit_reserve`): reserved = allocated x (1 + f) + g per method, and "*"
   over all methods, fitted on measured allocated and reserved (f in [0, 2], g in [0, 16 GiB]).
3. Device used [B] (`_fit_device`): `cuda_context_bytes` = median measured context;
   `non_pytorch_bytes` = median of device_used - reserved - context - paged states on one GPU;
   `nccl_buffers_bytes` = the same residual's median on multi-GPU runs, less non_pytorch. Both
   from one kind of device_used reading only (`device_used_source`: nvml-process if it has
   enough points, else nvml-device-delta, else rows without a source; the other kinds' medians
   go to the notes); legacy nvml-device rows (whole-device memory) are never used.
4. Step time [s] (`_fit_time`): per point the achieved GEMM fraction (HFU) that inverts
   estimator.compute_time: work / (peak x (step_s - exposed communication - optimizer step -
   gradient clipping (measured where the row timed them; the profiler's loop runs no other host
   work) - the compute parts that do not scale with HFU: attention, elementwise, adapters,
   dequantization, GEMM bytes)) (`hfu_terms`); `mfu["method|size"]` and `mfu["method"]` are medians;
   inference: the same on the prefill ("inference-prefill") and
   `decode_bandwidth_fraction` = bytes read per token / (peak bandwidth x (s per token / bitsandbytes
   slowdown - TP time - eager attention)), on the steps above the launch floor only;
   `decode_host_s_per_layer` = the median of s per token / layers over the eager steps that took
   HOST_BOUND times their GPU work or more (bound by the host, which the bandwidth fit leaves out);
   `training_host_s_per_op` = the median of compute / operators (estimator.ops) over the training
   steps whose compute is within LAUNCH_MARGIN of the default launch floor (bound by the host's
   dispatch; the HFU fit leaves them out).
5. Communication (`_fit_comm`): on the accumulating DDP/FSDP runs that timed the reducing
   micro-batch apart, the measured exposed reduction is sync_microbatch_s - nosync_microbatch_s;
   the estimator's (estimator.timing Comm.last_reduction_exposed_s) with a fraction f of the links'
   bandwidth is max(0, keep x R(f) - backward_share x nosync_microbatch_s) + (1 - keep) x R(f),
   R(f) = reduce_bw_s / f + reduce_lat_s; per point the f that equals them (bisection: the
   exposure falls as f grows; clipped to [COMM_FRACTION_MIN, 1]), `comm_bandwidth_fraction` their
   median. The step-time fit (4.) then takes the measured exposure where the reduction is all
   the step's traffic (DDP).
6. Host work between steps (`_fit_overhead`): `step_overhead_s` = the median of the gaps real jobs
   measured between one step's end and the next one's begin (the Trainer callback's `overhead_s`:
   data loading, logging); the profiler's own loop has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from estimator.calibration import COMM_FRACTION_MIN, TRACE_GPU, size_bucket
from estimator.defaults import overhead, time_constant
from estimator.tables import GEMM_LEVEL_MAX

MIN_POINTS = 3          # a factor needs at least this many measurements that bind it
LAUNCH_MARGIN = 1.1     # a training step whose compute is within this factor of its launch floor is launch-bound
PRIOR_WEIGHT = 0.05     # pull towards the formula, in relative-error units per unit of factor
F_SCALE = 0.02          # soft-L1 scale: residuals beyond ~2 % count linearly, not squared
from estimator.units import GiB
SCALE_BOUNDS = (0.2, 5.0)
TEMPS_BOUNDS = (0.0, 5.0)
CONST_BOUNDS_GIB = (0.0, 64.0)
RESERVE_BYTES_BOUNDS_GIB = (0.0, 16.0)
METHODS = ("full", "lora", "qlora", "inference")


@dataclass
class Fit:
    """The table's `factors`, how many points each rests on, and notes for the reader."""

    factors: dict = field(default_factory=dict)
    points: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def _r(x: float, digits: int = 4) -> float:
    return float(f"{float(x):.{digits}g}")


def _median_map(entries: dict) -> dict:
    """Add family ("llama") and global ("*") entries: medians of the "family|attn" entries."""
    out = dict(entries)
    families: dict = {}
    for key, value in entries.items():
        families.setdefault(key.split("|")[0], []).append(value)
    for family, values in families.items():
        out.setdefault(family, _r(np.median(values)))
    if entries:
        out["*"] = _r(np.median(list(entries.values())))
    return out


class AllocatedProblem:
    """Peak allocated as a function of the factor vector (see the module docstring, model 1)."""

    def __init__(self, frame: pd.DataFrame, with_constant: bool):
        rows = frame[frame["m_peak_allocated_bytes"].notna()]
        keys = rows["family"] + "|" + rows["attn"]
        train = rows["training"].to_numpy(bool)
        counts_t = keys[train & (rows["acts"] > 0).to_numpy()].value_counts()
        counts_i = keys[~train & (rows["acts"] > 0).to_numpy()].value_counts()
        self.act_keys = sorted(k for k, n in counts_t.items() if n >= MIN_POINTS)
        self.inf_keys = sorted(k for k, n in counts_i.items() if n >= MIN_POINTS)
        # rows whose activation factor cannot be fitted would be modelled with the wrong scale
        fitted = np.where(train, keys.isin(self.act_keys), keys.isin(self.inf_keys)) | (rows["acts"] <= 0).to_numpy()
        rows, keys, train = rows[fitted], keys[fitted], train[fitted]
        self.rows = rows
        self.n = len(rows)
        self.train = train
        self.use_logits = int((train & (rows["logits"] > 0).to_numpy()).sum()) >= MIN_POINTS
        self.use_temps = int((train & (rows["temps"] > 0).to_numpy()).sum()) >= MIN_POINTS
        self.use_const = with_constant and self.n >= 2 * MIN_POINTS
        self.names = ([("act", k) for k in self.act_keys] + [("inf", k) for k in self.inf_keys]
                      + ([("logits", "")] if self.use_logits else []) + ([("temps", "")] if self.use_temps else [])
                      + ([("const", "")] if self.use_const else []))
        index = {name: i for i, name in enumerate(self.names)}
        self.act_index = np.array([index.get(("act" if t else "inf", k), -1) for t, k in zip(train, keys)])
        self.meas = rows["m_peak_allocated_bytes"].to_numpy(float)
        self.acts, self.logits, self.temps = (rows[c].to_numpy(float) for c in ("acts", "logits", "temps"))
        # persistent states and the two working sets, from estimator.memory.working_sets (fitting.data)
        self.persistent = rows["persistent"].to_numpy(float)
        self.fwd, self.step = rows["fwd"].to_numpy(float), rows["step"].to_numpy(float)

    def x0(self) -> np.ndarray:
        return np.array([0.0 if kind == "const" else 1.0 for kind, _ in self.names])

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = [], []
        for kind, _ in self.names:
            b = CONST_BOUNDS_GIB if kind == "const" else TEMPS_BOUNDS if kind == "temps" else SCALE_BOUNDS
            lo.append(b[0])
            hi.append(b[1])
        return np.array(lo), np.array(hi)

    def _get(self, x: np.ndarray, kind: str, default: float) -> float:
        return x[self.names.index((kind, ""))] if (kind, "") in self.names else default

    def phases(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The two working sets with the factors applied (bytes): each scale multiplies its
        component inside the working set that holds it, as estimator.memory.working_sets does
        (training: forward/backward and optimizer step; inference: prefill and a dequantized
        weight, where logits and temporaries are 0). Also the activation scale of each row."""
        s = np.where(self.act_index >= 0, x[np.maximum(self.act_index, 0)] if len(x) else 1.0, 1.0)
        fwd = self.fwd + (s - 1.0) * self.acts + (self._get(x, "logits", 1.0) - 1.0) * self.logits
        step = self.step + (self._get(x, "temps", 1.0) - 1.0) * self.temps
        return fwd, step, s

    def predict(self, x: np.ndarray) -> np.ndarray:
        fwd, step, _ = self.phases(x)
        return self.persistent + np.maximum(fwd, step) + self._get(x, "const", 0.0) * GiB

    def residuals(self, x: np.ndarray) -> np.ndarray:
        rel = (self.predict(x) - self.meas) / self.meas
        return np.concatenate([rel, PRIOR_WEIGHT * (x - self.x0())])

    def binding(self, x: np.ndarray) -> dict:
        """How many points each factor acts on at the peak."""
        fwd, step, _ = self.phases(x)
        fwd_peak = fwd >= step
        out = {}
        for i, (kind, key) in enumerate(self.names):
            if kind in ("act", "inf"):
                out[(kind, key)] = int(((self.act_index == i) & fwd_peak & (self.acts > 0)).sum())
            elif kind == "logits":
                out[(kind, key)] = int((self.train & fwd_peak & (self.logits > 0)).sum())
            elif kind == "temps":
                out[(kind, key)] = int((self.train & ~fwd_peak & (self.temps > 0)).sum())
            else:
                out[(kind, key)] = self.n
        return out

    def solve(self) -> np.ndarray:
        if not self.names:
            return np.zeros(0)
        lo, hi = self.bounds()
        result = least_squares(self.residuals, np.clip(self.x0(), lo, hi), bounds=(lo, hi),
                               loss="soft_l1", f_scale=F_SCALE, x_scale=1.0)
        return result.x


def _fit_allocated(frame: pd.DataFrame, fit: Fit, with_constant: bool) -> None:
    problem = AllocatedProblem(frame, with_constant)
    if problem.n < MIN_POINTS or not problem.names:
        return
    x = problem.solve()
    binding = problem.binding(x)
    acts, infs = {}, {}
    for i, (kind, key) in enumerate(problem.names):
        n = binding[(kind, key)]
        if n < MIN_POINTS:
            fit.notes.append(f"{kind} {key or ''} left at its default: only {n} points bind it".replace("  ", " "))
            continue
        if kind == "act":
            acts[key] = _r(x[i])
            fit.points.setdefault("activation_scale", {})[key] = n
        elif kind == "inf":
            infs[key] = _r(x[i])
            fit.points.setdefault("inference_activation_scale", {})[key] = n
        elif kind == "logits":
            fit.factors["logits_scale"], fit.points["logits_scale"] = _r(x[i]), n
        elif kind == "temps":
            fit.factors["optimizer_temporaries_scale"], fit.points["optimizer_temporaries_scale"] = _r(x[i]), n
        else:
            fit.factors["allocated_constant_bytes"] = int(round(x[i] * GiB))
            fit.points["allocated_constant_bytes"] = n
    if acts:
        fit.factors["activation_scale"] = _median_map(acts)
    if infs:
        fit.factors["inference_activation_scale"] = _median_map(infs)


def _fit_reserve_rows(alloc: np.ndarray, reserved: np.ndarray, f0: float) -> tuple[float, float]:
    """(fraction, bytes) of reserved = alloc x (1 + fraction) + bytes, robust relative fit."""
    def residuals(x):
        pred = alloc * (1.0 + x[0]) + x[1] * GiB
        return np.concatenate([(pred - reserved) / reserved, PRIOR_WEIGHT * np.array([x[0] - f0, x[1]])])

    lo = np.array([0.0, RESERVE_BYTES_BOUNDS_GIB[0]])
    hi = np.array([2.0, RESERVE_BYTES_BOUNDS_GIB[1]])
    x = least_squares(residuals, np.clip([f0, 0.0], lo, hi), bounds=(lo, hi), loss="soft_l1",
                      f_scale=F_SCALE / 2).x
    return float(x[0]), float(x[1])


def _fit_reserve(frame: pd.DataFrame, fit: Fit) -> None:
    rows = frame[frame["m_peak_reserved_bytes"].notna() & frame["m_peak_allocated_bytes"].notna()]
    if len(rows) < MIN_POINTS:
        return
    table, points = {}, {}
    groups = [(m, rows[rows["method"] == m]) for m in METHODS] + [("*", rows)]
    for method, sub in groups:
        if len(sub) < MIN_POINTS:
            continue
        f0 = float(overhead(f"reserve_fraction_{method if method != '*' else 'full'}"))
        f, g = _fit_reserve_rows(sub["m_peak_allocated_bytes"].to_numpy(float),
                                 sub["m_peak_reserved_bytes"].to_numpy(float), f0)
        table[method] = {"fraction": _r(f), "bytes": int(round(g * GiB))}
        points[method] = len(sub)
    fit.factors["reserve"], fit.points["reserve"] = table, points


def _fit_device(frame: pd.DataFrame, fit: Fit) -> None:
    ctx = frame["m_context_bytes"].dropna()
    context = None
    if len(ctx) >= MIN_POINTS:
        context = int(round(float(np.median(ctx))))
        fit.factors["cuda_context_bytes"], fit.points["cuda_context_bytes"] = context, len(ctx)
        by = frame.loc[ctx.index].groupby(["driver", "cuda"])["m_context_bytes"].median() \
            if {"driver", "cuda"} <= set(frame.columns) else pd.Series(dtype=float)
        if len(by) > 1:  # the context depends on driver and CUDA: say so, the reader decides
            parts = [f"driver {d or '?'} / CUDA {c or '?'}: {v / 2**20:.0f} MiB" for (d, c), v in by.items()]
            fit.notes.append("cuda_context_bytes (median over all) differs by versions: " + "; ".join(parts))
    rows = frame[frame["m_device_used_bytes"].notna() & frame["m_peak_reserved_bytes"].notna()]
    row_ctx = rows["m_context_bytes"].fillna(np.nan if context is None else float(context))
    rows = rows[row_ctx.notna()]
    row_ctx = row_ctx[row_ctx.notna()]
    outside = rows["m_device_used_bytes"] - rows["m_peak_reserved_bytes"] - row_ctx - rows["paged"]
    kinds = _used_kinds(rows)
    kind = next((k for k in USED_KINDS if int(((kinds == k) & (rows["world_size"] <= 1)).sum()) >= MIN_POINTS), None)
    legacy = int((kinds == LEGACY_DEVICE_KIND).sum())
    if legacy:
        fit.notes.append(f"device_used: {legacy} row(s) of whole-device memory (nvml-device: driver reserve and "
                         "other processes included) left out of non_pytorch_bytes and nccl_buffers_bytes")
    if kind is None:
        return
    for other_kind in USED_KINDS:  # fitted separately; the table keeps one, the others are told
        sub = outside[(kinds == other_kind) & (rows["world_size"] <= 1)]
        if other_kind != kind and len(sub) >= MIN_POINTS:
            fit.notes.append(f"non_pytorch_bytes from {other_kind or 'rows without a source'} rows alone: "
                             f"{np.median(sub) / 2**20:.0f} MiB ({len(sub)} points; the table uses "
                             f"{kind or 'rows without a source'})")
    outside, rows = outside[kinds == kind], rows[kinds == kind]
    single = rows["world_size"] <= 1
    other = int(round(float(np.median(outside[single]))))
    fit.factors["non_pytorch_bytes"], fit.points["non_pytorch_bytes"] = other, int(single.sum())
    if int((~single).sum()) >= MIN_POINTS:
        nccl = max(0, int(round(float(np.median(outside[~single]))) - other))
        fit.factors["nccl_buffers_bytes"], fit.points["nccl_buffers_bytes"] = nccl, int((~single).sum())


# device_used_source kinds whose device_used_bytes is this process's memory, in order of trust
# (profiler.device.nvml); "" = a row without a source. Each is fitted on its own, never mixed.
USED_KINDS = ("nvml-process", "nvml-device-delta", "")
LEGACY_DEVICE_KIND = "nvml-device"  # whole-device memory: another quantity, never fitted


def _used_kinds(rows: pd.DataFrame) -> pd.Series:
    """Each row's device_used_source ("" when the frame has none)."""
    if "device_used_source" not in rows.columns:
        return pd.Series("", index=rows.index)
    return rows["device_used_source"].fillna("").astype(str).str.strip().replace({"nan": "", "None": ""})


def _median_by(values: pd.Series, keys: pd.Series, low: float, high: float) -> tuple[dict, dict]:
    out, points = {}, {}
    for key, grp in values.groupby(keys):
        if len(grp) >= MIN_POINTS:
            out[key] = _r(min(high, max(low, float(np.median(grp)))))
            points[key] = len(grp)
    return out, points


HOST_BOUND = 1.5   # a decode step this many times its GPU work (default fraction) is bound by the host


def _reduction_exposed(rows: pd.DataFrame, fraction) -> pd.Series:
    """The estimator's exposed reduction of each row's reducing micro-batch at link fraction
    `fraction` (estimator.timing Comm.last_reduction_exposed_s, the window from the measured
    no_sync micro-batch)."""
    r = rows["reduce_bw_s"] / fraction + rows["reduce_lat_s"]
    window = rows["backward_share"] * rows["m_nosync_microbatch_s"]
    return (rows["reduce_keep"] * r - window).clip(lower=0.0) + (1.0 - rows["reduce_keep"]) * r


def _measured_reductions(frame: pd.DataFrame) -> pd.DataFrame:
    if "m_sync_microbatch_s" not in frame:
        return frame.iloc[0:0]
    rows = frame[frame["training"] & frame["m_sync_microbatch_s"].notna() & frame["m_nosync_microbatch_s"].notna()
                 & (frame["reduce_bw_s"] > 0)]
    return rows.assign(m_exposed_s=(rows["m_sync_microbatch_s"] - rows["m_nosync_microbatch_s"]).clip(lower=0.0))


def _fit_comm(frame: pd.DataFrame, fit: Fit) -> None:
    rows = _measured_reductions(frame)
    if len(rows) < MIN_POINTS:
        return
    lo = pd.Series(COMM_FRACTION_MIN, index=rows.index)
    hi = pd.Series(1.0, index=rows.index)
    for _ in range(60):   # bisection on each row at once: exposure falls as the fraction grows
        mid = (lo + hi) / 2
        slower = _reduction_exposed(rows, mid) < rows["m_exposed_s"]   # measured more: a lower fraction
        hi, lo = hi.where(~slower, mid), lo.where(slower, mid)
    fit.factors["comm_bandwidth_fraction"] = _r(float(np.median((lo + hi) / 2)))
    fit.points["comm_bandwidth_fraction"] = int(len(rows))


def _fit_overhead(frame: pd.DataFrame, fit: Fit) -> None:
    """`step_overhead_s`: the median of the host's time between steps that real jobs measured
    (the Trainer callback's `overhead_s`); the profiler's own loop has none and measures none."""
    if "m_overhead_s" not in frame:
        return
    gaps = frame.loc[frame["training"] & frame["m_overhead_s"].notna(), "m_overhead_s"]
    if len(gaps) >= MIN_POINTS:
        fit.factors["step_overhead_s"] = _r(float(np.median(gaps)))
        fit.points["step_overhead_s"] = int(len(gaps))


def _fit_time(frame: pd.DataFrame, fit: Fit) -> None:
    mfu, points = {}, {}
    train = frame[frame["training"] & frame["m_step_s"].notna()]
    exposed = train["exposed_comm_s"]
    measured = _measured_reductions(train)
    measured = measured[measured["gathers_s"] <= 0]   # DDP: the reduction is all its traffic
    if len(measured):   # a measured exposed reduction replaces the default's
        exposed = exposed.copy()
        exposed.loc[measured.index] = measured["m_exposed_s"]
    # the measured step is the profiler's loop (profiler.steps.loop_step_s): no host work between
    # steps, the optimizer step and the clipping as the row timed them (else as predicted; no
    # clipping where the row's loop ran none)
    optimizer = train["m_optimizer_s"].fillna(train["optimizer_s"]) if "m_optimizer_s" in train else train["optimizer_s"]
    predicted_clip = train["clip_s"].where(train["clipped"].astype(bool), 0.0)
    clip = train["m_clip_s"].fillna(predicted_clip) if "m_clip_s" in train else predicted_clip
    compute = train["m_step_s"] - exposed - optimizer - clip
    # a step whose compute is no longer than its operators take the host to dispatch at the default
    # rate (within LAUNCH_MARGIN) is bound by that dispatch (estimator.timing's launch floor): it
    # sets the host's seconds per operator and says nothing of the GEMMs' fraction. (The default
    # rate itself was read off rows selected by their roofline instead, scripts/bench_time.py
    # `launch_evidence`: a rule on the floor cannot select the rows the floor's rate comes from.)
    floor = train["launch_ops"] * float(time_constant("training_host_s_per_op"))
    launch = (compute <= LAUNCH_MARGIN * floor) & (train["launch_ops"] > 0) & (compute > 0)
    if launch.sum() >= MIN_POINTS:
        per_op = compute[launch] / train.loc[launch, "launch_ops"]
        fit.factors["training_host_s_per_op"] = _r(float(np.median(per_op)))
        fit.points["training_host_s_per_op"] = int(launch.sum())
    train, compute = train[~launch], compute[~launch]
    busy = compute - train["compute_fixed_s"]
    train, busy = train[busy > 0], busy[busy > 0]
    achieved = train["hw_flops"] / (train["peak_flops"] * busy)
    sizes = train["params_active"].map(size_bucket).astype(str)   # str even when no step is left
    for keys in (train["method"] + "|" + sizes, train["method"]):
        m, n = _median_by(achieved, keys, 0.01, GEMM_LEVEL_MAX)
        mfu.update(m)
        points.update(n)
    inf = frame[~frame["training"] & frame["m_prefill_s"].notna()]
    inf = inf[inf["m_prefill_s"] > 1.05 * inf["decode_floor_s"]]   # a prefill at the launch floor: no FLOP rate
    if len(inf):
        achieved = inf["prefill_flops"] / (inf["peak_flops"] * (inf["m_prefill_s"] - inf["compute_fixed_s"]))
        name = pd.Series("inference-prefill", index=inf.index)
        for keys in (name + "|" + inf["params_active"].map(size_bucket), name):
            m, n = _median_by(achieved, keys, 0.01, GEMM_LEVEL_MAX)
            mfu.update(m)
            points.update(n)
    if mfu:
        fit.factors["mfu"], fit.points["mfu"] = mfu, points
    dec = frame[~frame["training"] & frame["m_decode_token_s"].notna() & (frame["decode_bytes"] > 0)]
    on_gpu = dec["m_decode_token_s"] / dec["decode_slowdown"] - dec["decode_extra_s"]
    # the GPU's work at the default bandwidth fraction: a step well above it is bound by the host,
    # whose time per layer is the launch floor (`decode_host_s_per_layer`, eager steps only)
    gpu_work = dec["decode_bytes"] / (dec["bandwidth"] * dec["decode_default_fraction"]) + dec["decode_attention_s"]
    host = (on_gpu > HOST_BOUND * gpu_work) & (dec["decode_layers"] > 0)
    if host.sum() >= MIN_POINTS:
        per_layer = on_gpu[host] / dec.loc[host, "decode_layers"]
        fit.factors["decode_host_s_per_layer"] = _r(float(np.median(per_layer)))
        fit.points["decode_host_s_per_layer"] = int(host.sum())
    streaming = on_gpu - dec["decode_attention_s"]   # the attention runs beside the streaming, on the GPU
    bound = (~host & (on_gpu > 1.05 * dec["decode_floor_s"]) & (streaming > 0))   # steps at the floor say nothing of bandwidth
    dec, streaming = dec[bound], streaming[bound]
    if len(dec) >= MIN_POINTS:
        frac = dec["decode_bytes"] / (dec["bandwidth"] * streaming)
        fit.factors["decode_bandwidth_fraction"] = _r(min(1.0, max(0.05, float(np.median(frac)))))
        fit.points["decode_bandwidth_fraction"] = len(dec)


def fit_all(frame: pd.DataFrame, gpu: str) -> Fit:
    """Every factor the points can support (a trace table: allocation factors only)."""
    fit = Fit()
    if frame is None or frame.empty:
        return fit
    trace = gpu == TRACE_GPU
    _fit_allocated(frame, fit, with_constant=not trace)
    if not trace:
        _fit_reserve(frame, fit)
        _fit_device(frame, fit)
        _fit_comm(frame, fit)
        _fit_time(frame, fit)
        _fit_overhead(frame, fit)
    return fit
