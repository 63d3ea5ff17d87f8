"""PyTorch's view of a CUDA device: the caching allocator's peaks, their reset, its cache release
and retry counter, CUDA-event time.

Every function takes a torch device string. On a device that is not cuda the peaks are None
("not measured", never 0: without a GPU `torch.cuda.max_memory_allocated()` silently returns 0)
and the reset does nothing. torch is imported when a function is called, not on import.
"""

from __future__ import annotations

import os

from dataclasses import dataclass

from profiler.device import simulated


def is_cuda(device: str) -> bool:
    """True for "cuda" and "cuda:N", and for the host device standing in for a simulated one
    (profiler.device.simulated: tensors on the CPU, CUDA's bookkeeping simulated)."""
    return str(device).startswith("cuda") or (str(device) == "cpu" and simulated.active())


def available() -> bool:
    """torch.cuda.is_available(), or a simulated device."""
    if simulated.active():
        return True
    else:  # hardware-only: a real GPU's torch.cuda call
        import torch

        return torch.cuda.is_available()


def placement(device: str) -> str:
    """Where tensors of `device` live: the CPU under a simulated device."""
    return "cpu" if simulated.active() else device


def on_host(backend: str) -> bool:
    """True where the tensors of a run on `backend` (cuda, cpu, trace) live in host memory: every
    backend but cuda, and cuda on a simulated device."""
    return backend != "cuda" or simulated.active()


def dist_backend(backend: str) -> str:
    """The torch.distributed backend between the ranks of a run on `backend`: gloo where tensors
    are host tensors (the cpu backend; the simulated device, where gloo stands in for NCCL), nccl
    between real GPUs."""
    if backend != "cuda":
        return "gloo"
    if simulated.active():  # cuda-only
        return "gloo"       # the simulated device's tensors are CPU tensors: NCCL cannot carry them
    else:  # hardware-only: NCCL between real GPUs
        return "nccl"


def deepspeed_environment(backend: str) -> dict:
    """What DeepSpeed's launcher and ranks need in their environment for `backend`: its CPU
    accelerator where tensors are host tensors (the launcher counts the accelerator's devices
    and sets their visibility before any rank starts); nothing on real GPUs (DeepSpeed picks CUDA)."""
    if backend != "cuda":
        return {"DS_ACCELERATOR": "cpu"}
    if simulated.active():  # cuda-only
        return {"DS_ACCELERATOR": "cpu"}
    else:  # hardware-only: DeepSpeed finds the real GPUs (its CUDA accelerator) by itself
        arch = deepspeed_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
        return {} if arch is None else {"TORCH_CUDA_ARCH_LIST": arch}


def deepspeed_arch_list(value: str | None) -> str | None:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder can read it, or None when it can as it is.
    DeepSpeed 0.19 parses each entry's minor version with int() after dropping "+PTX", so the
    architecture-specific entries torch accepts ("9.0a", "10.0f") end a FusedAdam build in
    "invalid literal for int() with base 10: '0a'" (the first H100 image sets 9.0a: every ZeRO run
    failed there). The suffix letter is dropped (9.0a -> 9.0: FusedAdam uses no sm_90a feature),
    duplicates removed, order and +PTX kept."""
    if not value or not value.strip():
        return None
    out, changed = [], False
    for entry in value.replace(" ", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        base, ptx = (entry[:-4], "+PTX") if entry.endswith("+PTX") else (entry, "")
        major, _, minor = base.partition(".")
        digits = minor.rstrip("abcdefghijklmnopqrstuvwxyz")
        if digits != minor:
            changed = True
        fixed = f"{major}.{digits}{ptx}" if minor else base + ptx
        if fixed not in out:
            out.append(fixed)
        else:
            changed = True
    return ";".join(out) if changed else None


def init(device: str) -> None:
    """Start CUDA on `device` (torch.cuda.init, set_device and a first allocation)."""
    if simulated.active():  # cuda-only
        simulated.start()
    else:  # hardware-only: a real GPU's torch.cuda call
        import torch

        torch.cuda.init()
        torch.cuda.set_device(device)
        torch.empty(1, device=device)


def allocated_now(device: str) -> int:
    """torch.cuda.memory_allocated(device): bytes in live tensors now (the simulated allocator's)."""
    if simulated.active():  # cuda-only
        return simulated.allocated_bytes()
    else:  # hardware-only: a real GPU's torch.cuda call
        import torch

        return int(torch.cuda.memory_allocated(device))


def reserved_now(device: str) -> int:
    """torch.cuda.memory_reserved(device) (the simulated allocator's segments)."""
    if simulated.active():  # cuda-only
        return simulated.reserved_bytes()
    else:  # hardware-only: a real GPU's torch.cuda call
        import torch

        return int(torch.cuda.memory_reserved(device))


def properties(device: str) -> tuple[str, int]:
    """(name, total memory in bytes) of the device."""
    s = simulated.spec()
    if s is not None:  # cuda-only
        simulated.check_fault()
        return f"{s.name} (simulated)", s.capacity_bytes
    else:  # hardware-only: a real GPU's torch.cuda call
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        return props.name, int(props.total_memory)


@dataclass(frozen=True)
class AllocatorPeaks:
    """The caching allocator's peaks since the last reset (bytes; None: not measured)."""

    allocated_bytes: int | None
    reserved_bytes: int | None


def synchronize(device: str) -> None:
    """Wait for the device's queued work (cuda only; the simulated device runs eagerly)."""
    if simulated.active():  # cuda-only
        simulated.check_fault()
    elif is_cuda(device):  # hardware-only: a real GPU's torch.cuda call
        import torch

        torch.cuda.synchronize(device)


def backend(device: str) -> str:
    """The `backend` column of a row measured on `device`: cuda, simulated or cpu."""
    if simulated.active():
        return "simulated"
    return "cuda" if is_cuda(device) else "cpu"


def reset_peaks(device: str) -> None:
    """Synchronize and reset the allocator's peak statistics (cuda only; no-op elsewhere)."""
    if simulated.active():  # cuda-only
        simulated.reset_peaks()
    elif is_cuda(device):  # hardware-only: a real GPU's torch.cuda call
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peaks(device: str) -> AllocatorPeaks:
    """`max_memory_allocated` and `max_memory_reserved` since the last reset; None off cuda (and
    for a 0 reading, which means nothing was measured)."""
    if simulated.active():  # cuda-only
        return AllocatorPeaks(*simulated.peaks())
    if not is_cuda(device):
        return AllocatorPeaks(None, None)
    else:  # hardware-only: a real GPU's torch.cuda call
        import torch

        return AllocatorPeaks(int(torch.cuda.max_memory_allocated(device)) or None,
                              int(torch.cuda.max_memory_reserved(device)) or None)


def empty_cache(device: str) -> None:
    """Give the caching allocator's unused blocks back to the driver (cuda only; no-op elsewhere),
    so that blocks cached while the model was built do not stand in the peak reserved."""
    if simulated.active():  # cuda-only
        simulated.empty_cache()
    elif is_cuda(device):  # hardware-only: a real GPU's torch.cuda call
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def alloc_retries(device: str) -> int | None:
    """The allocator's `num_alloc_retries` counter (cudaMalloc failures it answered by freeing its
    cache and trying again: each one stalls the step); None off cuda."""
    if not is_cuda(device):
        return None
    if simulated.active():  # cuda-only
        return 0
    else:  # hardware-only: a real GPU's torch.cuda call
        import torch

        return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


class CudaClock:  # hardware-only: CUDA events on a real stream
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
