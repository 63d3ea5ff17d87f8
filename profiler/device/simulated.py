"""A simulated CUDA device, so the profiler's CUDA path runs end to end in CI without a GPU.

Selected by the environment variable PROFILER_SIMULATED_DEVICE (so child processes inherit it),
holding a JSON object (every key optional):
    {"name": "NVIDIA H100 80GB HBM3", "capacity_bytes": 85899345920, "context_bytes": 536870912,
     "baseline_bytes": 0, "nvml": "per-process" | "none" | "mig", "count": 1}
Under it the child runs its real code with `backend cuda`, but tensors live on the CPU:
- the allocator: a dispatch mode (the tracer's byte accounting, profiler/trace/tracker.py: every
  new storage rounded to 512 B, freed when its storage dies) counts live bytes from CUDA's start;
  past `capacity_bytes` an allocation raises `torch.OutOfMemoryError` ("CUDA out of memory"), as the
  caching allocator does; peaks reset like `reset_peak_memory_stats`; reserved is the high-water
  mark rounded up to the allocator's 2 MiB segments, kept until `empty_cache()` (hardware reserve
  is unknowable here); no retries; what `host_memory()` allocates (the activation offloader's host
  copies) is the host's and not counted;
- events and synchronisation: the wall clock;
- NVML: "per-process" lists this process with reserved + context bytes, "none" lists no process
  (containers: the whole-device delta path), "mig" maps no device (not measured);
- `busy` lists other processes on the device (the idle check), `fault` makes the device stop
  answering after CUDA started (a sticky error);
- several ranks (DeepSpeed's launcher, torchrun): each rank is a process with its own allocator
  and NVML entry; gloo stands in for NCCL and DeepSpeed runs its CPU accelerator
  (profiler.device.cuda `dist_backend`, `deepspeed_environment`);
- rows are labelled backend `simulated` (profiler/record.py) and never fitted (fitting/data.py).
Numbers from it test the code paths, not hardware.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

ENV = "PROFILER_SIMULATED_DEVICE"
SEGMENT = 2 * 2**20          # the caching allocator's large-segment size
NVML_MODES = ("per-process", "none", "mig")


@dataclass(frozen=True)
class Spec:
    name: str = "NVIDIA H100 80GB HBM3"
    capacity_bytes: int = 80 * 2**30
    context_bytes: int = 512 * 2**20
    baseline_bytes: int = 256 * 2**20   # the driver's share before this process (NVML's reading is never 0)
    nvml: str = "per-process"
    count: int = 1
    busy: tuple = ()          # [[pid, bytes], ...]: other processes NVML lists on the device
    fault: str = ""           # "properties": the device stops answering once CUDA started (a sticky error)


@lru_cache(maxsize=4)
def _parse(text: str) -> Spec:
    data = json.loads(text) if text.strip() else {}
    if not isinstance(data, dict) or set(data) - set(Spec.__dataclass_fields__):
        raise ValueError(f"{ENV} must be a JSON object with keys among {', '.join(Spec.__dataclass_fields__)}")
    if "busy" in data:
        data["busy"] = tuple(tuple(p) for p in data["busy"])
    spec = Spec(**data)
    if spec.nvml not in NVML_MODES or spec.capacity_bytes <= 0 or spec.count < 1:
        raise ValueError(f"{ENV}: nvml must be one of {NVML_MODES}, capacity and count positive")
    return spec


def spec() -> Spec | None:
    """The simulated device of this process, or None (a real device, or none)."""
    text = os.environ.get(ENV)
    return None if text is None else _parse(text)


def active() -> bool:
    return spec() is not None


def environment(**overrides) -> dict:
    """The environment variable a test or script sets to simulate a device (JSON text)."""
    return {ENV: json.dumps(overrides)}


# ---- the allocator ----------------------------------------------------------------------------

_ALLOCATOR = None


def _allocator_class():
    import torch
    from torch.utils._pytree import tree_flatten

    from profiler.trace.tracker import LiveBytes

    class SimulatedAllocator(LiveBytes):
        """LiveBytes on real CPU tensors, with a capacity and a resettable peak."""

        def __init__(self, capacity_bytes: int):
            super().__init__()
            self.capacity_bytes = capacity_bytes
            self.peak_since_reset = 0
            self.high_water = 0           # what the caching allocator keeps reserved until empty_cache
            self.host_depth = 0           # inside host_memory(): allocations are the host's

        def _add(self, st, category: str) -> None:
            super()._add(st, category)
            if self.total > self.capacity_bytes:
                asked = st.nbytes()
                self._free(id(st))
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (simulated device). Tried to allocate {asked / 2**20:.2f} MiB; "
                    f"{self.total / 2**30:.2f} GiB allocated of {self.capacity_bytes / 2**30:.2f} GiB")
            self.peak_since_reset = max(self.peak_since_reset, self.total)
            self.high_water = max(self.high_water, self.total)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if self.host_depth:
                return out
            flat, _ = tree_flatten(out)
            for t in flat:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    st = t.untyped_storage()
                    if id(st) not in self._live:
                        self._add(st, "Activation")
            return out

    return SimulatedAllocator


@contextmanager
def host_memory():
    """Allocations made inside are host memory, which the simulated device does not count: the
    activation offloader's copies (profiler.offload.host_copy), pinned host memory on a GPU."""
    if _ALLOCATOR is None:
        yield
        return
    _ALLOCATOR.host_depth += 1
    try:
        yield
    finally:
        _ALLOCATOR.host_depth -= 1


def start() -> None:
    """`torch.cuda.init()` on the simulated device: count every allocation from now on."""
    global _ALLOCATOR
    if _ALLOCATOR is None:
        _ALLOCATOR = _allocator_class()(spec().capacity_bytes)
        _ALLOCATOR.__enter__()


def stop() -> None:
    global _ALLOCATOR
    if _ALLOCATOR is not None:
        _ALLOCATOR.__exit__(None, None, None)
        _ALLOCATOR = None


def allocated_bytes() -> int:
    return _ALLOCATOR.total if _ALLOCATOR is not None else 0


def _segments(nbytes: int) -> int:
    return -(-nbytes // SEGMENT) * SEGMENT


def reset_peaks() -> None:
    if _ALLOCATOR is not None:
        _ALLOCATOR.peak_since_reset = _ALLOCATOR.total


def peaks() -> tuple[int | None, int | None]:
    """(peak allocated, peak reserved) since the last reset; None before CUDA started."""
    if _ALLOCATOR is None:
        return None, None
    peak = _ALLOCATOR.peak_since_reset or None
    return peak, (_segments(peak) if peak else None)


def reserved_bytes() -> int:
    """Reserved now: a caching allocator keeps its high-water segments until empty_cache()."""
    return _segments(_ALLOCATOR.high_water) if _ALLOCATOR is not None else 0


def empty_cache() -> None:
    if _ALLOCATOR is not None:
        _ALLOCATOR.high_water = _ALLOCATOR.total


def clock():
    """Events and synchronisation: the wall clock (profiler.device.host's)."""
    from profiler.device.host import CpuClock

    return CpuClock()


# ---- NVML ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SimulatedNvml:
    """NVML's view of the simulated device: used memory = baseline + reserved + context."""

    index: int
    mode: str

    def used_bytes(self) -> int:
        s = spec()
        return s.baseline_bytes + (reserved_bytes() + s.context_bytes if _ALLOCATOR is not None else 0)

    def process_used_bytes(self, pid: int) -> int | None:
        if self.mode != "per-process" or pid != os.getpid() or _ALLOCATOR is None:
            return None
        return reserved_bytes() + spec().context_bytes

    def processes(self) -> list[tuple[int, int | None]] | None:
        if self.mode != "per-process":
            return None
        others = [(int(pid), int(used) if used else None) for pid, used in spec().busy]
        mine = [(os.getpid(), self.process_used_bytes(os.getpid()))] if _ALLOCATOR is not None else []
        return others + mine


def open_nvml(index: int) -> SimulatedNvml | None:
    s = spec()
    return None if s.nvml == "mig" else SimulatedNvml(index, s.nvml)


def check_fault() -> None:
    """The configured fault, once CUDA has started: an unrecoverable (sticky) CUDA error."""
    if spec().fault == "properties" and _ALLOCATOR is not None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")


def now() -> float:
    return time.perf_counter()
