"""The code that talks to the device: what the profiler reads from the GPU (or from the host that
stands in for it) lives here, so that measuring (profiler.measure) reads memory and time only
through it.

Rooms:
- `cuda`: PyTorch's view of a CUDA device: the caching allocator's peak statistics
  (`max_memory_allocated`, `max_memory_reserved`) and their reset, and the clock of CUDA events.
- `host`: the cpu backend's twins: the wall clock (`time.perf_counter`) and the process's
  resident memory (psutil).
- `nvml`: the driver's view (NVML, what `nvidia-smi` shows): device and per-process used memory,
  the CUDA context's size, and the background sampler that keeps peaks.
- `simulated`: a simulated CUDA device (PROFILER_SIMULATED_DEVICE) for CI without a GPU: the real
  CUDA code paths run, the allocator, events and NVML are simulated (numbers test code, not hardware).

`clock_for(device)` picks the clock of a device string ("cuda", "cuda:1", "cpu"). A reading that
could not be taken is None ("not measured"), never 0. Importing this package imports no torch.
"""

from __future__ import annotations

from profiler.device.cuda import CudaClock, is_cuda
from profiler.device.host import CpuClock


def clock_for(device: str):
    """CUDA events on a cuda device, the wall clock elsewhere."""
    from profiler.device import simulated

    if simulated.active():
        return simulated.clock()
    return CudaClock(device) if is_cuda(device) else CpuClock()


__all__ = ["CpuClock", "CudaClock", "clock_for", "is_cuda"]
