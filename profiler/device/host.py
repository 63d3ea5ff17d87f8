"""The host: the cpu backend's clock and the process's resident memory."""

from __future__ import annotations

import time


class CpuClock:
    """Wall clock marks (perf_counter seconds)."""

    def mark(self) -> float:
        return time.perf_counter()

    def sync(self) -> None:
        pass

    def elapsed_s(self, start: float, end: float) -> float:
        return end - start


def rss_bytes() -> int:
    """Resident set size of this process (bytes)."""
    import psutil

    return int(psutil.Process().memory_info().rss)
