"""Measure steps: warm up, reset the peaks, time N steps, read the peaks; then rates and MFU.

A step is a list of *phases* (callables run in order: one for training, prefill and decode for
inference), so each phase is timed on its own. `run` returns a `Measurement` (in the spirit of
`torch.utils.benchmark`'s Timer -> Measurement): the median step time, its spread, the number of
timed steps, warnings about the timings, and each memory peak under its own name.

Every reading comes from `profiler.device`: on cuda the clock is CUDA events, read after one
synchronize at the end, and the allocator's peaks; on cpu the clock is `time.perf_counter`.
On cuda the allocator's cache is emptied before the warm-up (blocks cached while building must
not inflate the peak reserved) and its `num_alloc_retries` counter is read around the timed steps:
retries (a configuration near the memory limit) slow every step, so a run with any is flagged.
During the timed steps a background thread samples host RSS and, when given, NVML device used
memory (`profiler.device.nvml.PeakSampler`).

Units: seconds float, bytes int. Every CUDA quantity is None on cpu ("not measured", never 0).
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

from estimator import tables
from estimator.errors import InputError
from estimator.flops import decode_flops_per_token, prefill_flops, training_flops
from estimator.timing import peak_flops
from estimator.workload import Workload
from profiler.device import clock_for, cuda, host
from profiler.device.nvml import PeakSampler, Probe

Phase = Callable[[], None]

NOISY_SPREAD = 0.10  # (max - min) / median above which the timings are flagged as noisy
FEW_STEPS = 3        # fewer timed steps than this: the spread says little


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


def timing_warnings(stats: StepStats, steps: int) -> tuple[str, ...]:
    """What makes the timings less trustworthy: few timed steps, a wide spread."""
    out = []
    if steps < FEW_STEPS:
        out.append(f"only {steps} timed step(s): the spread says little")
    if stats.spread > NOISY_SPREAD:
        out.append(f"noisy timings: slowest and fastest step differ by {100 * stats.spread:.0f}% "
                   f"of the median ({stats.min_s:.4g}-{stats.max_s:.4g} s)")
    return tuple(out)


# ---------------------------------------------------------------- timing


def time_phases(phases: Sequence[Phase], steps: int, clock) -> list[list[float]]:
    """Run `steps` steps of `phases`; durations[step][phase] in seconds (one sync at the end).
    Python's cyclic garbage collector is run before and kept off while timing (as `timeit` does):
    on the first H100 run the timed steps of host-bound configurations spread by 16-150 % of their
    median, and a collection pause lands on whichever step allocates past its threshold."""
    marks = []
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(steps):
            step_marks = [clock.mark()]
            for phase in phases:
                phase()
                step_marks.append(clock.mark())
            marks.append(step_marks)
        clock.sync()
    finally:
        if was_enabled:
            gc.enable()
    return [[clock.elapsed_s(a, b) for a, b in zip(m, m[1:])] for m in marks]


# ---------------------------------------------------------------- weights


def weights_bytes(model, device: str | None = None) -> int | None:
    """Bytes of parameter storage on `device` (any device when None; each storage once, so tied
    weights count once): the parameters, the quantization constants bitsandbytes keeps beside
    packed weights (4-bit absmax and nested statistics, int8 row scales) and, under ZeRO-3, this
    rank's partitions (`ds_tensor`; an offloaded partition lives on the host and does not count).
    None when nothing is stored."""
    seen, total = set(), 0
    kind = None if device is None else device.split(":")[0]
    for p in model.parameters():
        p = p.to_local() if hasattr(p, "to_local") else p   # FSDP2: this rank's shard (DTensor)
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


@dataclass(frozen=True)
class Measurement:
    """What one `run` measured. Times in seconds over `steps` timed steps (whole step: every phase);
    memory peaks in bytes, each the quantity its name says and None where it was not measured:

    - peak_allocated_bytes, peak_reserved_bytes: the CUDA caching allocator's peaks over the
      timed steps (`max_memory_allocated`, `max_memory_reserved`); None on cpu;
    - device_used_bytes: NVML used memory sampled during the timed steps (None without a probe);
    - host_rss_bytes: this process's resident memory sampled during the timed steps;
    - context_bytes: the CUDA context, measured once when the device was opened (before the run)
      and recorded with it; None when not given;
    - alloc_retries: the allocator's retries (`num_alloc_retries`) during the timed steps; None
      off cuda.
    """

    step_s: float                      # median
    step_s_min: float
    step_s_max: float
    steps: int
    phase_s: tuple[float, ...]         # median of each phase
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    device_used_bytes: int | None = None
    host_rss_bytes: int | None = None
    context_bytes: int | None = None
    alloc_retries: int | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def step_spread(self) -> float:
        """(slowest - fastest) / median of the timed steps."""
        return (self.step_s_max - self.step_s_min) / self.step_s

    def columns(self) -> dict:
        """The record columns this measurement fills (profiler.record; phase_s and warnings are
        not columns)."""
        return {"step_s": self.step_s, "step_s_min": self.step_s_min, "step_s_max": self.step_s_max,
                "step_spread": self.step_spread, "peak_allocated_bytes": self.peak_allocated_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes, "device_used_bytes": self.device_used_bytes,
                "host_rss_bytes": self.host_rss_bytes, "context_bytes": self.context_bytes,
                "alloc_retries": self.alloc_retries}

    def retry_warning(self) -> str:
        """The row's message when the allocator retried during the timed steps, else ''."""
        return retry_warning(self.alloc_retries)


def retry_warning(retries: int | None) -> str:
    """What a positive retry count means for the row, in words ('' for none or not measured)."""
    if not retries:
        return ""
    return (f"allocator retried {retries} time(s) during the timed steps (num_alloc_retries): "
            "near the memory limit, step times are slowed")


def run(phases: Sequence[Phase], warmup: int, steps: int, device: str,
        device_used: Probe | None = None, context_bytes: int | None = None) -> Measurement:
    """Warm up, reset the peaks, time `steps` steps of `phases` on `device` while sampling host
    RSS and `device_used` (an NVML probe, or None), then read the allocator's peaks.
    `context_bytes` (measured when the device was opened) is recorded as given. The allocator's
    cache is emptied before the warm-up; its retries are counted over the timed steps."""
    cuda.empty_cache(device)
    for _ in range(warmup):
        for phase in phases:
            phase()
    cuda.reset_peaks(device)
    retries_before = cuda.alloc_retries(device)
    with PeakSampler({"host_rss_bytes": host.rss_bytes, "device_used_bytes": device_used}) as sampler:
        durations = time_phases(phases, steps, clock_for(device))
    stats = step_stats([sum(d) for d in durations])
    allocator = cuda.peaks(device)
    retries_after = cuda.alloc_retries(device)
    retries = None if retries_before is None or retries_after is None else retries_after - retries_before
    warnings = timing_warnings(stats, len(durations)) + ((retry_warning(retries),) if retries else ())
    return Measurement(
        step_s=stats.median_s, step_s_min=stats.min_s, step_s_max=stats.max_s, steps=len(durations),
        phase_s=tuple(float(statistics.median(d[i] for d in durations)) for i in range(len(phases))),
        peak_allocated_bytes=allocator.allocated_bytes, peak_reserved_bytes=allocator.reserved_bytes,
        device_used_bytes=sampler.peaks["device_used_bytes"], host_rss_bytes=sampler.peaks["host_rss_bytes"],
        context_bytes=context_bytes, alloc_retries=retries, warnings=warnings)


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
        return peak_flops(tables.gpu(gpu_slug), w)
    except InputError:
        return None


def rates(w: Workload, step_s: float, gpu_slug: str) -> dict:
    """tokens_per_s and mfu (None without a GPU table row) of a step of `step_s` seconds."""
    peak = peak_flops_per_s(w, gpu_slug)
    return {"tokens_per_s": tokens_per_step(w) / step_s,
            "mfu": model_flops_per_step(w) / step_s / peak if peak else None}
