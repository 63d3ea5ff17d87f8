"""The safe upper bound every memory answer carries, and the three-way verdict (one owner).

A memory prediction is not uncertain in proportion to its total: the model states it counts
(weights, quantized bases, optimizer states, master weights, ZeRO buffers, the KV cache, and in
the optimizer step the gradients of known parameters) are exact; what is uncertain is the rest
of each peak (`uncertain_bytes`): the working set (saved activations, logits and loss, casts,
workspaces, temporaries), the allocator reserve, and outside the allocator the CUDA context,
NCCL and non-PyTorch bytes, plus a stated floor for allocations the estimator has no term for
(`bound_uncertain_floor_bytes`). The bound of each quantity is

    safe = point + k x uncertain part

with k the scale that covered the held-out measurements of a calibration table
(`upper_bound[q].uncertain_scale`, fitting/published.py, nested leave-one-source-out), or the
stated default of estimator/data/overheads.csv (`uncalibrated_bound_uncertain_scale`, its coverage
`uncalibrated_bound_coverage` measured on the published rows). A table row without
`uncertain_scale` (a per-GPU table of fitting/cv.py whose factor covered better) keeps the older
form, point x `factor`.
A workload far outside the table's data gets the bound widened (`outside_range_bound_widening`).
The verdict:
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


def exact_bytes(memory: MemoryBreakdown) -> int:
    """The bytes of a peak the estimator counts exactly: model states of known size, the cuBLAS
    workspaces of the GPU, and in the forward/backward the saved copies of weights (GPTQ LoRA)."""
    exact = (memory.weights_bytes + memory.optimizer_states_bytes + memory.master_weights_bytes
             + memory.zero_buffers_bytes + memory.kv_cache_bytes + memory.blas_workspace_bytes)
    if memory.peak_phase == "optimizer step":     # every gradient exists then, of known size
        exact += memory.gradients_bytes
    else:                                          # saved weight copies (GPTQ LoRA), of known size
        exact += memory.weight_copies_bytes
    return exact


def uncertain_bytes(memory: MemoryBreakdown, floor_bytes: int | None = None) -> dict:
    """{quantity: bytes} of each peak that is not counted exactly, plus the floor. Device used
    memory's exact part also holds the paged optimizer states (unified memory, known size)."""
    floor = int(overhead("bound_uncertain_floor_bytes")) if floor_bytes is None else int(floor_bytes)
    # activations the estimate puts in host memory (--activation-offload) may stay on the device:
    # TRL 0.25.0-1.7.x keyed an offloaded storage by its address to the end of the forward, so a
    # tensor allocated where a freed offloaded one was stayed (13-44% of them traced and measured,
    # estimator.memory.legacy_offload_share; fixed in TRL 1.8.0), and which TRL runs is not an input
    floor += memory.offloaded_activations_bytes
    exact = exact_bytes(memory)
    out = {q: max(0, getattr(memory, q) - exact) + floor for q in BOUND_QUANTITIES}
    out["device_used_bytes"] = max(0, memory.device_used_bytes - exact - memory.paged_optimizer_bytes) + floor
    return out


def bound_value(point: float, uncertain: float, scale: float) -> int:
    """point + scale x uncertain part, rounded up to a whole byte."""
    return int(math.ceil(point + scale * uncertain))


def table_bound(memory: MemoryBreakdown, quantity: str, row: dict) -> tuple[int, dict]:
    """(bytes, terms) of one quantity's bound from a table's `upper_bound` row: point + k x
    uncertain part when the row has `uncertain_scale`, else point x `factor`."""
    point = getattr(memory, quantity)
    if row.get("uncertain_scale") is not None:
        floor = int(row.get("uncertain_floor_bytes", overhead("bound_uncertain_floor_bytes")))
        u = uncertain_bytes(memory, floor)[quantity]
        scale = float(row["uncertain_scale"])
        return bound_value(point, u, scale), {"uncertain_scale": scale, "uncertain_bytes": u}
    return int(math.ceil(point * float(row["factor"]))), {"factor": float(row["factor"])}


def safe_bound(memory: MemoryBreakdown, calibration, outside_data: bool) -> dict:
    """{"peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "coverage", "source",
    "terms"}: bytes are int (rounded up); `terms` says per quantity how the bound was formed."""
    rows = {q: calibration.upper_bound(q) for q in BOUND_QUANTITIES}
    out: dict = {}
    terms: dict = {}
    if all(rows.values()):
        coverage = min(float(rows[q]["coverage"]) for q in BOUND_QUANTITIES)
        for q in BOUND_QUANTITIES:
            out[q], terms[q] = table_bound(memory, q, rows[q])
        forms = sorted({"point + k x uncertain part" if "uncertain_scale" in t else "point x factor"
                        for t in terms.values()})
        source = (f"calibration {calibration.path}: {' / '.join(forms)}, the scale that covered the held-out "
                  f"measurements of its validation")
    else:
        scale = float(overhead("uncalibrated_bound_uncertain_scale"))
        u = uncertain_bytes(memory)
        for q in BOUND_QUANTITIES:
            out[q] = bound_value(getattr(memory, q), u[q], scale)
            terms[q] = {"uncertain_scale": scale, "uncertain_bytes": u[q]}
        coverage = float(overhead("uncalibrated_bound_coverage"))
        source = (f"uncalibrated default: point + {scale:g} x uncertain part (estimator/data/overheads.csv "
                  f"uncalibrated_bound_uncertain_scale)")
    if outside_data and all(rows.values()):
        widen = float(overhead("outside_range_bound_widening"))
        out = {q: int(math.ceil(v * widen)) for q, v in out.items()}
        source += f"; widened x {widen:g}: the workload lies far outside the table's data"
    out.update(coverage=coverage, source=source, terms=terms)
    return out


def verdict(point_bytes: int, bound_bytes: int, capacity_bytes: int) -> str:
    if point_bytes > capacity_bytes:
        return "does not fit"
    return "fits" if bound_bytes <= capacity_bytes else "tight"
