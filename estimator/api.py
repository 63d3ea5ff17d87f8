"""`estimate()`: a Workload on a GPU -> memory, time, cost, fit, with raw and calibrated values."""

from __future__ import annotations

from dataclasses import dataclass

from estimator import tables
from estimator.calibration import Calibration, resolve
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

    @property
    def fits(self) -> bool:
        return self.memory.device_used_bytes <= self.gpu.memory_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.gpu.memory_bytes - self.memory.device_used_bytes

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
        return {
            "workload": _workload_dict(w),
            "model": {"name": w.model.name, "model_type": w.model.model_type,
                      "params_total": p.total, "params_active": p.active, "params_trainable": trainable},
            "gpu": {"slug": self.gpu.slug, "name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes},
            "memory": memory,
            "time": self.time.to_dict(),
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "dominant": [k for k, _ in self.dominant()],
            "calibration": {"file": self.calibration.path, "corrections": self.corrections,
                            "cv_error": self.calibration.cv_error},
            "job": self.job.to_dict() if self.job else None,
        }


def _workload_dict(w: Workload) -> dict:
    out = {}
    for name in w.__dataclass_fields__:
        value = getattr(w, name)
        out[name] = w.model.name if name == "model" else (list(value) if isinstance(value, tuple) else value)
    out["id"] = w.id
    return out


def _scaled(raw: MemoryBreakdown, w: Workload, scale: float, reserve: float, context: int) -> MemoryBreakdown:
    """Re-run the memory model with calibrated overheads and activation scale."""
    if scale == 1.0:
        return estimate_memory(w, reserve, context)
    extra = int((raw.activations_bytes + raw.logits_and_loss_bytes) * (scale - 1.0))
    base = estimate_memory(w, reserve, context)
    allocated = base.peak_allocated_bytes + extra
    reserved = base.peak_reserved_bytes + int(extra * (1.0 + reserve))
    return MemoryBreakdown(**{
        **base.to_dict(),
        "activations_bytes": int(base.activations_bytes * scale),
        "logits_and_loss_bytes": int(base.logits_and_loss_bytes * scale),
        "peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved,
        "allocator_reserve_bytes": reserved - allocated,
        "device_used_bytes": base.device_used_bytes + reserved - base.peak_reserved_bytes,
    })


def estimate(w: Workload, gpu_slug: str, calibration: str = "auto", job: JobSpec | None = None,
             inter_node: str = DEFAULT_INTER_NODE) -> Estimate:
    """Predict memory per GPU, step time and (with `job`) job time and cost of `w` on `gpu_slug`."""
    w.validate()
    gpu = tables.gpu(gpu_slug)
    cal = resolve(calibration, gpu.slug)
    reserve, reserve_src = cal.reserve_fraction(w.method)
    context, context_src = cal.context_bytes()
    scale, scale_src = cal.activation_scale(w.model.model_type)
    mfu, mfu_src = cal.mfu(w.method, gpu.slug)
    raw = estimate_memory(w, float(overhead(f"reserve_fraction_{w.method}")),
                          int(overhead("cuda_context_bytes")))
    memory = _scaled(raw, w, scale, reserve, context) if cal.path else raw
    if w.training:
        time = train_time(w, gpu, mfu, float(overhead("comm_overlap_fraction")), inter_node)
        bw_src = None
    else:
        bw, bw_src = cal.decode_bandwidth_fraction(gpu.slug)
        time = inference_time(w, gpu, mfu, bw, memory)
    corrections = {
        "reserve_fraction": {"value": reserve, "from": reserve_src},
        "cuda_context_bytes": {"value": context, "from": context_src},
        "activation_scale": {"value": scale, "from": scale_src},
        "mfu": {"value": mfu, "from": mfu_src},
    }
    if bw_src:
        corrections["decode_bandwidth_fraction"] = {"value": bw, "from": bw_src}
    cost = None
    if job is not None:
        price = tables.price(gpu.slug, job.price_path, job.provider)
        cost = job_cost(w, time.step_s, job.samples, job.epochs, job.retry_factor, price)
    return Estimate(w, gpu, memory, raw, time, cal, corrections, cost)
