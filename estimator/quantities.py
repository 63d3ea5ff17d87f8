"""The named quantities a prediction and a measurement share: the one list (docs/design.md section 2).

Each name is a column of the measurement record (profiler.record), a field of the estimate, a
quantity of the comparison (profiler.compare) and of the fit (fitting). Bytes end in `_bytes`,
seconds in `_s`. A quantity that was not measured is None in Python (an empty cell in a file).
"""

from __future__ import annotations

MEMORY_QUANTITIES = ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "context_bytes")
TIME_QUANTITIES = ("step_s", "prefill_s", "decode_token_s", "optimizer_s", "clip_s", "overhead_s",
                   "nosync_microbatch_s", "sync_microbatch_s")
QUANTITIES = MEMORY_QUANTITIES + TIME_QUANTITIES
# What a calibration table is fitted and cross-validated on (fitting.data, fitting.cv).
FITTED_QUANTITIES = MEMORY_QUANTITIES + ("step_s",)


def unit(name: str) -> str:
    """"bytes" or "s" for a quantity name; ValueError for a name that is neither."""
    if name.endswith("_bytes"):
        return "bytes"
    if name.endswith("_s"):
        return "s"
    raise ValueError(f"not a quantity name: {name!r}")
