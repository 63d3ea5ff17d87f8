"""Measure steps: warm up, reset the peaks, time N steps, read the peaks; then rates and MFU.

A step is a list of *phases* (callables run in order: one for training, prefill and decode for
inference), so each phase is timed on its own. On cuda the clock is CUDA events, read after one
synchronize at the end; on cpu it is `time.perf_counter`. During the timed steps a background
thread samples host RSS (psutil) and, when given, NVML device used memory (profiler.nvml).

Units: seconds float, bytes int. Every CUDA quantity is None on cpu ("not measured", never 0:
without a GPU `torch.cuda.max_memory_allocated()` silently returns 0).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from estimator import tables
from estimator.errors import InputError
from estimator.flops import decode_flops_per_token, prefill_flops, training_flops
from estimator.workload import Workload
from profiler.nvml import PeakSampler, Probe

Phase = Callable[[], None]


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True)
class StepStats:
    """Median, fastest and slowest of timed durations (s); spread = (max - min) / median."""

    median_s: float
    min_s: float
    max_s: float
    spread: float


def step_stats(durations_s: Sequence[float]) -> StepStats:
    """Statistics of positive durations in seconds (ValueError for none or a non-positive one)."""
    if not durations_s:
        raise ValueError("no timed steps")
    if any(not d > 0 for d in durations_s):
        raise ValueError(f"durations must be positive seconds; got {list(durations_s)}")
    median = float(statistics.median(durations_s))
    lo, hi = float(min(durations_s)), float(max(durations_s))
    return StepStats(median, lo, hi, (hi - lo) / median)


# ---------------------------------------------------------------- clocks


class CpuClock:
    """Wall clock marks (perf_counter seconds)."""

    def mark(self) -> float:
        return time.perf_counter()

    def sync(self) -> None:
        pass

    def elapsed_s(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    """CUDA event marks on the current stream of `device`; read after `sync()`."""

    def __init__(self, device: str):
        import torch

        self.device = torch.device(device)

    def mark(self):
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def elapsed_s(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3  # CUDA events give milliseconds


def clock_for(device: str):
    return CudaClock(device) if device.startswith("cuda") else CpuClock()


def time_phases(phases: Sequence[Phase], steps: int, clock) -> list[list[float]]:
    """Run `steps` steps of `phases`; durations[step][phase] in seconds (one sync at the end)."""
    marks = []
    for _ in range(steps):
        step_marks = [clock.mark()]
        for phase in phases:
            phase()
            step_marks.append(clock.mark())
        marks.append(step_marks)
    clock.sync()
    return [[clock.elapsed_s(a, b) for a, b in zip(m, m[1:])] for m in marks]


# ---------------------------------------------------------------- memory readings


def rss_bytes() -> int:
    """Resident set size of this process (bytes)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def reset_cuda_peaks(device: str) -> None:
    """Synchronize and reset the allocator's peak statistics (cuda only; no-op on cpu)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peaks(device: str) -> dict:
    """peak_allocated_bytes and peak_reserved_bytes since the last reset; None on cpu."""
    if not device.startswith("cuda"):
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
    import torch

    return {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)) or None,
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)) or None}


def weights_bytes(model, device: str | None = None) -> int | None:
    """Bytes of parameter storage on `device` (any device when None; each storage once, so tied
    weights count once): the parameters, the quantization constants bitsandbytes keeps beside
    packed weights (4-bit absmax and nested statistics, int8 row scales) and, under ZeRO-3, this
    rank's partitions (`ds_tensor`; an offloaded partition lives on the host and does not count).
    None when nothing is stored."""
    seen, total = set(), 0
    kind = None if device is None else device.split(":")[0]
    for p in model.parameters():
        for t in [p, *_stored_beside(p)]:
            if t.device.type == "meta" or t.numel() == 0 or (kind and t.device.type != kind):
                continue
            key = (t.device, t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total or None


def _stored_beside(p) -> list:
    """Tensors stored for a parameter besides its data: bitsandbytes constants, ZeRO-3 partition."""
    import torch

    out = [getattr(p, "SCB", None), getattr(p, "ds_tensor", None)]
    state = getattr(p, "quant_state", None)
    while state is not None:
        out += [getattr(state, "absmax", None), getattr(state, "code", None)]
        state = getattr(state, "state2", None)
    return [t for t in out if isinstance(t, torch.Tensor)]


# ---------------------------------------------------------------- the measurement


def run(phases: Sequence[Phase], warmup: int, steps: int, device: str,
        device_used: Probe | None = None) -> dict:
    """Warm up, reset peaks, time `steps` steps; record columns measured by the run.

    Returns step_s, step_s_min, step_s_max, step_spread (whole step), phase_s (median per phase),
    peak_allocated_bytes, peak_reserved_bytes, device_used_bytes, host_rss_bytes.
    """
    for _ in range(warmup):
        for phase in phases:
            phase()
    reset_cuda_peaks(device)
    with PeakSampler({"host_rss_bytes": rss_bytes, "device_used_bytes": device_used}) as sampler:
        durations = time_phases(phases, steps, clock_for(device))
    stats = step_stats([sum(d) for d in durations])
    return {"step_s": stats.median_s, "step_s_min": stats.min_s, "step_s_max": stats.max_s,
            "step_spread": stats.spread,
            "phase_s": [statistics.median(d[i] for d in durations) for i in range(len(phases))],
            **cuda_peaks(device), **sampler.peaks}


def inference_split(w: Workload, phase_s: Sequence[float]) -> dict:
    """prefill_s and decode_token_s from the medians of the [prefill, decode] phases; the decode
    phase generates new_tokens - 1 tokens (the prefill yields the first)."""
    decoded = w.new_tokens - 1
    return {"prefill_s": float(phase_s[0]),
            "decode_token_s": float(phase_s[1]) / decoded if decoded > 0 and len(phase_s) > 1 else None}


# ---------------------------------------------------------------- rates


def tokens_per_step(w: Workload) -> int:
    """Tokens one step processes on one process: batch x seq x grad_accum (training), batch x
    (seq + new_tokens) (inference)."""
    if w.training:
        return w.batch * w.seq * w.grad_accum
    return w.batch * (w.seq + w.new_tokens)


def model_flops_per_step(w: Workload) -> float:
    """Model FLOPs of one step on one process (estimator.flops; recomputation excluded).
    Inference: the prefill plus new_tokens - 1 decode steps, the i-th attending seq + i keys."""
    if w.training:
        return training_flops(w).model_flops * w.grad_accum
    decode = sum(decode_flops_per_token(w, w.seq + i) for i in range(1, w.new_tokens))
    return prefill_flops(w) + decode


def peak_flops_per_s(w: Workload, gpu_slug: str) -> float | None:
    """Dense peak FLOP/s of the GPU table row for the workload's matmul dtype; None if no row
    or the GPU lacks that tensor mode."""
    if not gpu_slug:
        return None
    try:
        return tables.gpu(gpu_slug).dense_tflops(w.compute_dtype) * 1e12
    except InputError:
        return None


def rates(w: Workload, step_s: float, gpu_slug: str) -> dict:
    """tokens_per_s and mfu (None without a GPU table row) of a step of `step_s` seconds."""
    peak = peak_flops_per_s(w, gpu_slug)
    return {"tokens_per_s": tokens_per_step(w) / step_s,
            "mfu": model_flops_per_step(w) / step_s / peak if peak else None}
