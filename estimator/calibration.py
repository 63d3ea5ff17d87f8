"""Calibration tables: correction factors per GPU kind, fitted from measurements (package `fitting`).

A table is `calibrations/<gpu-slug>.json` (schema `gpu-budget-calibration/2`); every factor is
optional and a missing one falls back to the uncalibrated default, and the estimate says which
value came from where. The factors and what each one means (units in brackets):

- `cuda_context_bytes` [B]: device memory of the CUDA context (NVML delta around CUDA init).
- `non_pytorch_bytes` [B]: other device memory outside the caching allocator at the peak
  (cuBLAS/cuDNN workspaces, library handles): median of device_used - reserved - context.
- `nccl_buffers_bytes` [B]: extra device memory per process in multi-GPU runs.
- `allocated_constant_bytes` [B]: allocator bytes in every run beyond the named components.
- `reserve` {method or "*": {"fraction": f, "bytes": g}}: peak reserved = allocated x (1 + f) + g
  (the allocator's reserve grows with the workload; it is not one constant).
- `activation_scale` {"model_type|attn", "model_type" or "*": s}: measured / formula saved
  activations in training. `inference_activation_scale`: the same for the prefill working set.
- `logits_scale`: measured / formula logits-and-loss bytes (training).
- `optimizer_temporaries_scale`: measured / formula temporaries inside optimizer.step().
- `mfu` {"method|size", "method"}: achieved fraction of the dense peak on the hardware FLOPs the
  estimator counts (recompute included); method is full, lora, qlora or inference-prefill, size
  a bucket of active parameters (`size_bucket`).
- `decode_bandwidth_fraction`: achieved fraction of peak HBM bandwidth while decoding.
- `decode_host_s_per_layer` [s]: host time per decoder layer of an eager decode step (the launch
  floor the GPU's work hides under), from the decode steps the host bound.
- `training_host_s_per_op` [s]: host time per operator an eager training micro-batch dispatches
  (estimator.ops counts; the launch floor of estimator.timing), from the training steps it bound.
- `comm_bandwidth_fraction`: the share of the links' bandwidth the data-parallel collectives reach,
  from the gradient reductions multi-GPU runs measured (the micro-batch that reduces against the
  no_sync ones).
- `step_overhead_s` [s]: the host's work between optimizer steps of a real job (data loading,
  logging), from the gaps the Trainer callback measured (`overhead_s`).

Next to the factors: `provenance` (measurement files with sha256, rows and dates, backends,
versions with counts, models), `versions` (each library's versions seen), `range` (params,
tokens, methods, model types, attention kernels, world sizes of the data), `factor_points` (how
many measurements each factor rests on), `cv_error` (leave-one-model-out median |error|, p90
|error| and under-estimate rate per quantity, calibrated and uncalibrated) and `upper_bound`
(per quantity: the factor on the prediction that covered `coverage` of held-out measurements).

Schema /1 tables (never produced from measurements: there were none) are refused with a message
saying to refit. A table of another GPU given by path lends only its device-independent factors
(activation, logits and temporaries scales), with a warning; under `auto` it is refused.
"""

from __future__ import annotations

import json
from functools import lru_cache
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from estimator import tables
from estimator.defaults import overhead, time_constant
from estimator import schema as sch
from estimator.errors import InputError
from estimator.files import parse_json
from estimator.units import GiB
from estimator.memory import Components, Corrections, MemoryBreakdown, assemble
from estimator.workload import Workload

SCHEMA = "gpu-budget-calibration/2"
OLD_SCHEMAS = ("gpu-budget-calibration/1",)
CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "calibrations"
TRACE_GPU = "trace"  # tables fitted on fake-tensor traces: device-independent factors only
# the table fitted on published measurements (fitting/published.py): device-independent memory
# factors from every source's GPUs; `auto` uses it when the GPU has no measured table of its own
PUBLISHED_GPU = "published"
# the GPU row that predicts trace rows: their peak allocated does not depend on the row
TRACE_PREDICTION_GPU = "h100-80gb"

COMM_FRACTION_MIN = 0.02   # the lowest link fraction a table may hold (fitting.models clips to it)
# name -> (kind, low, high); kind: int | num | map (key -> num) | reserve
_FACTORS = {
    "cuda_context_bytes": ("int", 0, 64 * GiB),
    "non_pytorch_bytes": ("int", -8 * GiB, 64 * GiB),
    "nccl_buffers_bytes": ("int", 0, 64 * GiB),
    "allocated_constant_bytes": ("int", 0, 64 * GiB),
    "reserve": ("reserve", 0.0, 2.0),
    "activation_scale": ("map", 0.2, 5.0),
    "inference_activation_scale": ("map", 0.2, 5.0),
    "logits_scale": ("num", 0.2, 5.0),
    "optimizer_temporaries_scale": ("num", 0.0, 5.0),
    "mfu": ("map", 0.01, tables.GEMM_LEVEL_MAX),   # a GeForce card passes its rated peak (mfu.csv)
    "decode_bandwidth_fraction": ("num", 0.05, 1.0),
    "decode_host_s_per_layer": ("num", 1e-5, 0.05),
    "training_host_s_per_op": ("num", 1e-7, 1e-3),
    "comm_bandwidth_fraction": ("num", COMM_FRACTION_MIN, 1.0),
    "step_overhead_s": ("num", 0.0, 10.0),
}
DEVICE_INDEPENDENT = ("activation_scale", "inference_activation_scale", "logits_scale",
                      "optimizer_temporaries_scale")
_TOP_KEYS = {"schema", "gpu", "created", "fitter", "versions", "provenance", "range", "factors",
             "factor_points", "cv_error", "upper_bound", "notes", "validation"}
_METRIC_KEYS = ("median_abs", "p90_abs", "under_rate")
# Every field's type (fitting/calibration_table.py `build` writes them); factors are checked by
# _validate_factors with their ranges. Extra statistics a fit adds must be typed here first.
_ERRORS = sch.Obj({"median_abs": sch.NUM, "p90_abs": sch.NUM, "under_rate": sch.NUM,
                      "signed_median": sch.NUM, "points": int, "models": int, "sources": int},
                     optional=("signed_median", "points", "models", "sources"))
_TABLE_SCHEMA = sch.Obj({
    "schema": str, "gpu": str, "created": str, "fitter": str,
    "versions": sch.Map(sch.List(str)),
    "provenance": sch.Obj({
        "runs": sch.List(sch.Obj({"file": str, "path": str, "sha256": str, "rows": int, "used": int,
                                        "first": str, "last": str},
                                       optional=("file", "path", "used", "first", "last"))),
        "points": int, "points_by_quantity": sch.Map(int), "models": int,
        "versions": sch.Map(sch.Map(int)), "dates": sch.List(str),
        "sources": sch.List(sch.Obj({"source": str, "rows": int, "metrics": sch.Map(int), "gpus": sch.List(str),
                                     "locators": sch.List(str)}))},
        optional=("runs", "points", "points_by_quantity", "models", "versions", "dates", "sources")),
    "range": sch.Obj({"params_total": sch.Pair(sch.NUM), "tokens": sch.Pair(sch.NUM),
                         "methods": sch.Map(int), "model_types": sch.Map(int), "attn": sch.Map(int),
                         "world_sizes": sch.List(int), "models": sch.List(str), "gpus": sch.Map(int)},
                        optional=("params_total", "tokens", "methods", "model_types", "attn", "world_sizes",
                                  "models", "gpus")),
    "factor_points": sch.Map(sch.Either(int, sch.Map(int))),
    "cv_error": sch.Map(sch.Obj({**_ERRORS.keys, "uncalibrated": sch.Optional(_ERRORS)},
                                      optional=_ERRORS.optional + ("uncalibrated",))),
    # the safe bound (estimator/bounds.py): point + uncertain_scale x uncertain part when
    # uncertain_scale is given, else point x factor
    "upper_bound": sch.Map(sch.Obj({"factor": sch.NUM, "quantile": sch.NUM, "coverage": sch.NUM,
                                          "points": int, "models": int, "sources": int,
                                          "uncertain_scale": sch.NUM, "uncertain_floor_bytes": int,
                                          "factor_coverage": sch.NUM, "over_provision_median": sch.NUM,
                                          "factor_over_provision_median": sch.NUM},
                                         optional=("quantile", "points", "models", "sources", "uncertain_scale",
                                                   "uncertain_floor_bytes", "factor_coverage",
                                                   "over_provision_median", "factor_over_provision_median"))),
    "notes": sch.List(str),
    # leave-one-source-out validation of a published table (fitting/published.py)
    "validation": sch.Obj({"method": str, "sources": int, "points": int, "coverage": sch.NUM,
                           "over_provision_median": sch.NUM, "uncalibrated_coverage": sch.NUM,
                           "uncalibrated_over_provision_median": sch.NUM, "oom_rows": int, "oom_flagged": int,
                           "by_gpu": sch.Map(_ERRORS), "by_source": sch.Map(_ERRORS),
                           # the bound written (estimator/bounds.py) against the point x factor form
                           "bound_form": str, "factor_coverage": sch.NUM, "factor_over_provision_median": sch.NUM,
                           "uncalibrated_factor_coverage": sch.NUM,
                           "uncalibrated_factor_over_provision_median": sch.NUM,
                           "by_quantity_bound": sch.Map(sch.Map(sch.NUM)),
                           # the rows the bound is fitted and scored on (fitting/published.py BOUND_FIELDS),
                           # and the same bound on every measured row
                           "bound_rows": str, "coverage_all_rows": sch.NUM,
                           "over_provision_median_all_rows": sch.NUM},
                          optional=("bound_form", "factor_coverage", "factor_over_provision_median",
                                    "uncalibrated_factor_coverage", "uncalibrated_factor_over_provision_median",
                                    "by_quantity_bound", "bound_rows", "coverage_all_rows",
                                    "over_provision_median_all_rows")),
}, optional=("created", "fitter", "versions", "provenance", "range", "factor_points", "cv_error", "upper_bound",
             "notes", "validation"))
SIZE_BUCKETS = ((1e9, "<1B"), (1e10, "1-10B"), (1e11, "10-100B"), (math.inf, ">=100B"))


def size_bucket(params: float) -> str:
    """Label of the active-parameter bucket used by the `mfu` keys."""
    for edge, label in SIZE_BUCKETS:
        if params < edge:
            return label
    return SIZE_BUCKETS[-1][1]


@dataclass(frozen=True)
class Calibration:
    """The factors in force for one estimate, and where each came from.

    `table` is the whole validated table (provenance, range, cv_error, upper_bound, versions);
    `warnings` are the table-level ones (another GPU's table, trace-only data)."""

    path: str | None
    gpu: str | None
    factors: dict = field(default_factory=dict)
    cv_error: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    table: dict = field(default_factory=dict)
    warnings: tuple = ()
    foreign: bool = False  # the table of another GPU: device-specific factors dropped

    @classmethod
    def from_table(cls, data: dict, path: str | None = "<memory>", gpu_slug: str | None = None) -> "Calibration":
        """A Calibration from a (validated) table dict. With `gpu_slug` naming another GPU than
        the table's, only the device-independent factors are kept, with a warning."""
        factors, warnings = dict(data.get("factors", {})), []
        table_gpu = data.get("gpu")
        foreign = gpu_slug is not None and table_gpu not in (gpu_slug, PUBLISHED_GPU)
        if table_gpu == PUBLISHED_GPU:
            prov, rng = data.get("provenance", {}), data.get("range", {})
            gpus = sorted(rng.get("gpus", {}))
            where = f"on {', '.join(gpus)}" if gpus else ""
            line = (f"calibration: published table {path} ({prov.get('points', '?')} public measurements from "
                    f"{len(prov.get('sources', []))} sources {where}".rstrip() + ")")
            if gpu_slug is not None and gpus and gpu_slug not in gpus:
                line += f"; none measured on {gpu_slug} (its factors are device-independent)"
            warnings.append(line)
        if foreign:
            factors = {k: v for k, v in factors.items() if k in DEVICE_INDEPENDENT}
            what = "fake-tensor traces" if table_gpu == TRACE_GPU else table_gpu
            warnings.append(f"calibration {path} was fitted on {what}, not {gpu_slug}: only its "
                            f"activation, logits and optimizer-temporaries scales are applied")
        elif table_gpu == TRACE_GPU:
            warnings.append("calibration fitted on fake-tensor traces (peak allocated only), not GPU "
                            "measurements")
        return cls(path, table_gpu, factors, data.get("cv_error", {}), data.get("versions", {}),
                   data, tuple(warnings), foreign)

    def _scalar(self, name: str, default, cast):
        """(value, source) of a one-number factor: the table's, else `default` (cast either way)."""
        if name in self.factors:
            return cast(self.factors[name]), "calibration"
        return cast(default), "default"

    def context_bytes(self) -> tuple[int, str]:
        return self._scalar("cuda_context_bytes", overhead("cuda_context_bytes"), int)

    def nccl_bytes(self) -> tuple[int, str]:
        return self._scalar("nccl_buffers_bytes", overhead("nccl_buffers_bytes"), int)

    def non_pytorch_bytes(self) -> tuple[int, str]:
        return self._scalar("non_pytorch_bytes", 0, int)

    def allocated_constant_bytes(self) -> tuple[int, str]:
        return self._scalar("allocated_constant_bytes", 0, int)

    def reserve(self, method: str) -> tuple[float, int, str]:
        """(fraction, bytes, source): reserved = allocated x (1 + fraction) + bytes."""
        table = self.factors.get("reserve", {})
        for key in (method, "*"):
            if key in table:
                row = table[key]
                return float(row["fraction"]), int(row["bytes"]), f"calibration ({key})"
        return float(overhead(f"reserve_fraction_{method}")), 0, "default"

    def reserve_fraction(self, method: str) -> tuple[float, str]:
        fraction, _, source = self.reserve(method)
        return fraction, source

    def activation_scale(self, model_type: str, attn: str = "sdpa", training: bool = True) -> tuple[float, str]:
        """Lookup order: "model_type|attn", "model_type", "*"; 1.0 (the formula) without one."""
        table = self.factors.get("activation_scale" if training else "inference_activation_scale", {})
        for key in (f"{model_type}|{attn}", model_type, "*"):
            if key in table:
                return float(table[key]), f"calibration ({key})"
        return 1.0, "default"

    def logits_scale(self) -> tuple[float, str]:
        return self._scalar("logits_scale", 1.0, float)

    def temporaries_scale(self) -> tuple[float, str]:
        return self._scalar("optimizer_temporaries_scale", 1.0, float)

    def mfu(self, method: str, gpu_slug: str, params_active: float | None = None) -> tuple[float, str]:
        """Lookup order: "method|size bucket", "method", then estimator/data/mfu.csv."""
        key = "inference-prefill" if method == "inference" else method
        table = self.factors.get("mfu", {})
        keys = (f"{key}|{size_bucket(params_active)}", key) if params_active is not None else (key,)
        for k in keys:
            if k in table:
                return float(table[k]), f"calibration ({k})"
        return tables.mfu_default(key, gpu_slug).mfu, "default"

    def decode_bandwidth_fraction(self, gpu_slug: str) -> tuple[float, str]:
        if "decode_bandwidth_fraction" in self.factors:  # the table lookup only when needed
            return self._scalar("decode_bandwidth_fraction", None, float)
        return tables.mfu_default("decode-bandwidth", gpu_slug).mfu, "default"

    def decode_host_s_per_layer(self) -> tuple[float, str]:
        """Host seconds per decoder layer of an eager decode step (the launch floor): a table's,
        fitted from the decode steps its host bound, else time_constants.csv's."""
        if "decode_host_s_per_layer" in self.factors:
            return self._scalar("decode_host_s_per_layer", None, float)
        return float(time_constant("decode_host_s_per_layer_eager")), "default"

    def training_host_s_per_op(self) -> tuple[float, str]:
        """Host seconds per operator of an eager training micro-batch (the launch floor): a table's,
        fitted from the training steps its host bound, else time_constants.csv's."""
        if "training_host_s_per_op" in self.factors:
            return self._scalar("training_host_s_per_op", None, float)
        return float(time_constant("training_host_s_per_op")), "default"

    def comm_bandwidth_fraction(self) -> tuple[float, str]:
        """Share of the links' bandwidth the data-parallel collectives reach: a table's, fitted from
        the gradient reductions its multi-GPU runs measured (`sync_microbatch_s` against
        `nosync_microbatch_s`), else 1 (the interconnect table's per-direction peak)."""
        if "comm_bandwidth_fraction" in self.factors:
            return self._scalar("comm_bandwidth_fraction", None, float)
        return float(time_constant("comm_bandwidth_fraction")), "default"

    def step_overhead_s(self) -> tuple[float, str]:
        """Host seconds between optimizer steps: a table's, fitted from the gaps real jobs measured
        (profiler.callbacks, `overhead_s`), else time_constants.csv's assumption."""
        if "step_overhead_s" in self.factors:
            return self._scalar("step_overhead_s", None, float)
        return float(time_constant("step_overhead_s")), "default"

    def upper_bound(self, quantity: str = "device_used_bytes") -> dict | None:
        """{"factor", "quantile", "coverage", "points"} for `quantity`, or None. Not offered when
        the table's device factors are not applied (another GPU's table)."""
        if self.foreign:
            return None
        return self.table.get("upper_bound", {}).get(quantity)

    def data_range(self, w: Workload, params_total: int) -> dict | None:
        """Where `w` lies against the table's data: per axis the value, the data's [min, max] and
        how far outside (`outside_factor`: value / max or min / value; 1.0 inside), plus whether
        the GPU is among the data's GPUs (published tables). None without a range."""
        rng = self.table.get("range")
        if not rng:
            return None
        out = {}
        for axis, value in (("params_total", params_total), ("tokens", w.batch * w.seq)):
            pair = rng.get(axis)
            if pair:
                lo, hi = pair
                out[axis] = {"value": value, "min": lo, "max": hi,
                             "outside_factor": round(max(1.0, lo / value, value / hi), 3)}
        for axis, value in (("methods", w.method), ("model_types", w.model.model_type)):
            if rng.get(axis) is not None:
                out[axis[:-1]] = {"value": value, "in_data": value in rng[axis]}
        return out

    def range_warnings(self, w: Workload, params_total: int) -> list[str]:
        """Warnings when `w` lies far (a factor of 2) outside the data the table was fitted on."""
        rng, out = self.table.get("range"), []
        if not rng:
            return out
        lo, hi = rng.get("params_total", (None, None))
        if lo and (params_total < lo / 2 or params_total > hi * 2):
            out.append(f"{params_total / 1e9:.2f}B parameters is far outside the calibration data "
                       f"({lo / 1e9:.2f}B-{hi / 1e9:.2f}B)")
        lo, hi = rng.get("tokens", (None, None))
        tokens = w.batch * w.seq
        if lo and (tokens < lo / 2 or tokens > hi * 2):
            out.append(f"batch x seq = {tokens} tokens is far outside the calibration data ({lo}-{hi})")
        methods = rng.get("methods")
        if methods is not None and w.method not in methods:
            out.append(f"no {w.method} runs in the calibration data: its reserve and MFU are defaults")
        types = rng.get("model_types")
        if types is not None and w.model.model_type not in types:
            out.append(f"no {w.model.model_type} model in the calibration data: its activation scale "
                       f"is another family's")
        worlds = rng.get("world_sizes")
        if worlds is not None and w.world_size > 1 and max(worlds) <= 1:
            out.append("calibration data has single-GPU runs only: NCCL buffers and communication are "
                       "not calibrated")
        return out

    def version_warnings(self, versions: dict) -> list[str]:
        """Warnings for libraries whose version differs from every version the table was fitted
        on. `versions` is {library: version} of the caller (e.g. a profiler record row)."""
        out = []
        for lib, value in sorted(versions.items()):
            seen = self.versions.get(lib)
            # a local build tag (+cpu, +cu130) names the build, not the library's behaviour
            if value and seen and _public(value) not in [_public(v) for v in seen]:
                out.append(f"calibration fitted with {lib} {', '.join(map(str, seen))}; this run has {value}")
        return out


# The empty table: every lookup gives the uncalibrated default. Its factors are read-only, since
# the uncalibrated corrections are memoised on the lookups' arguments alone.
NONE = Calibration(path=None, gpu=None, factors=MappingProxyType({}))


def _public(version) -> str:
    """A version without its local build tag: '2.13.0+cpu' -> '2.13.0'."""
    return str(version).split("+", 1)[0]


def memory_corrections(cal: Calibration, w: Workload) -> tuple[Corrections, dict]:
    """The corrections `cal` makes to `w`'s memory assembly, and each with its source, as the
    estimate reports them (a new dict each call). A factor the table lacks (every factor of NONE)
    takes its uncalibrated default: this is the one place those defaults are looked up."""
    if cal is NONE:   # the same lookups, memoised on what they read
        corrections, items = _uncalibrated(w.method, w.model.model_type, w.attn, w.training)
    else:
        corrections, items = _corrections(cal, w.method, w.model.model_type, w.attn, w.training)
    return corrections, {name: {"value": value, "from": source} for name, value, source in items}


@lru_cache(maxsize=256)
def _uncalibrated(method: str, model_type: str, attn: str, training: bool) -> tuple[Corrections, tuple]:
    return _corrections(NONE, method, model_type, attn, training)


def _corrections(cal: Calibration, method: str, model_type: str, attn: str,
                 training: bool) -> tuple[Corrections, tuple]:
    """(Corrections, ((name, value, source), ...)) of `cal` for a workload of that kind."""
    scale, scale_src = cal.activation_scale(model_type, attn, training)
    constant, constant_src = cal.allocated_constant_bytes()
    if training:
        logits, logits_src = cal.logits_scale()
        temps, temps_src = cal.temporaries_scale()
    else:  # no loss and no optimizer step: the factors have nothing to scale
        (logits, logits_src), (temps, temps_src) = (1.0, "default"), (1.0, "default")
    fraction, extra, reserve_src = cal.reserve(method)
    context, context_src = cal.context_bytes()
    other, other_src = cal.non_pytorch_bytes()
    nccl, nccl_src = cal.nccl_bytes()
    corrections = Corrections(
        reserve_fraction=fraction, reserve_bytes=extra, cuda_context_bytes=context, non_pytorch_bytes=other,
        nccl_buffers_bytes=nccl, allocated_constant_bytes=constant, activation_scale=scale,
        logits_scale=logits, optimizer_temporaries_scale=temps)
    items = (("reserve_fraction", fraction, reserve_src), ("reserve_bytes", extra, reserve_src),
             ("cuda_context_bytes", context, context_src), ("non_pytorch_bytes", other, other_src),
             ("nccl_buffers_bytes", nccl, nccl_src), ("allocated_constant_bytes", constant, constant_src),
             ("activation_scale", scale, scale_src), ("logits_scale", logits, logits_src),
             ("optimizer_temporaries_scale", temps, temps_src))
    return corrections, items


def time_corrections(cal: Calibration, w: Workload, gpu_slug: str, params_active: float) -> dict:
    """The step-time factors `cal` gives `w` on `gpu_slug`, each with its source: `mfu`, and for
    inference `decode_bandwidth_fraction` (a new dict each call; NONE: the defaults)."""
    if cal is NONE:   # the same lookups, memoised on what they read (no size bucket: no table)
        items = _uncalibrated_time(w.method, w.training, gpu_slug)
    else:
        items = _time_items(cal, w.method, w.training, gpu_slug, params_active)
    return {name: {"value": value, "from": source} for name, value, source in items}


@lru_cache(maxsize=256)
def _uncalibrated_time(method: str, training: bool, gpu_slug: str) -> tuple:
    return _time_items(NONE, method, training, gpu_slug, None)


def _time_items(cal: Calibration, method: str, training: bool, gpu_slug: str, params_active) -> tuple:
    items = (("mfu", *cal.mfu(method, gpu_slug, params_active)),)
    if training:
        items += (("training_host_s_per_op", *cal.training_host_s_per_op()),
                  ("comm_bandwidth_fraction", *cal.comm_bandwidth_fraction()),
                  ("step_overhead_s", *cal.step_overhead_s()))
    else:
        items += (("decode_bandwidth_fraction", *cal.decode_bandwidth_fraction(gpu_slug)),
                  ("decode_host_s_per_layer", *cal.decode_host_s_per_layer()))
    return items


def apply_memory(parts: Components, w: Workload, cal: Calibration) -> tuple[MemoryBreakdown, dict]:
    """The breakdown of `w` under `cal` (NONE: the uncalibrated one) and the corrections used with
    their source. Every change is a stated factor applied to a named component by
    estimator.memory.assemble, the one assembly of the peaks: saved activations, logits and
    optimizer temporaries are scaled inside their working set, and the peak phase is the larger
    scaled working set; allocated gets the constant; reserved = allocated x (1 + f) + g rounded up
    to 2 MiB; device used = reserved + context + NCCL (multi-GPU) + paged optimizer states +
    non-PyTorch bytes.
    """
    corrections, report = memory_corrections(cal, w)
    return assemble(parts, corrections), report


# ---- reading and validating tables -----------------------------------------------------------------

def _fail(path, message: str) -> InputError:
    return InputError(f"calibration {path}: {message}")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_range(path, name: str, value, low, high, integer: bool = False) -> None:
    if integer and (not isinstance(value, int) or isinstance(value, bool)):
        raise _fail(path, f"{name} must be an integer (bytes), got {value!r}")
    if not _number(value) or not low <= value <= high:
        raise _fail(path, f"{name} must be a number in [{low}, {high}], got {value!r}")


def _validate_factors(factors, path) -> None:
    if not isinstance(factors, dict):
        raise _fail(path, "factors must be an object")
    unknown = sorted(set(factors) - set(_FACTORS))
    if unknown:
        raise _fail(path, f"unknown factors {unknown}")
    for name, value in factors.items():
        kind, low, high = _FACTORS[name]
        if kind in ("int", "num"):
            _check_range(path, name, value, low, high, integer=kind == "int")
        elif kind == "map":
            if not isinstance(value, dict):
                raise _fail(path, f"{name} must be an object")
            for key, v in value.items():
                _check_range(path, f"{name}[{key}]", v, low, high)
        else:  # reserve
            if not isinstance(value, dict):
                raise _fail(path, "reserve must be an object")
            for key, row in value.items():
                if not isinstance(row, dict) or set(row) != {"fraction", "bytes"}:
                    raise _fail(path, f"reserve[{key}] must be {{\"fraction\": f, \"bytes\": g}}")
                _check_range(path, f"reserve[{key}].fraction", row["fraction"], low, high)
                _check_range(path, f"reserve[{key}].bytes", row["bytes"], 0, 64 * GiB, integer=True)


def _validate_stats(data: dict, path) -> None:
    for quantity, row in data.get("cv_error", {}).items():
        if not isinstance(row, dict) or not all(_number(row.get(k)) and row[k] >= 0 for k in _METRIC_KEYS):
            raise _fail(path, f"cv_error[{quantity}] needs median_abs, p90_abs and under_rate >= 0")
    for quantity, row in data.get("upper_bound", {}).items():
        if not isinstance(row, dict) or not _number(row.get("factor")) or not 1.0 <= row["factor"] <= 10.0:
            raise _fail(path, f"upper_bound[{quantity}].factor must be a number in [1, 10]")
        if not _number(row.get("coverage")) or not 0.0 <= row["coverage"] <= 1.0:
            raise _fail(path, f"upper_bound[{quantity}].coverage must be in [0, 1]")
        if "uncertain_scale" in row and (not _number(row["uncertain_scale"]) or not 0.0 <= row["uncertain_scale"] <= 10.0):
            raise _fail(path, f"upper_bound[{quantity}].uncertain_scale must be a number in [0, 10]")
    rng = data.get("range", {})
    for name in ("params_total", "tokens"):
        pair = rng.get(name)
        if pair is not None and not (isinstance(pair, list) and len(pair) == 2 and all(map(_number, pair))
                                     and 0 < pair[0] <= pair[1]):
            raise _fail(path, f"range.{name} must be [min, max] with 0 < min <= max")


def validate_table(data: dict, path, gpu_slug: str | None = None) -> None:
    """Refuse a corrupt or foreign table with a one-line reason (InputError). With
    `gpu_slug`, a table fitted on another GPU is refused too."""
    if not isinstance(data, dict):
        raise InputError(f"calibration {path} is not a {SCHEMA} table (not a JSON object)")
    schema = data.get("schema")
    if schema in OLD_SCHEMAS:
        raise InputError(f"calibration {path} uses the retired schema {schema}; refit it "
                             f"(scripts/bench_calibration.py --write, or scripts/profile.py)")
    if schema != SCHEMA:
        raise InputError(f"calibration {path} is not a {SCHEMA} table (schema {schema!r})")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise _fail(path, f"unknown keys {unknown}")
    gpu = data.get("gpu")
    if not isinstance(gpu, str) or not gpu:
        raise _fail(path, "gpu must name the GPU slug the table was fitted on")
    if gpu_slug is not None and gpu != gpu_slug:
        raise _fail(path, f"was fitted on {gpu}, not {gpu_slug}: refusing a foreign table")
    if "factors" not in data:
        raise _fail(path, "has no factors")
    _validate_factors(data["factors"], path)
    try:
        sch.check(_TABLE_SCHEMA, {k: v for k, v in data.items() if k != "factors"}, "table")
    except InputError as exc:
        raise _fail(path, str(exc).removeprefix("table.")) from None
    _validate_stats(data, path)


def _load(path: str, gpu_slug: str, refuse_foreign: bool) -> Calibration:
    """Read a table file and return it parsed and validated (`_parse` memoises that on what was
    read: the bytes, so a rewritten file is re-read whatever its timestamps)."""
    try:
        os.stat(path)
    except OSError as exc:
        if refuse_foreign:
            raise InputError(f"cannot read calibration {path}: {exc.strerror}") from None
        raise InputError(f"calibration file not found: {path}") from None
    shown = str(Path(path).resolve())
    try:
        raw = Path(path).read_bytes()
    except IsADirectoryError:
        raise InputError(f"calibration file not found: {path}") from None
    except OSError as exc:
        raise InputError(f"cannot read calibration {shown}: {exc.strerror}") from None
    return _parse(shown, raw, gpu_slug, refuse_foreign)


@lru_cache(maxsize=64)
def _parse(shown: str, raw: bytes, gpu_slug: str, refuse_foreign: bool) -> Calibration:
    """The Calibration of a table's bytes (`shown`: the resolved path it reports)."""
    try:
        data = parse_json(raw, shown, "calibration")
    except InputError as exc:
        reason = str(exc).removeprefix(f"malformed calibration {shown}: ")
        raise InputError(f"calibration {shown} is corrupt: {reason}") from None
    validate_table(data, shown, gpu_slug if refuse_foreign else None)
    return Calibration.from_table(data, shown, gpu_slug)


def published_path() -> Path:
    """calibrations/published.json: `auto`'s table for a GPU without one of its own. The
    environment variable GPU_BUDGET_PUBLISHED_TABLE names another file (tests; "none": no table)."""
    override = os.environ.get("GPU_BUDGET_PUBLISHED_TABLE")
    if override:
        return Path(override)
    return CALIBRATION_DIR / "published.json"


def table_path(gpu_slug: str) -> Path:
    return CALIBRATION_DIR / f"{gpu_slug}.json"


def resolve(choice, gpu_slug: str) -> Calibration:
    """`none`, `auto` (calibrations/<gpu>.json when it exists), a path to a table, or a
    Calibration object (used as is)."""
    if isinstance(choice, Calibration):
        return choice
    if choice == "none":
        return NONE
    if choice == "auto":
        path = table_path(gpu_slug)
        if path.is_file():
            return _load(str(path), gpu_slug, True)
        published = published_path()
        return _load(str(published), gpu_slug, False) if published.is_file() else NONE
    return _load(str(choice), gpu_slug, False)
