#!/usr/bin/env python3
"""Score the estimator's time against the development set of published measurements.

Rows: calibrations/measurements/published/time.csv (docs/design.md section 9: one row per published
measurement with its locator, metric, unit, conversion and what was guessed). Only sources that
../shared/DATA-SOURCES.md allows are in it; rows marked `skip: ...` and rows whose GPU is not in
estimator/data/gpus.csv are counted and left out.

Error of a row = (predicted time - measured time) / measured time, throughputs turned into times
(time ~ 1 / throughput), so a negative error is optimistic (faster than measured). Per kind
(training on one GPU, training on several, prefill, eager decode, compiled decode; quantized rows
again as their own group) it prints n, median and p90 |error|, the signed median and the share of
optimistic answers, for the mechanism before issue 11 ("before": hardware FLOPs / (peak x the old
MFU table), half the communication exposed, decode = bytes over 70 % of bandwidth) and now
("after": estimator.api.estimate, uncalibrated).

--rows adds every row's errors and, for training and prefill rows, the HFU the estimate used and the
one the row needs (the compute sum inverted on the measured time, `implied_hfu`).

--measured scores the profiler's own GPU rows instead (calibrations/measurements/<gpu>/*.csv, one
folder per GPU of gpus.csv: every field of the workload known, each time measured on its own):
training step, prefill and per-token decode time, uncalibrated (profiler.compare). Some levels were
read from these rows (time_constants.csv says which), so they are evidence, not a held-out score.

  python scripts/bench_time.py [--rows] [--json] [--csv PATH] [--measured]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from estimator import tables  # noqa: E402
from estimator.api import DEFAULT_INTER_NODE, estimate  # noqa: E402
from estimator.timing import inference_time, train_time  # noqa: E402
from estimator.compute_time import hfu_terms  # noqa: E402
from estimator.configs import load_spec  # noqa: E402
from estimator.defaults import time_constant  # noqa: E402
from estimator.flops import prefill_flops, training_flops  # noqa: E402
from estimator.memory import kv_cache_bytes  # noqa: E402
from estimator.params import count_params  # noqa: E402
from estimator.states import lora_params  # noqa: E402
from fitting.data import superseded_regime  # noqa: E402
from estimator.workload import Workload, lora_targets_from_text  # noqa: E402

DEV_SET = Path(ROOT) / "calibrations" / "measurements" / "published" / "time.csv"
TIME_METRICS = ("step_s", "job_s", "prefill_s")           # seconds: time directly
RATE_METRICS = ("decode_tokens_per_s_incl_prefill", "decode_tokens_per_s", "total_tokens_per_s")
_INT = ("gpus", "nodes", "batch", "seq", "new_tokens", "grad_accum", "lora_rank", "zero", "tp")
_BOOL = ("grad_ckpt", "compiled", "liger", "padding_mask", "lora_dropout")
# the achieved fractions of estimator/data/mfu.csv before issue 11 (MFU applied to hardware FLOPs)
BEFORE_MFU = {("full", "a100-80gb"): 0.55, ("full", "a100-40gb"): 0.5, ("full", "h100-80gb"): 0.4,
              "full": 0.4, "lora": 0.35, "qlora": 0.25, "inference-prefill": 0.45, "decode-bandwidth": 0.7}


def workload(row: dict) -> Workload:
    """The Workload a dev-set row describes (empty cells: the Workload defaults)."""
    values = {"model": load_spec(row["model"])}
    for name in ("method", "precision", "attn", "quant", "offload", "fsdp", "loss", "trainable_dtype"):
        if row.get(name):
            values[name] = row[name]
    for name in _INT:
        if row.get(name):
            values[name] = int(row[name])
    for name in _BOOL:
        if row.get(name):
            values[name] = row[name].strip().lower() == "true"
    if row.get("lora_targets"):
        values["lora_targets"] = lora_targets_from_text(row["lora_targets"])
    return Workload(**values).validate()


def measured_time(row: dict) -> float:
    """The row's measurement as a time in seconds of what the metric covers (rates inverted)."""
    value = float(row["value"])
    return value if row["metric"] in TIME_METRICS else 1.0 / value


def predicted_time(row: dict, w: Workload, t) -> float:
    """The estimator's time for what the row's metric covers (t: a TimeBreakdown-like object)."""
    metric = row["metric"]
    if metric == "step_s":
        return t.step_s
    if metric == "job_s":
        return math.ceil(int(row["samples"]) / (w.batch * w.grad_accum * w.dp)) * t.step_s
    if metric == "prefill_s":
        return t.prefill_s
    if metric == "decode_tokens_per_s":
        return t.decode_s_per_token / w.batch
    if metric == "decode_tokens_per_s_incl_prefill":
        return (t.prefill_s + t.decode_s_per_token * w.new_tokens) / (w.batch * w.new_tokens)
    if metric == "total_tokens_per_s":
        return (t.prefill_s + t.decode_s_per_token * w.new_tokens) / (w.batch * (w.seq + w.new_tokens))
    raise SystemExit(f"{DEV_SET}: unknown metric {metric!r}")


class _Before:
    """Step time as the estimator computed it before issue 11 (the baseline)."""

    def __init__(self, w: Workload, gpu: tables.GpuSpec, inter_node: str = DEFAULT_INTER_NODE):
        peak = gpu.peak_flops(w.compute_dtype)
        key = "inference-prefill" if not w.training else w.method
        mfu = BEFORE_MFU.get((key, gpu.slug), BEFORE_MFU[key])
        self.prefill_s = self.decode_s_per_token = 0.0
        if w.training:
            comm = self._comm(w, gpu, inter_node)
            self.step_s = w.grad_accum * training_flops(w).hardware_flops / (peak * mfu) + 0.5 * comm
            return
        est = estimate(w, gpu.slug, "none")
        self.prefill_s = prefill_flops(w) / (peak * mfu)
        if w.new_tokens:
            mid = w.seq + w.new_tokens // 2
            moved = est.memory.weights_bytes + kv_cache_bytes(w.model, w.batch, mid, w.activation_dtype_bytes, w.tp)
            self.decode_s_per_token = moved / (gpu.memory_bandwidth_bytes_per_s * BEFORE_MFU["decode-bandwidth"])
        self.step_s = self.prefill_s + self.decode_s_per_token * w.new_tokens

    @staticmethod
    def _comm(w: Workload, gpu: tables.GpuSpec, inter_node: str) -> float:
        n = w.dp
        if n == 1:
            return 0.0
        p = count_params(w.model)
        trainable = p.total if w.method == "full" else lora_params(w, p)
        grad = trainable / (w.tp * w.pp) * (2 if w.compute_dtype != "fp32" else 4)
        intra = tables.interconnect(gpu.intra_node_interconnect)
        link = intra if w.nodes == 1 else min(intra, tables.interconnect(inter_node),
                                                key=lambda li: li.bandwidth_bytes_per_s)
        return ((3.0 if (w.zero == 3 or w.fsdp != "none") else 2.0) * (n - 1) / n * grad / link.bandwidth_bytes_per_s
                + 2 * (n - 1) * link.latency_s)


# mechanisms the ablation turns off one at a time (estimator.compute_time, estimator.timing `off`)
MECHANISMS = ("gemm_size", "causal_attention", "elementwise", "adapters", "dequant", "offload", "hybrid",
              "launch_floor", "clip")


def without(w: Workload, gpu_slug: str, est, off: frozenset):
    """The estimate's time with the mechanisms in `off` left out (same corrections, same memory)."""
    gpu, hfu = tables.gpu(gpu_slug), est.corrections["mfu"]["value"]
    if w.training:
        return train_time(w, gpu, hfu, est.memory, DEFAULT_INTER_NODE, off)
    return inference_time(w, gpu, hfu, est.corrections["decode_bandwidth_fraction"]["value"], est.memory, off)


def implied_hfu(row: dict, w: Workload, est) -> float | None:
    """The GEMM fraction (HFU) that would make the estimator's compute match the row: the compute sum
    inverted (estimator.compute_time.hfu_terms: compute = work / (peak x HFU) + fixed) on the measured
    time less the step's exposed communication, optimizer step, gradient clipping and fixed overhead. Training and prefill
    rows only; inf where the parts that do not depend on HFU already exceed the measurement."""
    t, gpu = est.time, tables.gpu(row["gpu_slug"])
    if row["metric"] == "prefill_s":
        compute = measured_time(row)
    elif w.training and row["metric"] in ("step_s", "job_s"):
        step = measured_time(row) * t.step_s / predicted_time(row, w, t)   # per optimizer step
        compute = (step - t.exposed_comm_s - t.optimizer_s - t.clip_s - t.overhead_s) / w.grad_accum
    else:
        return None
    work, fixed = hfu_terms(w, gpu)
    left = compute - fixed
    return work / (gpu.peak_flops(w.compute_dtype) * left) if left > 0 else math.inf


def kind(w: Workload, row: dict) -> str:
    if w.training:
        return "training, 1 GPU" if w.world_size == 1 else "training, several GPUs"
    if row["metric"] == "prefill_s":
        return "inference prefill"
    return "decode, compiled" if w.compiled else "decode, eager"


def score(rows: list[dict]) -> tuple[list[dict], dict]:
    scored, skipped = [], {}
    known = tables.gpus()
    for row in rows:
        use = row.get("use", "score")
        if use != "score":
            skipped[use] = skipped.get(use, 0) + 1
            continue
        if row["gpu_slug"] not in known:
            reason = f"GPU {row['gpu_slug']} not in estimator/data/gpus.csv"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        w = workload(row)
        measured = measured_time(row)
        est = estimate(w, row["gpu_slug"], "none")
        before = _Before(w, tables.gpu(row["gpu_slug"]))
        entry = {"source": row["source"], "locator": row["locator"], "model": row["model"],
                 "gpu": row["gpu_slug"], "kind": kind(w, row), "quantized": w.quant != "none",
                 "measured_s": measured,
                 "before": predicted_time(row, w, before) / measured - 1.0,
                 "after": predicted_time(row, w, est.time) / measured - 1.0,
                 "hfu": est.corrections["mfu"]["value"], "implied_hfu": implied_hfu(row, w, est)}
        for name in MECHANISMS:
            t = without(w, row["gpu_slug"], est, frozenset({name}))
            entry["off:" + name] = predicted_time(row, w, t) / measured - 1.0
        scored.append(entry)
    return scored, skipped


def summary(errors: list[float]) -> dict:
    a = sorted(abs(e) for e in errors)
    p90 = a[min(len(a) - 1, math.ceil(0.9 * len(a)) - 1)]
    return {"n": len(errors), "median_abs": statistics.median(a), "p90_abs": p90,
            "signed_median": statistics.median(errors), "optimistic": sum(e < 0 for e in errors) / len(errors)}


def groups(scored: list[dict]) -> dict:
    out = {}
    keys = ("before", "after") + tuple("off:" + m for m in MECHANISMS)
    names = ["training, 1 GPU", "training, several GPUs", "inference prefill", "decode, eager", "decode, compiled"]
    for name in names + ["quantized (bitsandbytes)", "training, all", "inference, all", "all"]:
        if name == "all":
            sel = scored
        elif name.startswith("quantized"):
            sel = [r for r in scored if r["quantized"]]
        elif name.endswith(", all"):
            sel = [r for r in scored if r["kind"].startswith("training") == name.startswith("training")]
        else:
            sel = [r for r in scored if r["kind"] == name]
        if sel:
            out[name] = {k: summary([r[k] for r in sel]) for k in keys}
    return out


TARGETS = (("training, all", 0.10, 0.25), ("inference, all", 0.20, None))   # issue 11: median, p90


def render(result: dict) -> str:
    lines = [f"time against {result['rows']} published measurements ({DEV_SET.relative_to(ROOT)}); "
             f"error = (predicted - measured) / measured time; optimistic = predicted faster", "",
             f"{'kind':<26}{'n':>4}  {'before: median  p90  signed  optim.':>36}  {'after: median  p90  signed  optim.':>36}"]
    for name, g in result["groups"].items():
        cells = []
        for k in ("before", "after"):
            s = g[k]
            cells.append(f"{s['median_abs']:>14.0%}{s['p90_abs']:>6.0%}{s['signed_median']:>+8.0%}{s['optimistic']:>8.0%}")
        lines.append(f"{name:<26}{g['after']['n']:>4}  {cells[0]:>36}  {cells[1]:>36}")
    lines += ["", "targets (issue 11, after): " + "; ".join(
        f"{name} median {g['after']['median_abs']:.0%} (<= {med:.0%})"
        + (f", p90 {g['after']['p90_abs']:.0%} (<= {p90:.0%})" if p90 else "")
        + (" MET" if g["after"]["median_abs"] <= med and (not p90 or g["after"]["p90_abs"] <= p90) else " MISSED")
        for name, med, p90 in TARGETS if (g := result["groups"].get(name)))]
    lines += ["", "ablation: median |error| after, and with one mechanism left out"]
    lines.append(f"{'kind':<26}{'after':>7}" + "".join(f"{m[:10]:>11}" for m in MECHANISMS))
    for name, g in result["groups"].items():
        lines.append(f"{name:<26}{g['after']['median_abs']:>7.0%}"
                     + "".join(f"{g['off:' + m]['median_abs']:>11.0%}" for m in MECHANISMS))
    lines += ["", "signed median error after, by source (negative: optimistic)"]
    for source, s in result["sources"].items():
        lines.append(f"{source:<26}{s['n']:>4}  {s['signed_median']:>+6.0%}  median |error| {s['median_abs']:.0%}")
    if result["skipped"]:
        lines += ["", "left out: " + "; ".join(f"{n} x {why}" for why, n in result["skipped"].items())]
    return "\n".join(lines)


MEASURED_QUANTITIES = (("step_s", "training step"), ("step_s", "inference step (prefill + decode)"),
                       ("prefill_s", "prefill"), ("decode_token_s", "decode, per token"))


def _gpu_rows(gpu_slugs=None):
    """(GpuSpec, rows) of every GPU folder of calibrations/measurements/ (the profiler's own rows;
    folders of imports or traces are not a GPU's), or only `gpu_slugs`'."""
    folder = Path(ROOT) / "calibrations" / "measurements"
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        try:
            gpu = tables.gpu(sub.name)
        except Exception:  # noqa: BLE001 - a folder of imports or traces, not a GPU's
            continue
        if gpu_slugs and sub.name not in gpu_slugs:
            continue
        rows = []
        for f in sorted(sub.glob("*.csv")):
            with f.open(newline="") as fh:   # not the rows of a regime no longer modelled
                rows += [r for r in csv.DictReader(fh) if superseded_regime(f, r.get("id", "")) is None]
        yield gpu, rows


def measured(gpu_slugs=None) -> dict:
    """{gpu: {label: summary}} of the uncalibrated estimate against the profiler's committed rows."""
    from profiler.compare import compare_rows, estimate_predictor
    out = {}
    for gpu, rows in _gpu_rows(gpu_slugs):
        points = compare_rows(rows, estimate_predictor(gpu.slug, "none"))
        training = {r["id"]: r.get("method") != "inference" for r in rows}
        found = {}
        for q, label in MEASURED_QUANTITIES:
            errs = [pt.error for pt in points if pt.quantity == q and pt.error is not None
                    and (q != "step_s" or training.get(pt.id) == label.startswith("training"))]
            if errs:
                found[label] = summary(errs)
        if found:
            out[gpu.slug] = found
    return out


LAUNCH_BOUND = 0.5   # a row whose roofline compute is below this share of its measured compute


def launch_evidence(gpu_slugs=None) -> dict:
    """{gpu: {"per_op_s": [...], "rows": [...]}}: on the profiler's committed training rows whose
    roofline compute (estimator.compute_time, uncalibrated) is below LAUNCH_BOUND of the measured
    forward and backward (step_s - optimizer_s), the host seconds per dispatched operator they imply
    (estimator.ops counts): the evidence behind `training_host_s_per_op`."""
    from estimator.ops import micro_batch_ops
    from fitting.data import workload_from_row
    from profiler.record import measured_value

    out = {}
    for gpu, rows in _gpu_rows(gpu_slugs):
        found = {"per_op_s": [], "rows": []}
        for row in rows:
            step = measured_value(row.get("step_s", ""))
            if row.get("status") != "ok" or row.get("method") == "inference" or step is None:
                continue
            w = workload_from_row(row)
            if w.activation_offload or w.gpus > 1:   # host copies / communication, not launches
                continue
            fb = step - (measured_value(row.get("optimizer_s", "")) or 0.0)
            roof = w.grad_accum * sum(estimate(w, gpu.slug, "none").time.compute_parts.values())
            if roof < LAUNCH_BOUND * fb:
                ops = w.grad_accum * micro_batch_ops(w)
                found["per_op_s"].append(fb / ops)
                found["rows"].append(f"{row['id']}: {fb * 1e3:.1f} ms / {ops:.0f} ops")
        if found["per_op_s"]:
            out[gpu.slug] = found
    return out


def render_measured(result: dict) -> str:
    lines = ["time against the profiler's own GPU measurements (calibrations/measurements/<gpu>/, uncalibrated)",
             f"{'gpu':<12} {'quantity':<34} {'n':>3}  {'median':>6} {'p90':>6} {'signed':>7} {'optim.':>7}"]
    for gpu, found in result.items():
        for label, m in found.items():
            lines.append(f"{gpu:<12} {label:<34} {m['n']:>3}  {m['median_abs']:>6.0%} {m['p90_abs']:>6.0%} "
                         f"{m['signed_median']:>+7.0%} {m['optimistic']:>7.0%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", type=Path, default=DEV_SET, help="development set (default: %(default)s)")
    p.add_argument("--rows", action="store_true", help="print every row's errors")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--measured", action="store_true",
                   help="score the profiler's own GPU rows (calibrations/measurements/<gpu>/) instead")
    args = p.parse_args(argv)
    if args.measured:
        found = measured()
        launch = launch_evidence()
        if args.json:
            print(json.dumps({"errors": found, "launch_bound_rows": launch}, indent=2))
            return 0
        print(render_measured(found))
        for gpu, ev in launch.items():
            values = sorted(ev["per_op_s"])
            print(f"\n{gpu}: {len(values)} training rows launch-bound (roofline below {LAUNCH_BOUND:.0%} of the "
                  f"measured forward + backward): host seconds per operator median {statistics.median(values) * 1e6:.1f} us "
                  f"(range {values[0] * 1e6:.1f}-{values[-1] * 1e6:.1f}); time_constants.csv training_host_s_per_op "
                  f"{time_constant('training_host_s_per_op') * 1e6:.1f} us")
            if args.rows:
                for line in ev["rows"]:
                    print(f"  {line}")
        return 0
    with args.csv.open(newline="") as f:
        rows = list(csv.DictReader(f))
    scored, skipped = score(rows)
    sources = {}
    for r in scored:
        sources.setdefault(f"{r['source']} ({'train' if r['kind'].startswith('training') else 'infer'})", []).append(r["after"])
    result = {"rows": len(scored), "groups": groups(scored), "skipped": skipped,
              "sources": {k: summary(v) for k, v in sorted(sources.items())}}
    if args.rows:
        result["scored"] = scored
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(render(result))
    if args.rows:
        print()
        print(" before   after  kind                   gpu           model         HFU (row needs)  source: locator")
        for r in scored:
            need = r["implied_hfu"]
            hfu = "" if need is None else f"{r['hfu']:.2f} ({'>1' if need > 1 else f'{need:.2f}'})"
            print(f"{r['before']:>+7.0%} {r['after']:>+7.0%}  {r['kind']:<22} {r['gpu']:<13} {r['model']:<13} "
                  f"{hfu:<16} {r['source']}: {r['locator'][:70]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
