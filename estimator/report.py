"""The command line's logic: arguments -> Workload -> library answer -> JSON object and table.

`scripts/estimate.py` stays thin: it parses, calls `run`, and prints `.data` (with --json) or
`.text`. Tables are renderings of the same object.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from estimator import planner, tables
from estimator.api import Estimate, JobSpec, estimate
from estimator.configs import load_spec
from estimator.errors import InputError
from estimator.params import ALL_LINEAR
from estimator.units import GiB
from estimator.workload import Workload


class OneLineParser(argparse.ArgumentParser):
    """argparse for our command lines: a usage error is one line on stderr and exit code 2."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


@dataclass(frozen=True)
class Result:
    data: dict
    text: str


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:8.2f} GiB"


def workload_from_args(args) -> Workload:
    if not args.model:
        raise InputError("--model is required (a config.json path, catalog name or Hub id)")
    targets = ALL_LINEAR if args.lora_targets.strip().lower() == "all-linear" else tuple(
        t.strip() for t in args.lora_targets.split(",") if t.strip())
    quant = args.quant or ("nf4" if args.method == "qlora" else "none")
    return Workload(
        model=load_spec(args.model), method=args.method, precision=args.precision,
        optimizer=args.optimizer, adamw_impl=args.adamw_impl, batch=args.batch, seq=args.seq,
        new_tokens=args.new_tokens, grad_accum=args.grad_accum, lora_rank=args.lora_rank,
        lora_targets=targets, grad_ckpt=args.grad_ckpt, attn=args.attn, quant=quant,
        double_quant=not args.no_double_quant, gpus=args.gpus, nodes=args.nodes, zero=args.zero,
        offload=args.offload, tp=args.tp, pp=args.pp,
    ).validate()


def _job(args) -> JobSpec | None:
    if args.samples is None:
        return None
    if args.samples <= 0 or args.epochs <= 0 or args.retry_factor < 1.0:
        raise InputError("--samples and --epochs must be positive and --retry-factor at least 1")
    return JobSpec(args.samples, args.epochs, args.retry_factor, args.price_table, args.provider)


def run(args) -> Result:
    if args.chinchilla:
        return _chinchilla(args)
    w = workload_from_args(args)
    if args.fit_gpus:
        return _fit_gpus(w, args)
    if args.max_batch or args.max_seq:
        return _max(w, args)
    if args.cheapest:
        return _cheapest(w, args)
    result = estimate(w, args.gpu, args.calibration, _job(args), args.inter_node)
    data = result.to_dict()
    data["advice"] = advice(result, args.calibration)
    return Result(data, render_estimate(result, data["advice"]))


def advice(result: Estimate, calibration: str) -> list[str]:
    """Changes that would make a workload fit (tried one at a time), when it does not."""
    if result.fits:
        return []
    w, slug = result.workload, result.gpu.slug
    tries = []
    if w.training and not w.grad_ckpt:
        tries.append(("--grad-ckpt", dict(grad_ckpt=True)))
    if w.batch > 1:
        tries.append((f"--batch {max(1, w.batch // 2)} --grad-accum {w.grad_accum * 2}",
                      dict(batch=max(1, w.batch // 2), grad_accum=w.grad_accum * 2)))
    if w.training and w.batch > 1 and not w.grad_ckpt:
        tries.append((f"--grad-ckpt --batch 1 --grad-accum {w.grad_accum * w.batch}",
                      dict(grad_ckpt=True, batch=1, grad_accum=w.grad_accum * w.batch)))
    if w.method == "full":
        tries.append(("--method lora", dict(method="lora")))
        tries.append(("--method qlora", dict(method="qlora", quant="nf4", precision="bf16")))
        if w.optimizer == "adamw":
            tries.append(("--optimizer adamw-8bit", dict(optimizer="adamw-8bit")))
    if w.method == "lora":
        tries.append(("--method qlora", dict(method="qlora", quant="nf4")))
    if w.method == "inference" and w.quant == "none":
        tries.append(("--quant nf4", dict(quant="nf4")))
    out = []
    for flag, change in tries:
        try:
            if estimate(w.with_(**change), slug, calibration).fits:
                out.append(flag)
        except InputError:
            continue
    need = planner.gpus_needed(w, slug, calibration)
    if need is not None:
        out.append(f"{need.workload.world_size} x {slug}"
                   + (f" (--gpus {need.workload.gpus} --nodes {need.workload.nodes})" if w.training else ""))
    return out


def _calibration_lines(result: Estimate) -> list[str]:
    """The table's extra bytes (so components add up), its safe upper bound and its warnings."""
    lines = []
    for key in ("allocated_constant_bytes", "non_pytorch_bytes"):
        value = result.corrections.get(key, {}).get("value")
        if value:
            lines.append(f"  {key[:-6]:<28}{_gib(value)}   (calibrated)")
    bound = result.upper_bound
    if bound:
        note = "" if bound["within_data_range"] else "; workload outside the table's data: coverage not measured"
        lines.append(f"  safe upper bound of device used: {_gib(bound['device_used_bytes']).strip()}"
                     f" (covered {bound['coverage']:.0%} of held-out measurements{note})")
    lines += [f"  warning: {text}" for text in result.warnings]
    return lines


def render_estimate(result: Estimate, tips: list[str]) -> str:
    m, w, t = result.memory, result.workload, result.time
    lines = [f"{w.model.name}  {w.method}  {w.precision}  batch {w.batch} x seq {w.seq}"
             f"{'  +' + str(w.new_tokens) + ' new' if w.new_tokens else ''}  on {result.gpu.name}"
             f"  ({w.world_size} GPU{'s' if w.world_size > 1 else ''})", "",
             "memory per GPU"]
    for name, value in m.to_dict().items():
        if name.endswith("_bytes") and value and not name.startswith(("peak_", "device_used", "host")):
            lines.append(f"  {name[:-6]:<28}{_gib(value)}")
    lines += ["",
              f"  {'peak allocated':<28}{_gib(m.peak_allocated_bytes)}   (raw {_gib(result.raw_memory.peak_allocated_bytes).strip()})",
              f"  {'peak reserved':<28}{_gib(m.peak_reserved_bytes)}",
              f"  {'device used (nvidia-smi)':<28}{_gib(m.device_used_bytes)}   of {_gib(result.gpu.memory_bytes).strip()}"
              f"  -> {'FITS' if result.fits else 'DOES NOT FIT'}"]
    if m.host_bytes:
        lines.append(f"  {'host (offload)':<28}{_gib(m.host_bytes)}")
    top = ", ".join(name[:-6] for name, _ in result.dominant())
    lines += [f"  dominated by: {top} (peak in {m.peak_phase})", ""]
    if w.training:
        lines.append(f"time  step {t.step_s:.3f} s   {t.tokens_per_s:,.0f} tokens/s   MFU {t.mfu:.2f}"
                     f"   comm {t.comm_s:.3f} s")
    else:
        lines.append(f"time  prefill {t.prefill_s:.3f} s   decode {t.decode_s_per_token * 1e3:.2f} ms/token"
                     f"   {t.tokens_per_s:,.0f} tokens/s")
    if result.job:
        j = result.job
        lines.append(f"job   {j.steps} steps   {j.job_s / 3600:.2f} h   {j.gpu_hours:.1f} GPU-h"
                     f"   ${j.cost_usd:,.2f} at ${j.usd_per_gpu_hour:.2f}/GPU-h")
    cal = result.calibration.path or "none (uncalibrated defaults)"
    lines.append(f"calibration: {cal}")
    lines += _calibration_lines(result)
    if tips:
        lines.append("would fit with: " + "; ".join(tips))
    elif not result.fits:
        lines.append("no single change tried makes it fit; try a larger GPU or --fit-gpus")
    return "\n".join(lines)


def _fit_gpus(w: Workload, args) -> Result:
    rows = planner.fit_table(w, args.calibration, args.price_table)
    data = {"workload": w.id, "gpus": [r.to_dict() for r in rows]}
    lines = [f"{w.id}", f"{'gpu':<16}{'needed':>8}{'used/GPU':>14}{'memory':>14}{'step s':>10}{'$/GPU-h':>9}"]
    for r in rows:
        need = "-" if r.gpus_needed is None else str(r.gpus_needed)
        step = "-" if r.step_s is None else f"{r.step_s:.3f}"
        lines.append(f"{r.gpu:<16}{need:>8}{_gib(r.device_used_bytes):>14}{_gib(r.memory_bytes):>14}"
                     f"{step:>10}{r.usd_per_gpu_hour:>9.2f}")
    return Result(data, "\n".join(lines))


def _max(w: Workload, args) -> Result:
    if args.max_batch:
        value = planner.max_batch(w, args.gpu, args.calibration)
        key, label = "max_batch", "largest micro-batch"
    else:
        value = planner.max_seq(w, args.gpu, args.calibration)
        key, label = "max_seq", "longest sequence"
    data = {"workload": w.id, "gpu": args.gpu, key: value}
    return Result(data, f"{label} that fits one {tables.gpu(args.gpu).name}: {value}"
                  + ("" if value else " (even 1 does not fit)"))


def _cheapest(w: Workload, args) -> Result:
    job = _job(args)
    if job is None or args.deadline_hours is None or args.deadline_hours <= 0:
        raise InputError("--cheapest needs --samples and a positive --deadline-hours")
    found = planner.cheapest(w, job, args.deadline_hours * 3600.0, args.calibration)
    data = {"workload": w.id, "deadline_hours": args.deadline_hours,
            "setups": [{"gpu": e.gpu.slug, "gpus": e.workload.world_size, "job_hours": e.job.job_s / 3600,
                        "cost_usd": e.job.cost_usd, "device_used_bytes": e.memory.device_used_bytes}
                       for e in found]}
    if not found:
        return Result(data, "no GPU setup of the table (up to 64 GPUs) fits and meets the deadline")
    lines = [f"{'gpu':<16}{'GPUs':>6}{'hours':>10}{'cost $':>12}"]
    for s in data["setups"]:
        lines.append(f"{s['gpu']:<16}{s['gpus']:>6}{s['job_hours']:>10.2f}{s['cost_usd']:>12,.2f}")
    return Result(data, "\n".join(lines))


def _chinchilla(args) -> Result:
    if args.hours is None:
        raise InputError("--chinchilla needs --hours (wall-clock budget) with --gpu and --gpus")
    mfu = args.mfu if args.mfu is not None else tables.mfu_default("full", args.gpu).mfu
    if not 0 < mfu < 1:
        raise InputError("--mfu must be between 0 and 1")
    n = args.gpus * args.nodes
    flops = planner.budget_flops(args.gpu, n, args.hours, mfu)
    opt = planner.compute_optimal(flops)
    data = {"gpu": args.gpu, "gpus": n, "hours": args.hours, "mfu": mfu, **opt.to_dict()}
    text = (f"{n} x {args.gpu} for {args.hours:g} h at MFU {mfu:.2f}: {flops:.3g} FLOPs\n"
            f"compute-optimal (~20 tokens/param): {opt.params / 1e9:.2f} B params on {opt.tokens / 1e9:.1f} B tokens\n"
            f"parametric fit (approach 3): {opt.params_parametric / 1e9:.2f} B params on "
            f"{opt.tokens_parametric / 1e9:.1f} B tokens\nsource: {opt.source}")
    return Result(data, text)


# ---- --trace: the fake-tensor trace beside the analytic estimate ----------------------------------

def trace_request_error(args) -> str | None:
    """Why --trace cannot apply to these arguments, or None."""
    if args.fit_gpus or args.max_batch or args.max_seq or args.cheapest or args.chinchilla:
        return "--trace applies to a single estimate (not --fit-gpus, --max-batch, --max-seq, --cheapest, --chinchilla)"
    return None


def with_trace(result: Result, traced: dict) -> Result:
    """The estimate with the trace beside it: `traced` is profiler.trace.TraceResult.to_dict()
    (passed in as a dict: the estimator never imports torch). The comparison uses the raw
    (uncalibrated) analytic peak_allocated_bytes, the quantity the trace predicts."""
    analytic = result.data["memory"]["raw"]["peak_allocated_bytes"]
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
             f"  {'peak allocated':<28}{_gib(measured)} traced   {_gib(analytic).strip()} analytic (raw)"
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
