"""`estimate()`: a Workload on a GPU -> memory, time, cost, fit, with raw and calibrated values."""

from __future__ import annotations

from dataclasses import dataclass

from estimator import tables
from estimator.bounds import safe_bound, table_bound
from estimator.bounds import verdict as verdict_of
from estimator.calibration import NONE, Calibration, apply_memory, resolve, time_corrections
from estimator.errors import InputError
from estimator.defaults import overhead
from estimator.fp8 import gpu_refusal
from estimator.memory import Components, MemoryBreakdown, blas_workspace_bytes, components, legacy_offload_share
from estimator.states import frozen_vision, lora_params
from estimator.params import count_params
from estimator.regimes import regime
from estimator.timing import JobCost, TimeBreakdown, inference_time, job_cost, train_time
from estimator.versions import installed_versions
from estimator.workload import INT4_QUANTS, MXFP4_MODEL_TYPES, NO_SDPA, Workload
from estimator.units import GiB

DEFAULT_INTER_NODE = "ib-hdr"
_COMPONENTS = ("weights_bytes", "gradients_bytes", "optimizer_states_bytes", "master_weights_bytes",
               "activations_bytes", "logits_and_loss_bytes", "kv_cache_bytes",
               "optimizer_temporaries_bytes", "autocast_weight_cache_bytes", "quant_workspace_bytes",
               "zero_buffers_bytes", "paged_optimizer_bytes", "cuda_context_bytes",
               "nccl_buffers_bytes", "allocator_reserve_bytes", "blas_workspace_bytes")


# the version of the --json output (docs/estimate-output.schema.json); a change of meaning bumps it
OUTPUT_SCHEMA = "gpu-budget-estimate/1"


@dataclass(frozen=True)
class JobSpec:
    """What a whole job is: samples per epoch, epochs, retry factor, price table override."""

    samples: int
    epochs: float = 1.0
    retry_factor: float = 1.0
    price_path: str | None = None
    provider: str | None = None
    price_kind: str | None = None     # a tier of estimator/data/prices.csv (community, secure, serverless, cloud)


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
    components: Components | None = None   # the named parts both breakdowns were assembled from

    @property
    def fits(self) -> bool:
        return self.memory.device_used_bytes <= self.gpu.memory_bytes

    @property
    def safe(self) -> dict:
        """The safe upper bound of peak allocated, peak reserved and device used memory, with its
        coverage and source (estimator.bounds)."""
        cached = self.__dict__.get("_safe")
        if cached is None:
            outside = any("far outside" in text for text in self.warnings)
            cached = safe_bound(self.memory, self.calibration, outside)
            object.__setattr__(self, "_safe", cached)
        return cached

    @property
    def verdict(self) -> str:
        """fits (the bound fits), tight (the point fits, the bound does not), does not fit."""
        return verdict_of(self.memory.device_used_bytes, self.safe["device_used_bytes"], self.gpu.memory_bytes)

    @property
    def safe_fits(self) -> bool:
        """What the planners plan on: the safe bound of device used memory fits the GPU."""
        return self.verdict == "fits"

    @property
    def headroom_bytes(self) -> int:
        return self.gpu.memory_bytes - self.memory.device_used_bytes

    @property
    def upper_bound(self) -> dict | None:
        """A safe upper bound of device used memory (bytes) with its measured coverage: the
        safe bound of estimator.bounds that covered `coverage` of the held-out
        measurements in the table's validation (estimator.bounds). None without a table (or
        with another GPU's). `within_data_range` is False when the workload lies far outside
        the table's data, where the coverage was not measured."""
        row = self.calibration.upper_bound("device_used_bytes")
        if not row:
            return None
        inside = not any("far outside" in text for text in self.warnings)
        # the bound itself is estimator.bounds' (one formula), unwidened
        return {"device_used_bytes": table_bound(self.memory, "device_used_bytes", row)[0],
                "factor": row["factor"], "uncertain_scale": row.get("uncertain_scale"), "coverage": row["coverage"],
                "quantile": row.get("quantile"), "points": row.get("points"),
                "within_data_range": inside}

    @property
    def device_used_upper_bytes(self) -> int | None:
        bound = self.upper_bound
        return bound["device_used_bytes"] if bound else None

    @property
    def regime_notes(self) -> tuple[str, ...]:
        """One line per regime switch the estimator made on its own, saying why (estimator.regimes)."""
        w = self.workload
        attn = (f"eager attention: {w.model.model_type} has no SDPA in transformers 5.23 (what it loads with "
                f"when no attn_implementation is given)",) if (w.model.model_type in NO_SDPA and w.attn == "eager") else ()
        return (regime(w).notes + attn + _math_sdpa_note(w) + _mxfp4_note(w) + _int4_note(w)
                + _offload_note(w, self.memory))

    def dominant(self, n: int = 3) -> list[tuple[str, int]]:
        """The largest memory components, largest first."""
        items = [(k, getattr(self.memory, k)) for k in _COMPONENTS]
        return sorted((kv for kv in items if kv[1] > 0), key=lambda kv: -kv[1])[:n]

    def to_dict(self) -> dict:
        w, p = self.workload, count_params(self.workload.model)
        trainable = p.total - frozen_vision(w) if w.method == "full" else (lora_params(w, p) if w.training else 0)
        memory = self.memory.to_dict()
        memory["safe"] = {k: v for k, v in self.safe.items() if k != "terms"}
        memory["raw"] = {k: getattr(self.raw_memory, k) for k in
                         ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "activations_bytes")}
        bound = self.upper_bound
        time = self.time.to_dict()
        raw_time = self.raw_time or self.time
        time["raw"] = {"step_s": raw_time.step_s, "mfu": raw_time.mfu}
        cal = self.calibration
        return {
            "schema": OUTPUT_SCHEMA,
            "workload": _workload_dict(w),
            "model": {"name": w.model.name, "model_type": w.model.model_type,
                      "params_total": p.total, "params_active": p.active, "params_trainable": trainable,
                      **_structure(w.model)},
            "gpu": {"slug": self.gpu.slug, "name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes},
            "memory": memory,
            "time": time,
            "fits": self.fits,
            "verdict": self.verdict,
            "headroom_bytes": self.headroom_bytes,
            "dominant": [k for k, _ in self.dominant()],
            "regime": list(self.regime_notes),
            "calibration": {"file": cal.path, "gpu": cal.gpu, "created": cal.table.get("created"),
                            "points": cal.table.get("provenance", {}).get("points"),
                            "versions": cal.versions,
                            "corrections": {k: dict(v) for k, v in self.corrections.items()},
                            "cv_error": cal.cv_error, "upper_bound": bound,
                            "data_range": cal.data_range(w, p.total),
                            "warnings": list(self.warnings)},
            "job": self.job.to_dict() if self.job else None,
        }


def _structure(spec) -> dict:
    """"mapped" (estimator/model.py) or "traced" with its card (estimator/cards.py)."""
    if not getattr(spec, "card_path", ""):
        return {"structure": "mapped"}
    return {"structure": "traced", "card": spec.card_path}


def _workload_dict(w: Workload) -> dict:
    out = {}
    for name in w.__dataclass_fields__:
        value = getattr(w, name)
        out[name] = w.model.name if name == "model" else (list(value) if isinstance(value, tuple) else value)
    out["id"] = w.id
    return out


def _time(w: Workload, gpu: tables.GpuSpec, corrections: dict, memory: MemoryBreakdown,
          inter_node: str) -> TimeBreakdown:
    """Step time with the achieved fraction (and decode bandwidth fraction) of `corrections`."""
    hfu = corrections["mfu"]["value"]   # achieved fraction on hardware FLOPs (estimator.timing)
    if w.training:
        return train_time(w, gpu, hfu, memory, inter_node,
                          host_s_per_op=corrections["training_host_s_per_op"]["value"],
                          link_fraction=corrections["comm_bandwidth_fraction"]["value"],
                          step_overhead_s=corrections["step_overhead_s"]["value"])
    return inference_time(w, gpu, hfu, corrections["decode_bandwidth_fraction"]["value"], memory,
                          host_s_per_layer=corrections["decode_host_s_per_layer"]["value"])


def _offload_note(w: Workload, memory) -> tuple[str, ...]:
    """The activation-offloading caveat (profiler/offload.py, estimator.memory `_layers_on_device`):
    what it keeps on the device, and how much more TRL before 1.8.0 kept (`legacy_offload_share`)."""
    if not (w.training and w.activation_offload):
        return ()
    low, high = legacy_offload_share()
    offloaded = memory.offloaded_activations_bytes
    return ("activation offloading (TRL >= 1.8.0): the estimate keeps one layer in flight (two with checkpointing) "
            "and the later saves of a tensor offloaded a few saves before on the device; TRL 0.25.0-1.7.x also kept "
            f"a tensor allocated where a freed offloaded one was: {low:.0%}-{high:.0%} of the offloaded bytes in traces "
            f"and on the H100, {low * offloaded / GiB:.2f}-{high * offloaded / GiB:.2f} GiB more here; the safe bound "
            "counts every offloaded byte. Host memory is the copies' bytes; pinned memory rounds each copy up to a "
            "power of two (PyTorch's CachingHostAllocator), up to twice that: the H100's host memory rose by the "
            "copies on Llama and 27% more on Qwen3-1.7B",)


def _math_sdpa_note(w: Workload) -> tuple[str, ...]:
    """Falcon's multi-query layout (transformers 5.23 FalconAttention, old architecture: one key and
    value head beside all the query heads, no `enable_gqa`) sends SDPA to its math path on CUDA
    (the fused kernels want equal head counts), which keeps batch x heads x tokens x tokens scores:
    not in this estimate, said rather than missed."""
    spec = w.model
    if not (w.training and w.attn == "sdpa" and spec.model_type == "falcon" and spec.num_kv_heads == 1
            and spec.num_heads > 1):
        return ()
    return ("sdpa attention: Falcon's single key/value head beside its query heads sends SDPA to its math path "
            "on CUDA, whose tokens x tokens scores this estimate does not count (an under-estimate): "
            "--attn eager is modelled",)


def _int4_note(w: Workload) -> tuple[str, ...]:
    """The line saying how a GPTQ/AWQ checkpoint is held (estimator.states.int4_linear_bytes)."""
    if w.quant not in INT4_QUANTS:
        return ()
    held = (f"{w.quant.upper()} int4 (4 bits, group {int(overhead('int4_group_size'))}): the decoder's linears "
            "packed 8 per int32 with an fp16 scale and a packed zero per group"
            + (" and an int32 group index per input row" if w.quant == "gptq" else "")
            + "; embeddings, norms and lm_head as loaded; ")
    if w.training:
        return (held + "LoRA trains through gptqmodel's trainable kernel (GPTQConfig(backend=\"auto_trainable\"); the "
                "fast kernels refuse training), which dequantizes each linear in every forward and saves that half "
                "copy for the backward: "
                + ("the recomputed layer's copies" if w.grad_ckpt else
                   "the whole decoder in half precision besides the packed weights (--grad-ckpt keeps one layer's)")
                + "; a checkpoint with another group size or bit width is not modelled",)
    return (held + "the prefill holds one dequantized fp16 copy of the widest "
            "linear (ExLlamaV2/AutoAWQ large-batch paths; Marlin needs none: over by that much there); a "
            "checkpoint with another group size or bit width is not modelled",)


def _mxfp4_note(w: Workload) -> tuple[str, ...]:
    """The line saying how GPT-OSS's MXFP4 experts are held (transformers 5.23 quantizer_mxfp4.py)."""
    if w.model.model_type not in MXFP4_MODEL_TYPES:
        return ()
    if w.quant == "mxfp4":
        return ("MXFP4 experts as shipped: transformers keeps them only with the `kernels` package, triton >= 3.4 "
                "and compute capability 7.5+, else it dequantizes them to bf16 (--quant none)",)
    if w.quant == "none":
        why = ("MXFP4 does not train: fine-tuning loads it with Mxfp4Config(dequantize=True)" if w.training else
               "what transformers loads without the `kernels` package or on compute capability < 7.5; --quant "
               "mxfp4 keeps them as shipped")
        return (f"bf16 experts: {why}",)
    return ()


def estimate(w: Workload, gpu_slug: str, calibration: str = "auto", job: JobSpec | None = None,
             inter_node: str = DEFAULT_INTER_NODE, cpu_trace: bool = False) -> Estimate:
    """Predict memory per GPU, step time and (with `job`) job time and cost of `w` on `gpu_slug`.

    `calibration`: "auto" (calibrations/<gpu>.json if present), "none", a table path, or a
    `Calibration` object (the fitting package passes its fitted tables this way). Uncalibrated
    values are NONE's: the same lookups with an empty table. `cpu_trace`: predict what a
    fake-tensor trace on the CPU counts, which takes no cuBLAS workspace."""
    w.validate()
    gpu = tables.gpu(gpu_slug)
    if w.fp8 and gpu_refusal(gpu):
        raise InputError(gpu_refusal(gpu))
    cal = resolve(calibration, gpu.slug)
    p = count_params(w.model)
    # `cpu_trace`: the prediction of a fake-tensor trace on the CPU, which runs no cuBLAS
    blas = 0 if cpu_trace else blas_workspace_bytes(w, gpu.compute_capability_major)
    parts = components(w)._replace(blas_workspace=blas)
    memory, corrections = apply_memory(parts, w, cal)
    corrections.update(time_corrections(cal, w, gpu.slug, p.active))
    time = _time(w, gpu, corrections, memory, inter_node)
    if cal.path is None:
        raw, raw_time, warnings = memory, None, ()
    else:
        raw, raw_corrections = apply_memory(parts, w, NONE)
        raw_corrections.update(time_corrections(NONE, w, gpu.slug, p.active))
        raw_time = _time(w, gpu, raw_corrections, raw, inter_node)
        warnings = (cal.warnings + tuple(cal.range_warnings(w, p.total))
                    + tuple(cal.version_warnings(installed_versions())))
    cost = None
    if job is not None:
        try:
            price = tables.price(gpu.slug, job.price_path, job.provider, job.price_kind, w.nodes)
        except tables.NoPrice as exc:   # the table says no public price: a time, and no cost
            price = exc.row
        cost = job_cost(w, time.step_s, job.samples, job.epochs, job.retry_factor, price)
    return Estimate(w, gpu, memory, raw, time, cal, corrections, cost, warnings, raw_time, parts)
