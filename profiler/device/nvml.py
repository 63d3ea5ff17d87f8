"""NVML: device memory as `nvidia-smi` sees it, and a background thread that keeps the peaks.

- `open_device(cuda_index)`: an `NvmlDevice` for a torch CUDA index (CUDA_VISIBLE_DEVICES taken
  into account), or None where NVML is unavailable (no library, no driver: "not measured").
- `used_probe(device)`: what to sample for `device_used_bytes`: this process's used memory
  (`nvmlDeviceGetComputeRunningProcesses`, source "nvml-process") where NVML lists our pid
  with a size, else the whole device's used memory ("nvml-device"; containers often hide pids).
- `context_bytes(device, init)`: device used memory after `init()` minus before it, less what
  PyTorch's allocator holds after `init` (so the CUDA context alone, docs/design.md section 2).
- `PeakSampler`: a thread calling probes every `interval_s` (5 ms) and keeping each maximum.

Bytes are int; a value that could not be read is None, never 0.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable

SAMPLE_INTERVAL_S = 0.005
SOURCE_PROCESS = "nvml-process"
SOURCE_DEVICE = "nvml-device"

Probe = Callable[[], "int | None"]


@dataclass(frozen=True)
class NvmlDevice:
    """An NVML device handle with the two readings the profiler needs."""

    handle: object
    index: int  # NVML's index (may differ from torch's under CUDA_VISIBLE_DEVICES)

    def used_bytes(self) -> int:
        """Used memory of the whole device (all processes, contexts included), bytes."""
        import pynvml

        return int(pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def process_used_bytes(self, pid: int) -> int | None:
        """Used memory of process `pid` on this device, bytes; None where NVML does not list it
        (another pid namespace) or cannot say (usedGpuMemory unavailable)."""
        import pynvml

        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except pynvml.NVMLError:
            return None
        for proc in procs:
            used = getattr(proc, "usedGpuMemory", None)
            if proc.pid == pid and isinstance(used, int) and used > 0:
                return used
        return None


def nvml_index(cuda_index: int) -> int:
    """NVML index of torch's CUDA device `cuda_index`, without initialising CUDA."""
    try:
        import torch

        return int(torch.cuda._get_nvml_device_index(cuda_index))
    except Exception:  # private torch helper missing or CUDA_VISIBLE_DEVICES unparsable
        return cuda_index


def open_device(cuda_index: int) -> NvmlDevice | None:
    """The NVML device behind torch's `cuda:cuda_index`, or None where NVML cannot be used."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = nvml_index(cuda_index)
        return NvmlDevice(pynvml.nvmlDeviceGetHandleByIndex(index), index)
    except Exception:  # pynvml missing, NVMLError_LibraryNotFound, DriverNotLoaded, bad index
        return None


def used_probe(device: NvmlDevice | None, pid: int | None = None) -> tuple[Probe | None, str]:
    """(probe, source) for device_used_bytes: per-process if NVML reports this process now,
    else device-wide; (None, "") without NVML. Call after CUDA is initialised (the process
    appears in NVML's list only once it has a context)."""
    if device is None:
        return None, ""
    pid = os.getpid() if pid is None else pid
    if device.process_used_bytes(pid) is not None:
        return (lambda: device.process_used_bytes(pid)), SOURCE_PROCESS
    return device.used_bytes, SOURCE_DEVICE


def context_bytes(device: NvmlDevice | None, init: Callable[[], None],
                  allocator_bytes: Callable[[], int]) -> int | None:
    """Device memory the CUDA context takes: NVML used after `init()` minus before, minus
    `allocator_bytes()` (what PyTorch reserved during `init`, e.g. a tiny tensor's 2 MiB segment).
    `init` runs in any case; None without NVML or when the difference is not positive (another
    process freed memory meanwhile)."""
    before = _safe(device.used_bytes) if device is not None else None
    init()
    after = _safe(device.used_bytes) if device is not None else None
    if before is None or after is None:
        return None
    delta = after - before - int(allocator_bytes())
    return delta if delta > 0 else None


def _safe(probe: Probe) -> int | None:
    try:
        value = probe()
    except Exception:  # a failing reading is "not measured", it must not kill the run
        return None
    return value if isinstance(value, int) and value > 0 else None


class PeakSampler:
    """Background thread keeping the maximum of each probe, sampled every `interval_s` seconds
    (and once on entry and once on exit, so a run shorter than the interval still has a sample).

    Use as a context manager; `peaks[name]` is the largest positive int a probe returned, or None
    if it never returned one. A probe that raises or returns None/0 contributes nothing.
    """

    def __init__(self, probes: dict[str, Probe | None], interval_s: float = SAMPLE_INTERVAL_S):
        self.probes = {name: p for name, p in probes.items() if p is not None}
        self.peaks: dict[str, int | None] = {name: None for name in probes}
        self.samples = 0
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)

    def sample(self) -> None:
        """Read every probe once and update the peaks."""
        for name, probe in self.probes.items():
            value = _safe(probe)
            if value is not None and (self.peaks[name] is None or value > self.peaks[name]):
                self.peaks[name] = value
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "PeakSampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
