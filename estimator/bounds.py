"""The safe upper bound every memory answer carries, and the three-way verdict (one owner).

With a calibration table whose validation measured them, each quantity's bound is the calibrated
prediction times the factor that covered its held-out measurements (`upper_bound` of the table,
fitting/cv.py); without one, the stated default of estimator/data/overheads.csv
(`uncalibrated_bound_factor`, `uncalibrated_bound_coverage`). A workload far outside the table's
data gets the bound widened (`outside_range_bound_widening`). The verdict:
- "fits": the bound of device used memory fits the GPU;
- "tight": the point estimate fits, the bound does not (by `short_bytes`);
- "does not fit": the point estimate does not fit.
Planners (estimator/planner.py) plan on the bound.
"""

from __future__ import annotations

import math

from estimator.defaults import overhead
from estimator.memory import MemoryBreakdown

BOUND_QUANTITIES = ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes")
VERDICTS = ("fits", "tight", "does not fit")


def safe_bound(memory: MemoryBreakdown, calibration, outside_data: bool) -> dict:
    """{"peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "coverage", "source",
    "factors"}: bytes are int (rounded up)."""
    rows = {q: calibration.upper_bound(q) for q in BOUND_QUANTITIES}
    if all(rows.values()):
        factors = {q: float(rows[q]["factor"]) for q in BOUND_QUANTITIES}
        coverage = min(float(rows[q]["coverage"]) for q in BOUND_QUANTITIES)
        source = (f"calibration {calibration.path}: the factor that covered the held-out measurements "
                  f"of its validation")
    else:
        factor = float(overhead("uncalibrated_bound_factor"))
        factors = {q: factor for q in BOUND_QUANTITIES}
        coverage = float(overhead("uncalibrated_bound_coverage"))
        source = (f"uncalibrated default: point x {factor:g} (estimator/data/overheads.csv "
                  f"uncalibrated_bound_factor)")
    if outside_data and all(rows.values()):
        widen = float(overhead("outside_range_bound_widening"))
        factors = {q: f * widen for q, f in factors.items()}
        source += f"; widened x {widen:g}: the workload lies far outside the table's data"
    out = {q: int(math.ceil(getattr(memory, q) * factors[q])) for q in BOUND_QUANTITIES}
    out.update(coverage=coverage, source=source, factors=factors)
    return out


def verdict(point_bytes: int, bound_bytes: int, capacity_bytes: int) -> str:
    if point_bytes > capacity_bytes:
        return "does not fit"
    return "fits" if bound_bytes <= capacity_bytes else "tight"
