"""Renderings of the estimator's answers: each function takes the library's result objects as
explicit parameters and returns a `Result`: `.data` (what `--json` prints) and `.text` (the table).

scripts/estimate.py parses its flags (estimator/flags.py), asks estimator.api / estimator.planner,
and prints one of these. Nothing here reads command-line arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator import tables
from estimator.api import Estimate
from estimator.params import count_params
from estimator.planner import PLANNED_ON, Budget, FitRow
from estimator.units import GiB
from estimator.workload import Workload


@dataclass(frozen=True)
class Result:
    data: dict
    text: str


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:8.2f} GiB"


def estimate(result: Estimate, advice: list[str]) -> Result:
    """One estimate with the changes that would make it fit (planner.advice)."""
    data = result.to_dict()
    data["advice"] = list(advice)
    return Result(data, render_estimate(result, data["advice"]))


def _safe_lines(result: Estimate) -> list[str]:
    """The safe bound (what the planners plan on) and, when tight, by how much it misses."""
    safe = result.safe
    lines = [f"  {'safe bound (device used)':<28}{_gib(safe['device_used_bytes'])}   covers "
             f"{safe['coverage']:.0%}; {safe['source']}"]
    if result.verdict == "tight":
        short = safe["device_used_bytes"] - result.gpu.memory_bytes
        lines.append(f"  tight: the estimate fits, its safe bound exceeds the GPU by {_gib(short).strip()}")
    return lines


def _calibration_lines(result: Estimate) -> list[str]:
    """The table's extra bytes (so components add up), its safe upper bound and its warnings."""
    lines = []
    for key in ("allocated_constant_bytes", "non_pytorch_bytes"):
        value = result.corrections.get(key, {}).get("value")
        if value:
            lines.append(f"  {key[:-6]:<28}{_gib(value)}   (calibrated)")
    bound = result.upper_bound
    if bound:
        # the table's own device-used bound, beside the safe bound above (which takes the least coverage of
        # its three quantities, and is widened outside the table's data): named so the two never read as rivals
        inside = bound["within_data_range"]
        note = "" if inside else "; workload outside the table's data: coverage not measured"
        lines.append(f"  table's device-used bound{'' if inside else ' before widening'}: "
                     f"{_gib(bound['device_used_bytes']).strip()}"
                     f" (covered {bound['coverage']:.0%} of held-out measurements{note})")
    rng = result.calibration.data_range(result.workload, count_params(result.workload.model).total)
    if rng:
        parts = []
        for axis, label, fmt in (("params_total", "parameters", lambda v: f"{v / 1e9:.2f}B"),
                                 ("tokens", "tokens per micro-batch", lambda v: f"{int(v)}")):
            if axis in rng:
                r = rng[axis]
                where = "inside" if r["outside_factor"] == 1.0 else f"{r['outside_factor']:.1f}x outside"
                parts.append(f"{label} {fmt(r['min'])}-{fmt(r['max'])} (this: {fmt(r['value'])}, {where})")
        if parts:
            lines.append("  data range: " + "; ".join(parts))
    lines += [f"  warning: {text}" for text in result.warnings]
    return lines


def render_estimate(result: Estimate, tips: list[str]) -> str:
    m, w, t = result.memory, result.workload, result.time
    lines = [f"{w.model.name}  {w.method}  {w.precision}  batch {w.batch} x seq {w.seq}"
             f"{'  +' + str(w.new_tokens) + ' new' if w.new_tokens else ''}  on {result.gpu.name}"
             f"  ({w.world_size} GPU{'s' if w.world_size > 1 else ''})"]
    if getattr(w.model, "card_path", ""):   # structure card (estimator/cards.py)
        lines.append(f"model: structure traced ({w.model.model_type} has no mapping; card {w.model.card_path})")
    lines += [f"regime: {note}" for note in result.regime_notes]
    lines += ["", "memory per GPU"]
    for name, value in m.to_dict().items():
        if name.endswith("_bytes") and value and not name.startswith(("peak_", "device_used", "host", "decode_peak")):
            lines.append(f"  {name[:-6]:<28}{_gib(value)}")
    lines += ["",
              f"  {'peak allocated':<28}{_gib(m.peak_allocated_bytes)}   (raw {_gib(result.raw_memory.peak_allocated_bytes).strip()}"
              + (f"; the decode alone {_gib(m.decode_peak_allocated_bytes).strip()})" if m.decode_peak_allocated_bytes else ")"),
              f"  {'peak reserved':<28}{_gib(m.peak_reserved_bytes)}",
              f"  {'device used (nvidia-smi)':<28}{_gib(m.device_used_bytes)}   of {_gib(result.gpu.memory_bytes).strip()}"
              f"  -> {result.verdict.upper()}"]
    lines += _safe_lines(result)
    if m.host_bytes:
        lines.append(f"  {'host (offload)':<28}{_gib(m.host_bytes)}")
    top = ", ".join(name[:-6] for name, _ in result.dominant())
    lines += [f"  dominated by: {top} (peak in {m.peak_phase})", ""]
    if w.training:
        lines += _train_time_lines(t)
    else:
        lines.append(f"time  prefill {t.prefill_s:.3f} s   decode {t.decode_s_per_token * 1e3:.2f} ms/token"
                     f" (launch floor {t.decode_floor_s_per_token * 1e3:.2f}, {'compiled' if w.compiled else 'eager'})"
                     f"   decode {t.decode_tokens_per_s:,.0f} tokens/s   end to end {t.tokens_per_s:,.0f} tokens/s")
    if result.job:
        j = result.job
        cost = (j.price_row if j.cost_usd is None
                else f"${j.cost_usd:,.2f} at ${j.usd_per_gpu_hour:.2f}/GPU-h ({j.price_row})")
        lines.append(f"job   {j.steps} steps   {j.job_s / 3600:.2f} h   {j.gpu_hours:.1f} GPU-h   {cost}")
    cal = result.calibration.path or "none (uncalibrated defaults)"
    lines.append(f"calibration: {cal}")
    lines += _calibration_lines(result)
    if tips:
        lines.append(("would fit with its safe bound: " if result.verdict == "tight" else "would fit with: ")
                     + "; ".join(tips))
    elif not result.safe_fits:
        lines.append("no single change tried makes it fit; try a larger GPU or --fit-gpus")
    return "\n".join(lines)


def _train_time_lines(t) -> list[str]:
    """Step = compute + exposed communication + optimizer step + gradient clipping + overhead (+ the
    activation offloading copies compute does not hide), and why comm is hidden or not."""
    copies = f" + offload copies {t.activation_offload_s:.3f}" if t.activation_offload_s else ""
    lines = [f"time  step {t.step_s:.3f} s = compute {t.compute_s:.3f} + exposed comm {t.exposed_comm_s:.3f}"
             f" + optimizer {t.optimizer_s:.3f} + clip {t.clip_s:.3f} + overhead {t.overhead_s:.3f}{copies}"
             f"   {t.tokens_per_s:,.0f} tokens/s"
             f"   MFU {t.mfu:.2f} (HFU {t.hfu:.2f})"]
    if t.launch_bound:
        lines.append(f"      launch-bound: the kernels are shorter than the host takes to dispatch them; compute is "
                     f"the operators dispatched x host seconds each ({t.launch_floor_s:.3f} s per step, estimator/ops.py)")
    if t.comm_s:
        hidden = t.comm_s - t.exposed_comm_s
        why = ("communication-bound: the link needs longer than the compute it hides behind"
               if t.comm_bound else "prefetch hides it behind compute except the first and last layers")
        lines.append(f"      comm {t.comm_s:.3f} s per step in all, {hidden:.3f} s hidden: {why}")
    return lines


def fit_gpus(w: Workload, rows: list[FitRow]) -> Result:
    """planner.fit_table: for every GPU, how many are needed."""
    data = {"workload": w.id, "gpus": [r.to_dict() for r in rows], "planned_on": PLANNED_ON}
    lines = [f"{w.id}", f"GPUs needed: planned on {PLANNED_ON}", f"{'gpu':<16}{'needed':>8}{'used/GPU':>14}{'memory':>14}{'step s':>10}{'$/GPU-h':>9}  price row"]
    for r in rows:
        need = "-" if r.gpus_needed is None else str(r.gpus_needed)
        step = "-" if r.step_s is None else f"{r.step_s:.3f}"
        usd = "-" if r.usd_per_gpu_hour is None else f"{r.usd_per_gpu_hour:.2f}"
        lines.append(f"{r.gpu:<16}{need:>8}{_gib(r.device_used_bytes):>14}{_gib(r.memory_bytes):>14}"
                     f"{step:>10}{usd:>9}  {r.price_row}")
    return Result(data, "\n".join(lines))


def largest(w: Workload, gpu: str, field: str, value: int, advice: list[str] = ()) -> Result:
    """planner.max_batch (field "batch") or planner.max_seq (field "seq") on one GPU of `gpu`; when
    even 1 does not fit, `advice` (planner.advice at 1) says what would make it fit."""
    label = {"batch": "largest micro-batch", "seq": "longest sequence"}[field]
    data = {"workload": w.id, "gpu": gpu, f"max_{field}": value, "planned_on": PLANNED_ON}
    text = f"{label} that fits one {tables.gpu(gpu).name}: {value}"
    if not value:
        data["advice"] = list(advice)
        text += " (even 1 does not fit)"
        text += (f"\n{field} 1 would fit with: " + "; ".join(advice) if advice
                 else "\nno single change tried makes it fit; try a larger GPU or --fit-gpus")
    return Result(data, text + f"\nplanned on {PLANNED_ON}")


def cheapest(w: Workload, deadline_hours: float, found: list[Estimate]) -> Result:
    """planner.cheapest: setups meeting the deadline, cheapest first."""
    data = {"workload": w.id, "deadline_hours": deadline_hours, "planned_on": PLANNED_ON,
            "setups": [{"gpu": e.gpu.slug, "gpus": e.workload.world_size, "job_hours": e.job.job_s / 3600,
                        "cost_usd": e.job.cost_usd, "device_used_bytes": e.memory.device_used_bytes}
                       for e in found]}
    if not found:
        return Result(data, "no GPU setup of the table (up to 64 GPUs) fits and meets the deadline")
    lines = [f"{'gpu':<16}{'GPUs':>6}{'hours':>10}{'cost $':>12}"]
    for s in data["setups"]:
        cost = "no price" if s["cost_usd"] is None else f"{s['cost_usd']:,.2f}"
        lines.append(f"{s['gpu']:<16}{s['gpus']:>6}{s['job_hours']:>10.2f}{cost:>12}")
    lines.append(f"planned on {PLANNED_ON}")
    return Result(data, "\n".join(lines))


def chinchilla(budget: Budget) -> Result:
    """planner.chinchilla: the compute-optimal model of a budget."""
    opt = budget.optimal
    text = (f"{budget.gpus} x {budget.gpu} for {budget.hours:g} h at MFU {budget.mfu:.2f}: {opt.flops:.3g} FLOPs\n"
            f"compute-optimal (~20 tokens/param): {opt.params / 1e9:.2f} B params on {opt.tokens / 1e9:.1f} B tokens\n"
            f"parametric fit (approach 3): {opt.params_parametric / 1e9:.2f} B params on "
            f"{opt.tokens_parametric / 1e9:.1f} B tokens\nsource: {opt.source}")
    return Result(budget.to_dict(), text)


# ---- --trace: the fake-tensor trace beside the analytic estimate ----------------------------------

def with_trace(result: Result, traced: dict) -> Result:
    """The estimate with the trace beside it: `traced` is profiler.trace.TraceResult.to_dict()
    (passed in as a dict: the estimator never imports torch). The comparison uses the raw
    (uncalibrated) analytic peak_allocated_bytes, the quantity the trace predicts (less the cuBLAS
    workspaces a CPU trace never takes)."""
    # the CPU trace runs no cuBLAS: the analytic peak without its workspaces is the one to compare
    analytic = result.data["memory"]["raw"]["peak_allocated_bytes"] - result.data["memory"]["blas_workspace_bytes"]
    measured = traced["peak_allocated_bytes"]
    comparison = {"analytic_peak_allocated_bytes": analytic,
                  "error": (analytic - measured) / measured if measured else None}
    data = {**result.data, "trace": {**traced, **comparison}}
    return Result(data, result.text + "\n\n" + render_trace(traced, analytic))


def render_trace(traced: dict, analytic: int) -> str:
    measured = traced["peak_allocated_bytes"]
    layers = ",".join(str(n) for n in traced["layers_traced"])
    how = (f"{layers} layers traced, extrapolated to {traced['num_layers']}" if traced["extrapolated"]
           else f"{layers} layers traced")
    lines = [f"trace (fake tensors on cpu, profiler.trace: {how}; {traced['trace_s']:.1f} s)",
             f"  {'peak allocated':<28}{_gib(measured)} traced   {_gib(analytic).strip()} analytic (raw, no cuBLAS workspace)"
             f"   error {100 * (analytic - measured) / measured:+.1f}%   peak in {traced['peak_phase']}",
             "  at the peak:    " + _parts(traced["by_category"]),
             "  by phase:       " + _parts(traced["phases"])]
    saved = traced.get("saved_activations_bytes")
    if saved is not None:
        lines.append(f"  {'saved for backward':<28}{_gib(saved)}")
    lines += [f"  note: {n}" for n in traced.get("notes", [])]
    return "\n".join(lines)


def _parts(values: dict) -> str:
    return ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in sorted(values.items(), key=lambda kv: -kv[1]) if v)
