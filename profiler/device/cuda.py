"""PyTorch's view of a CUDA device: the caching allocator's peaks, their reset, its cache release
and retry counter, CUDA-event time.

Every function takes a torch device string. On a device that is not cuda the peaks are None
("not measured", never 0: without a GPU `torch.cuda.max_memory_allocated()` silently returns 0)
and the reset does nothing. torch is imported when a function is called, not on import.
"""

from __future__ import annotations

from dataclasses import dataclass


def is_cuda(device: str) -> bool:
    """True for "cuda" and "cuda:N"."""
    return str(device).startswith("cuda")


@dataclass(frozen=True)
class AllocatorPeaks:
    """The caching allocator's peaks since the last reset (bytes; None: not measured)."""

    allocated_bytes: int | None
    reserved_bytes: int | None


def reset_peaks(device: str) -> None:
    """Synchronize and reset the allocator's peak statistics (cuda only; no-op elsewhere)."""
    if is_cuda(device):
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peaks(device: str) -> AllocatorPeaks:
    """`max_memory_allocated` and `max_memory_reserved` since the last reset; None off cuda (and
    for a 0 reading, which means nothing was measured)."""
    if not is_cuda(device):
        return AllocatorPeaks(None, None)
    import torch

    return AllocatorPeaks(int(torch.cuda.max_memory_allocated(device)) or None,
                          int(torch.cuda.max_memory_reserved(device)) or None)


def empty_cache(device: str) -> None:
    """Give the caching allocator's unused blocks back to the driver (cuda only; no-op elsewhere),
    so that blocks cached while the model was built do not stand in the peak reserved."""
    if is_cuda(device):
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def alloc_retries(device: str) -> int | None:
    """The allocator's `num_alloc_retries` counter (cudaMalloc failures it answered by freeing its
    cache and trying again: each one stalls the step); None off cuda."""
    if not is_cuda(device):
        return None
    import torch

    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


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
