"""`estimate()`: a Workload on a GPU -> memory, time, cost, fit, with raw and calibrated values."""

from __future__ import annotations

import math
from dataclasses import dataclass

from estimator import tables
from estimator.calibration import NONE, Calibration, apply_memory, installed_versions, resolve
from estimator.defaults import overhead
from estimator.memory import MemoryBreakdown, estimate_memory, lora_params
from estimator.params import count_params
from estimator.timing import JobCost, TimeBreakdown, inference_time, job_cost, train_time
from estimator.workload import Workload

DEFAULT_INTER_NODE = "ib-hdr"
_COMPONENTS = ("weights_bytes", "gradients_bytes", "optimizer_states_bytes", "master_weights_bytes",
               "activations_bytes", "logits_and_loss_bytes", "kv_cache_bytes",
               "optimizer_temporaries_bytes", "autocast_weight_cache_bytes", "quant_workspace_bytes",
               "zero_buffers_bytes", "paged_optimizer_bytes", "cuda_context_bytes",
               "nccl_buffers_bytes", "allocator_reserve_bytes")


@dataclass(frozen=True)
class JobSpec:
    """What a whole job is: samples per epoch, epochs, retry factor, price table override."""

    samples: int
    epochs: float = 1.0
    retry_factor: float = 1.0
    price_path: str | None = None
    provider: str | None = None


@dataclass(frozen=True)
class Estimate:
    workload: Workload
    gpu: tables.GpuSpec
    memory: MemoryBreakdown
    raw_memory: MemoryBreakdown
    time: TimeBreakdown
    calibration: Calibration
    corrections: dict
    job: JobCost | None
    warnings: tuple = ()                # calibration warnings (other GPU, outside the data's range)
    raw_time: TimeBreakdown | None = None  # uncalibrated time when a table is applied

    @property
    def fits(self) -> bool:
        return self.memory.device_used_bytes <= self.gpu.memory_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.gpu.memory_bytes - self.memory.device_used_bytes

    @property
    def upper_bound(self) -> dict | None:
        """A safe upper bound of device used memory (bytes) with its measured coverage: the
        calibrated prediction times the factor that covered `coverage` of the held-out
        measurements in the table's leave-one-model-out validation. None without a table (or
        with another GPU's). `within_data_range` is False when the workload lies far outside
        the table's data, where the coverage was not measured."""
        row = self.calibration.upper_bound("device_used_bytes")
        if not row:
            return None
        inside = not any("far outside" in text for text in self.warnings)
        return {"device_used_bytes": int(math.ceil(self.memory.device_used_bytes * row["factor"])),
                "factor": row["factor"], "coverage": row["coverage"],
                "quantile": row.get("quantile"), "points": row.get("points"),
                "within_data_range": inside}

    @property
    def device_used_upper_bytes(self) -> int | None:
        bound = self.upper_bound
        return bound["device_used_bytes"] if bound else None

    def dominant(self, n: int = 3) -> list[tuple[str, int]]:
        """The largest memory components, largest first."""
        items = [(k, getattr(self.memory, k)) for k in _COMPONENTS]
        return sorted((kv for kv in items if kv[1] > 0), key=lambda kv: -kv[1])[:n]

    def to_dict(self) -> dict:
        w, p = self.workload, count_params(self.workload.model)
        trainable = p.total if w.method == "full" else (lora_params(w, p) if w.training else 0)
        memory = self.memory.to_dict()
        memory["raw"] = {k: getattr(self.raw_memory, k) for k in
                         ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "activations_bytes")}
        bound = self.upper_bound
        time = self.time.to_dict()
        raw_time = self.raw_time or self.time
        time["raw"] = {"step_s": raw_time.step_s, "mfu": raw_time.mfu}
        cal = self.calibration
        return {
            "workload": _workload_dict(w),
            "model": {"name": w.model.name, "model_type": w.model.model_type,
                      "params_total": p.total, "params_active": p.active, "params_trainable": trainable},
            "gpu": {"slug": self.gpu.slug, "name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes},
            "memory": memory,
            "time": time,
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "dominant": [k for k, _ in self.dominant()],
            "calibration": {"file": cal.path, "gpu": cal.gpu, "created": cal.table.get("created"),
                            "points": cal.table.get("provenance", {}).get("points"),
                            "versions": cal.versions,
                            "corrections": {k: dict(v) for k, v in self.corrections.items()},
                            "cv_error": cal.cv_error, "upper_bound": bound,
                            "warnings": list(self.warnings)},
            "job": self.job.to_dict() if self.job else None,
        }


def _workload_dict(w: Workload) -> dict:
    out = {}
    for name in w.__dataclass_fields__:
        value = getattr(w, name)
        out[name] = w.model.name if name == "model" else (list(value) if isinstance(value, tuple) else value)
    out["id"] = w.id
    return out


_DEFAULTS: dict = {}


def _defaults(method: str, gpu_slug: str) -> tuple:
    """Uncalibrated (reserve fraction, context bytes, mfu, decode bandwidth fraction, corrections)."""
    key = (method, gpu_slug)
    hit = _DEFAULTS.get(key)
    if hit is None:
        reserve, context = float(overhead(f"reserve_fraction_{method}")), int(overhead("cuda_context_bytes"))
        mfu = NONE.mfu(method, gpu_slug)[0]
        bw = NONE.decode_bandwidth_fraction(gpu_slug)[0] if method == "inference" else None
        corrections = {
            "reserve_fraction": {"value": reserve, "from": "default"},
            "reserve_bytes": {"value": 0, "from": "default"},
            "cuda_context_bytes": {"value": context, "from": "default"},
            "non_pytorch_bytes": {"value": 0, "from": "default"},
            "nccl_buffers_bytes": {"value": int(overhead("nccl_buffers_bytes")), "from": "default"},
            "allocated_constant_bytes": {"value": 0, "from": "default"},
            "activation_scale": {"value": 1.0, "from": "default"},
            "logits_scale": {"value": 1.0, "from": "default"},
            "optimizer_temporaries_scale": {"value": 1.0, "from": "default"},
            "mfu": {"value": mfu, "from": "default"},
        }
        if bw is not None:
            corrections["decode_bandwidth_fraction"] = {"value": bw, "from": "default"}
        hit = _DEFAULTS[key] = (reserve, context, mfu, bw, corrections)
    return hit


def _scaled(raw: MemoryBreakdown, w: Workload, cal: Calibration) -> tuple[MemoryBreakdown, dict]:
    """The calibrated breakdown: the table's factors applied to the raw components
    (estimator.calibration.apply_memory says exactly how)."""
    return apply_memory(raw, w, cal)


def estimate(w: Workload, gpu_slug: str, calibration: str = "auto", job: JobSpec | None = None,
             inter_node: str = DEFAULT_INTER_NODE) -> Estimate:
    """Predict memory per GPU, step time and (with `job`) job time and cost of `w` on `gpu_slug`.

    `calibration`: "auto" (calibrations/<gpu>.json if present), "none", a table path, or a
    `Calibration` object (the fitting package passes its fitted tables this way)."""
    w.validate()
    gpu = tables.gpu(gpu_slug)
    cal = resolve(calibration, gpu.slug)
    reserve, context, mfu, bw, default_corrections = _defaults(w.method, gpu.slug)
    raw = estimate_memory(w, reserve, context)
    overlap = float(overhead("comm_overlap_fraction"))
    if cal.path is None:
        memory, corrections, warnings, raw_time = raw, default_corrections, (), None
        time = (train_time(w, gpu, mfu, overlap, inter_node) if w.training
                else inference_time(w, gpu, mfu, bw, memory))
    else:
        memory, corrections = _scaled(raw, w, cal)
        p = count_params(w.model)
        cal_mfu, mfu_src = cal.mfu(w.method, gpu.slug, p.active)
        corrections["mfu"] = {"value": cal_mfu, "from": mfu_src}
        if w.training:
            time = train_time(w, gpu, cal_mfu, overlap, inter_node)
            raw_time = train_time(w, gpu, mfu, overlap, inter_node)
        else:
            cal_bw, bw_src = cal.decode_bandwidth_fraction(gpu.slug)
            corrections["decode_bandwidth_fraction"] = {"value": cal_bw, "from": bw_src}
            time = inference_time(w, gpu, cal_mfu, cal_bw, memory)
            raw_time = inference_time(w, gpu, mfu, bw, raw)
        warnings = (cal.warnings + tuple(cal.range_warnings(w, p.total))
                    + tuple(cal.version_warnings(installed_versions())))
    cost = None
    if job is not None:
        price = tables.price(gpu.slug, job.price_path, job.provider)
        cost = job_cost(w, time.step_s, job.samples, job.epochs, job.retry_factor, price)
    return Estimate(w, gpu, memory, raw, time, cal, corrections, cost, warnings, raw_time)
