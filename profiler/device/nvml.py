"""NVML: device memory as `nvidia-smi` sees it, and a background thread that keeps the peaks.

- `open_device(cuda_index)`: an `NvmlDevice` for a torch CUDA index (CUDA_VISIBLE_DEVICES taken
  into account), or None where NVML is unavailable (no library, no driver) or where the index
  cannot be mapped to an NVML device with certainty (MIG instances, an unresolvable UUID, a MIG-
  enabled GPU): "not measured" rather than a reading of another device.
- `used_probe(device, baseline_bytes=...)`: what to sample for `device_used_bytes`: this
  process's used memory (`nvmlDeviceGetComputeRunningProcesses`, source "nvml-process") where
  NVML lists our pid with a size, else the whole device's used memory minus `baseline_bytes`,
  the reading taken before this process initialised CUDA ("nvml-device-delta"; containers often
  hide pids). Rows written before the delta existed say "nvml-device": whole-device memory,
  driver reserve and other tenants included, a different quantity.
- `init_reading(device, init)`: the device's used memory before `init()` (the baseline) and the
  CUDA context: used after minus before, less what PyTorch's allocator holds after `init`
  (docs/design.md section 2); `context_bytes` is its second half.
- `busy_processes(device)` / `wait_until_idle(device)`: other processes holding the device (None
  when NVML cannot say), checked before a child measures.
- `PeakSampler`: a thread calling probes every `interval_s` (20 ms: NVML calls must not compete
  with launch-bound steps) and keeping each maximum.

Bytes are int; a value that could not be read is None, never 0.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

SAMPLE_INTERVAL_S = 0.02
JOIN_TIMEOUT_S = 5.0      # a sampler stuck in an NVML call is abandoned (daemon thread), not waited on
# how long a child waits for other processes to leave the device (PROFILER_IDLE_WAIT_S overrides)
IDLE_WAIT_S = float(os.environ.get("PROFILER_IDLE_WAIT_S", "30"))
IDLE_POLL_S = 1.0
# an idle GPU's used memory (the driver's reserve) is well under this (PROFILER_IDLE_USED_BYTES overrides)
IDLE_USED_BYTES = int(os.environ.get("PROFILER_IDLE_USED_BYTES", str(2**30)))
SOURCE_PROCESS = "nvml-process"
SOURCE_DEVICE_DELTA = "nvml-device-delta"
SOURCE_DEVICE = "nvml-device"  # legacy rows only: whole-device used memory, never written now

Probe = Callable[[], "int | None"]


@dataclass(frozen=True)
class NvmlDevice:  # hardware-only: pynvml reads a real driver
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
        procs = self.processes()
        for proc_pid, used in procs or ():
            if proc_pid == pid and used is not None:
                return used
        return None

    def processes(self) -> list[tuple[int, int | None]] | None:
        """(pid, used bytes or None) of every compute process NVML lists on this device; None
        when NVML cannot say (any pynvml failure: NVMLError, and NVMLLibraryMismatchError, which
        is not an NVMLError, from a driver older than the bindings)."""
        try:
            import pynvml

            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:
            return None
        out = []
        for proc in procs:
            used = getattr(proc, "usedGpuMemory", None)
            out.append((int(proc.pid), used if isinstance(used, int) and used > 0 else None))
        return out


def nvml_index(cuda_index: int) -> int | None:  # hardware-only: pynvml reads a real driver
    """NVML index of torch's CUDA device `cuda_index`, without initialising CUDA; None when it
    cannot be told: a MIG instance in CUDA_VISIBLE_DEVICES, UUIDs NVML cannot resolve, an
    index outside the visible list (reading GPU `cuda_index` instead would measure another
    device)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return cuda_index
    if "MIG" in visible.upper():
        return None
    try:
        import torch

        return int(torch.cuda._get_nvml_device_index(cuda_index))
    except Exception:  # private torch helper missing, UUIDs unresolved, index not visible
        return None


def _mig_enabled(handle) -> bool:  # hardware-only: pynvml reads a real driver
    """True when the GPU runs MIG instances (its whole-device memory is not this instance's)."""
    try:
        import pynvml

        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        return bool(current)
    except Exception:  # not supported (no MIG on this GPU), old driver
        return False


def open_device(cuda_index: int) -> NvmlDevice | None:
    """The NVML device behind torch's `cuda:cuda_index`, or None where NVML cannot be used or the
    device cannot be identified (see `nvml_index`; a MIG-enabled GPU)."""
    from profiler.device import simulated

    if simulated.active():  # cuda-only
        return simulated.open_nvml(cuda_index)
    try:  # hardware-only: pynvml reads a real driver
        import pynvml

        pynvml.nvmlInit()
        index = nvml_index(cuda_index)
        if index is None:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return None if _mig_enabled(handle) else NvmlDevice(handle, index)
    except Exception:  # pynvml missing, NVMLError_LibraryNotFound, DriverNotLoaded, bad index
        return None


def busy_processes(device: NvmlDevice | None, exclude: set[int] | frozenset = frozenset()  # cuda-only
                   ) -> list[tuple[int, int | None]] | None:
    """Processes other than `exclude` (and this one) that NVML lists on the device; None when
    NVML cannot say (no device, a failing call). Where NVML lists no processes at all (containers),
    the device counts as idle when its used memory is back at rest (at most IDLE_USED_BYTES before
    this process starts CUDA); otherwise it is busy with an unnamed holder (pid 0)."""
    if device is None:
        return None
    procs = device.processes()
    if not procs:         # none listed (idle, or a container's other pid namespace) or cannot say
        used = _safe(device.used_bytes)
        if used is None:
            return None
        return [] if used <= IDLE_USED_BYTES else [(0, used)]
    skip = set(exclude) | {os.getpid()}
    return [(pid, used) for pid, used in procs if pid not in skip]



def wait_until_idle(device: NvmlDevice | None, exclude: set[int] | frozenset = frozenset(),  # cuda-only
                    timeout_s: float = IDLE_WAIT_S, poll_s: float = IDLE_POLL_S,
                    sleep: Callable[[float], None] = time.sleep,
                    clock: Callable[[], float] = time.monotonic) -> list[tuple[int, int | None]] | None:
    """Wait up to `timeout_s` for `busy_processes` to be empty (a killed run's process may take a
    moment to free the device). Returns what still holds it: [] idle, a list busy, None unknown."""
    deadline = clock() + timeout_s
    while True:
        busy = busy_processes(device, exclude)
        if not busy or clock() >= deadline:
            return busy
        sleep(poll_s)


def describe_busy(busy: list[tuple[int, int | None]]) -> str:  # cuda-only
    """'pid 123 (2048 MiB), pid 456' for a message; pid 0: memory in use with no process listed."""
    return ", ".join((f"pid {pid}" if pid else "processes NVML does not list")
                     + (f" ({used / 2**20:.0f} MiB)" if used else "") for pid, used in busy)


def used_probe(device: NvmlDevice | None, pid: int | None = None,  # cuda-only
               baseline_bytes: int | None = None) -> tuple[Probe | None, str]:
    """(probe, source) for device_used_bytes: this process's memory if NVML reports this process
    now ("nvml-process"), else the whole device's used memory minus `baseline_bytes` (read before
    this process initialised CUDA: "nvml-device-delta"); (None, "") without NVML or, in the
    second case, without a baseline (whole-device memory is another quantity: not recorded).
    Call after CUDA is initialised (the process appears in NVML's list only once it has a
    context)."""
    if device is None:
        return None, ""
    pid = os.getpid() if pid is None else pid
    if device.process_used_bytes(pid) is not None:
        return (lambda: device.process_used_bytes(pid)), SOURCE_PROCESS
    if baseline_bytes is None:
        return None, ""
    return (lambda: device.used_bytes() - baseline_bytes), SOURCE_DEVICE_DELTA


@dataclass(frozen=True)
class InitReading:
    """NVML around CUDA initialisation: the device's used memory before it (bytes) and the
    context's size; None where not measured."""

    baseline_bytes: int | None
    context_bytes: int | None


def init_reading(device: NvmlDevice | None, init: Callable[[], None],  # cuda-only
                 allocator_bytes: Callable[[], int]) -> InitReading:
    """Device used memory before `init()` (the baseline of "nvml-device-delta") and the CUDA
    context: used after `init()` minus before, minus `allocator_bytes()` (what PyTorch reserved
    during `init`, e.g. a tiny tensor's 2 MiB segment). `init` runs in any case; None without
    NVML, and a context of None when the difference is not positive (another process freed
    memory meanwhile)."""
    before = _safe(device.used_bytes) if device is not None else None
    init()
    after = _safe(device.used_bytes) if device is not None else None
    if before is None or after is None:
        return InitReading(before, None)
    delta = after - before - int(allocator_bytes())
    return InitReading(before, delta if delta > 0 else None)


def context_bytes(device: NvmlDevice | None, init: Callable[[], None],
                  allocator_bytes: Callable[[], int]) -> int | None:
    """The CUDA context's device memory (`init_reading`'s second half)."""
    return init_reading(device, init, allocator_bytes).context_bytes


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
        self._thread.join(timeout=JOIN_TIMEOUT_S)
        if not self._thread.is_alive():  # a thread stuck in NVML: its probe would hang here too
            self.sample()
