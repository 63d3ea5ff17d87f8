"""Synthetic measurement rows generated from KNOWN factors plus noise (tests, demonstrations).

Nothing here is a measurement. `rows()` applies `TRUE_FACTORS` with the estimator itself (so the
"truth" is what a perfectly fitted table would predict), then perturbs every measured quantity
by relative Gaussian noise; configurations whose true device memory exceeds the GPU are recorded
as status `oom` with nothing measured, as the profiler would.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from estimator.api import estimate
from estimator.calibration import SCHEMA, TRACE_GPU, Calibration
from estimator.memory import round_up
from estimator.configs import load_spec
from estimator.errors import InputError
from estimator.workload import Workload
from profiler import steps
from profiler.record import COLUMN_NAMES, new_row

MiB = 2**20
TRUE_FACTORS = {
    "cuda_context_bytes": 612 * MiB,
    "non_pytorch_bytes": 180 * MiB,
    "allocated_constant_bytes": 40 * MiB,
    "reserve": {"full": {"fraction": 0.06, "bytes": 320 * MiB}, "lora": {"fraction": 0.11, "bytes": 200 * MiB},
                "qlora": {"fraction": 0.24, "bytes": 260 * MiB},
                "inference": {"fraction": 0.03, "bytes": 96 * MiB}},
    "activation_scale": {"llama|sdpa": 1.12, "llama|eager": 1.04, "qwen2|sdpa": 0.93, "qwen3|sdpa": 0.97,
                         "gemma2|eager": 1.08, "mistral|sdpa": 1.1, "phi|sdpa": 1.2},
    "inference_activation_scale": {"llama|sdpa": 1.3, "qwen2|sdpa": 1.25, "qwen3|sdpa": 1.2,
                                   "mistral|sdpa": 1.3, "gemma2|eager": 1.15, "phi|sdpa": 1.4},
    "logits_scale": 1.06,
    "optimizer_temporaries_scale": 1.5,
    "mfu": {"full|<1B": 0.28, "full|1-10B": 0.43, "lora|<1B": 0.2, "lora|1-10B": 0.33, "qlora|<1B": 0.14,
            "qlora|1-10B": 0.22, "inference-prefill|<1B": 0.3, "inference-prefill|1-10B": 0.5},
    "decode_bandwidth_fraction": 0.62,
    "decode_host_s_per_layer": 0.0009,
}
MODELS = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "tinyllama", "qwen2.5-0.5b", "qwen2.5-1.5b",
          "qwen2.5-3b", "qwen3-0.6b", "qwen3-1.7b", "mistral-7b", "gemma-2-2b", "phi-2")
VERSIONS = {"driver": "570.86.15", "cuda": "12.8", "torch": "2.13.0", "transformers": "5.23.0",
            "peft": "0.21.2", "bitsandbytes": "0.50.2", "deepspeed": "0.19.8"}


def true_calibration(gpu: str, factors: dict | None = None) -> Calibration:
    return Calibration.from_table({"schema": SCHEMA, "gpu": gpu, "factors": factors or TRUE_FACTORS},
                                  "<synthetic truth>")


def workloads(models=MODELS) -> list[Workload]:
    """A sweep like a profiler run: methods, batch, sequence, checkpointing, attention kernels."""
    out = []
    for name in models:
        spec = load_spec(name)
        attn = "eager" if spec.model_type == "gemma2" else "sdpa"
        small = spec.num_layers * spec.hidden_size ** 2 < 3e9
        for batch, seq, ckpt in ((1, 512, False), (2, 1024, False), (4, 2048, True), (1, 4096, True)):
            out.append(Workload(spec, method="full", batch=batch, seq=seq, grad_ckpt=ckpt, attn=attn))
            out.append(Workload(spec, method="lora", batch=batch, seq=seq, grad_ckpt=ckpt, attn=attn))
            out.append(Workload(spec, method="qlora", quant="nf4", batch=batch, seq=seq, grad_ckpt=ckpt, attn=attn))
        if small:  # foreach AdamW at short sequences peaks in the optimizer step
            out.append(Workload(spec, method="full", adamw_impl="foreach", batch=1, seq=128, attn=attn))
            out.append(Workload(spec, method="full", adamw_impl="foreach", batch=1, seq=256, attn=attn))
        if spec.model_type == "llama":
            out.append(Workload(spec, method="lora", batch=2, seq=1024, attn="eager"))
            out.append(Workload(spec, method="lora", batch=1, seq=2048, attn="eager"))
            out.append(Workload(spec, method="full", batch=1, seq=1024, attn="eager", grad_ckpt=True))
        for batch, seq, new in ((1, 512, 0), (8, 1024, 0), (1, 512, 128), (8, 2048, 64)):
            out.append(Workload(spec, method="inference", batch=batch, seq=seq, new_tokens=new, attn=attn))
        # compiled decode with a static cache: bandwidth-bound, so it binds the bandwidth fraction
        out.append(Workload(spec, method="inference", batch=8, seq=512, new_tokens=64, attn=attn, compiled=True))
        out.append(Workload(spec, method="full", zero=2, gpus=2, batch=2, seq=1024, attn=attn))
        out.append(Workload(spec, method="lora", gpus=2, batch=2, seq=2048, attn=attn))
        out.append(Workload(spec, method="full", zero=3, gpus=2, batch=1, seq=2048, attn=attn, grad_ckpt=True))
    return [w.validate() for w in out]


def rows(gpu: str = "h100-80gb", factors: dict | None = None, noise: float = 0.01, seed: int = 0,
         models=MODELS, backend: str = "cuda", versions: dict | None = None) -> list[dict]:
    """Record rows (profiler.record columns) of `workloads(models)` measured under `factors`.

    `noise`: relative standard deviation of allocated, reserved-over-formula, step time and
    device-used residual; context varies by noise / 4. backend "trace": peak allocated only
    (no allocator constant), gpu_slug empty."""
    rng = np.random.default_rng(seed)
    factors = factors or TRUE_FACTORS
    slug = "h100-80gb" if backend == "trace" else gpu
    cal = true_calibration(TRACE_GPU if backend == "trace" else gpu, factors)
    out = []
    for w in workloads(models):
        try:
            est = estimate(w, slug, cal, cpu_trace=backend == "trace")
        except InputError:
            continue
        m, t = est.memory, est.time
        for rank in range(w.world_size):
            row = new_row(None, backend, workload=w, model=_alias(w), status="ok", message="", rank=rank,
                          warmup=2, steps=5, started_at=f"2026-11-22T{len(out) // 60:02d}:{len(out) % 60:02d}:00Z",
                          gpu_slug=None if backend == "trace" else gpu, **(versions or VERSIONS))
            if backend == "trace":
                row["peak_allocated_bytes"] = int(m.peak_allocated_bytes * (1 + noise * rng.standard_normal()))
                out.append(row)
                continue
            if m.device_used_bytes > est.gpu.memory_bytes:
                row.update(status="oom", message="CUDA out of memory (synthetic)")
                out.append(row)
                continue
            alloc = int(m.peak_allocated_bytes * (1 + noise * rng.standard_normal()))
            fraction, extra, _ = cal.reserve(w.method)
            reserved = max(alloc, round_up((alloc * (1 + fraction) + extra) * (1 + noise / 2 * rng.standard_normal())))
            context = int(cal.context_bytes()[0] * (1 + noise / 4 * rng.standard_normal()))
            outside = m.device_used_bytes - m.peak_reserved_bytes - m.cuda_context_bytes
            used = int(reserved + context + outside * (1 + noise * rng.standard_normal()))
            step = t.step_s
            if w.training:   # as the profiler's loop runs it (profiler.steps.loop_step_s)
                clips = not w.zero   # the clipping is timed, but not under DeepSpeed's engine
                step = steps.loop_step_s(t, clips)
                if clips:
                    row["clip_s"] = t.clip_s
            step *= 1 + noise * rng.standard_normal()
            row.update(peak_allocated_bytes=alloc, peak_reserved_bytes=reserved, device_used_bytes=used,
                       device_used_source="nvml-process", context_bytes=context, step_s=step)
            if not w.training:
                row["prefill_s"] = t.prefill_s * (1 + noise * rng.standard_normal())
                if w.new_tokens:
                    row["decode_token_s"] = t.decode_s_per_token * (1 + noise * rng.standard_normal())
            out.append(row)
    return out


def _alias(w: Workload) -> str:
    for name in MODELS:
        if load_spec(name) == w.model:
            return name
    return w.model.name


def write_csv(records: list[dict], path: Path) -> Path:
    """Write record rows as the profiler does: every column, empty when not measured."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMN_NAMES)
        writer.writeheader()
        for row in records:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return path
