#!/usr/bin/env python3
"""The estimator-versus-trace grid and the tracer's speed on a 7B-class model.

    python scripts/bench_tracer.py            # the whole grid (a few minutes on 2 cores), then 7B
    python scripts/bench_tracer.py --subset   # the configurations the test suite checks
    python scripts/bench_tracer.py --json     # rows and summaries as JSON
    python scripts/bench_tracer.py --match dora --no-7b   # the configurations whose label has "dora"
    python scripts/bench_tracer.py --catalog              # one catalog config per model type, two layers
    python scripts/bench_tracer.py --families  # only the newer families (profiler/trace/families.py)
    python scripts/bench_tracer.py --regimes   # stack regimes at real widths, two layers (Llama-4, Granite)
    python scripts/bench_tracer.py --measured h100-80gb   # traced whole against that GPU's measurements

For every configuration: the traced peak_allocated_bytes (profiler.trace, fake tensors, layer
extrapolation), the raw estimate (estimator.memory, no calibration), their relative error, and the
same for the activations autograd saves for the backward (training). Then one 7B-class training
step traced in a fresh process: trace seconds, process wall seconds and peak resident memory
(targets: under 10 s and 2 GB).

The family section (in the default run, or alone with --families): every family of
profiler/trace/families.py traced whole at 2 x 256 tokens for a full fine-tune, LoRA, QLoRA and
inference, one row each; a combination the estimator refuses on purpose prints `refused: <reason>`
and is not counted (a refused QLoRA is followed by QLoRA without kbit preparation, which those
models do run: `qlora-no-prep`). Then the median and worst |error| over the family rows.

--measured GPU: every single-process row of calibrations/measurements/GPU/ traced whole with the
model of the caching allocator (profiler/trace/measured.py): traced against measured peak
allocated and peak reserved, and the raw estimator's reserved beside it (--match narrows the rows).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# scripts/profile.py would shadow the standard library's `profile` (cProfile, which torch._dynamo
# imports): the scripts folder leaves the import path, the repository root takes its place.
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != os.path.join(ROOT, "scripts")]

from profiler.trace.families import FAMILIES, METHODS, QLORA_NO_PREP, compare_family  # noqa: E402
from profiler.trace.grid import TEST_SUBSET, compare, describe, grid, summary  # noqa: E402

MiB = 2**20
SEVEN_B = ("mistralai/Mistral-7B-v0.1", {"method": "full", "batch": 1, "seq": 2048})
_CHILD = """
import json, sys, time
start = time.perf_counter()
from profiler.case import Case
from profiler.trace import trace
r = trace(Case(sys.argv[1], json.loads(sys.argv[2])))
print(json.dumps({"trace_s": r.trace_s, "process_s": time.perf_counter() - start, "rss_bytes": r.rss_bytes,
                  "peak_allocated_bytes": r.peak_allocated_bytes, "layers_traced": r.layers_traced}))
"""


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+7.2f}%"


def _mib(x: int | None) -> str:
    return "" if x is None else f"{x / MiB:10.0f}"


def run_grid(cases) -> list:
    rows = []
    print(f"{'configuration':<58}{'traced MiB':>11}{'est MiB':>10}{'error':>9}  "
          f"{'saved MiB':>10}{'est MiB':>10}{'error':>9}{'trace s':>9}", flush=True)
    for case in cases:
        r = compare(case)
        rows.append(r)
        print(f"{r.configuration:<58}{_mib(r.traced_peak):>11}{_mib(r.estimated_peak):>10}{_pct(r.peak_error):>9}  "
              f"{_mib(r.traced_saved):>10}{_mib(r.estimated_saved):>10}{_pct(r.saved_error):>9}{r.trace_s:>9.1f}",
              flush=True)
    return rows


def run_families(names=None) -> tuple[list, list]:
    """The family section: one row per family x method; refusals (name, method, reason) apart.
    Where QLoRA is refused on purpose (kbit preparation over grouped_mm experts), QLoRA without kbit
    preparation is traced in its place."""
    rows, refused = [], []
    print(f"{'family x method':<58}{'traced MiB':>11}{'est MiB':>10}{'error':>9}  "
          f"{'saved MiB':>10}{'est MiB':>10}{'error':>9}{'trace s':>9}", flush=True)
    for name in names or FAMILIES:
        for method in METHODS:
            r = compare_family(name, method)
            if isinstance(r, str):
                refused.append((name, method, r))
                print(f"{name + ' ' + method:<58}refused: {r}", flush=True)
                if method != "qlora":
                    continue
                r = compare_family(name, QLORA_NO_PREP)   # the QLoRA that runs: no kbit preparation
                if isinstance(r, str):
                    refused.append((name, QLORA_NO_PREP, r))
                    print(f"{name + ' ' + QLORA_NO_PREP:<58}refused: {r}", flush=True)
                    continue
            rows.append(r)
            print(f"{r.configuration:<58}{r.traced_peak / MiB:>11.1f}{r.estimated_peak / MiB:>10.1f}"
                  f"{_pct(r.peak_error):>9}  {_mib1(r.traced_saved):>10}{_mib1(r.estimated_saved):>10}"
                  f"{_pct(r.saved_error):>9}{r.trace_s:>9.1f}", flush=True)
    return rows, refused


def _mib1(x: int | None) -> str:
    return "" if x is None else f"{x / MiB:10.1f}"


def family_summary(rows: list, refused: list) -> dict:
    worst = {}
    for r in rows:
        name = r.configuration.rsplit(" ", 1)[0]
        e = max(abs(r.peak_error), abs(r.saved_error or 0.0))
        worst[name] = max(worst.get(name, 0.0), e)
    return {"traced": len(rows), "refused": len(refused),
            "peak_allocated": summary([r.peak_error for r in rows]),
            "saved_activations": summary([r.saved_error for r in rows if r.saved_error is not None]),
            "worst_by_family": worst}


def summary_line(name: str, s: dict, width: int = 30) -> str:
    """One summary's line: points, median and worst |error|, share of under-estimates."""
    return (f"{name:<{width}} n={s['n']:<4} median |error| {100 * s['median_abs']:.2f}%   worst "
            f"{100 * s['worst_abs']:.2f}%   under-estimates {100 * s['under_rate']:.0f}%")


def print_family_summary(s: dict) -> None:
    print()
    for name, key in (("peak_allocated_bytes", "peak_allocated"), ("saved activations", "saved_activations")):
        v = s[key]
        print(summary_line(f"families {name}", v, 31))
    print(f"families: {s['traced']} rows traced, {s['refused']} refused (not counted)")
    print("worst |error| by family: " + ", ".join(f"{n} {100 * e:.2f}%" for n, e in s["worst_by_family"].items()))


def seven_b() -> dict:
    """Trace a 7B-class training step in a fresh Python process (imports included in process_s)."""
    model, settings = SEVEN_B
    out = subprocess.run([sys.executable, "-c", _CHILD, model, json.dumps(settings)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    data.update(model=model, settings=settings)
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Estimator vs fake-tensor trace, and the tracer's speed.")
    p.add_argument("--subset", action="store_true", help="only the configurations the tests check")
    p.add_argument("--no-7b", action="store_true", help="skip the 7B timing")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--match", metavar="TEXT", help="only the configurations whose label contains TEXT (e.g. dora)")
    p.add_argument("--families", action="store_true",
                   help="only the family section (profiler/trace/families.py: full, LoRA, QLoRA, inference)")
    p.add_argument("--catalog", action="store_true",
                   help="only the catalog section: one config per catalog model type, two layers deep, "
                        "full and LoRA on all linears")
    p.add_argument("--regimes", action="store_true",
                   help="only the stack regimes at real widths, two layers deep (profiler.trace.grid REGIME_CASES)")
    p.add_argument("--measured", metavar="GPU",
                   help="trace the rows of calibrations/measurements/GPU whole, reserved included, against them")
    args = p.parse_args(argv)
    if args.families:
        return _families_only(args)
    if args.catalog:
        return _catalog_only(args)
    if args.regimes:
        return _regimes_only(args)
    if args.measured:
        return _measured(args)
    cases = list(TEST_SUBSET) if args.subset else grid()
    if args.match:
        cases = [c for c in cases if args.match.lower() in describe(c).lower()]
        if not cases:
            print(f"bench_tracer.py: no configuration label contains {args.match!r}", file=sys.stderr)
            return 2
    start = time.perf_counter()
    if args.json:
        with contextlib.redirect_stdout(io.StringIO()):
            rows = run_grid(cases)
    else:
        rows = run_grid(cases)
    peak = summary([r.peak_error for r in rows])
    saved = summary([r.saved_error for r in rows if r.saved_error is not None])
    result = {"configurations": len(rows), "grid_s": time.perf_counter() - start,
              "peak_allocated": peak, "saved_activations": saved, "rows": [r.to_dict() for r in rows]}
    families = args.subset is False and args.match is None
    if families:
        if args.json:
            with contextlib.redirect_stdout(io.StringIO()):
                frows, refused = run_families()
        else:
            print()
            frows, refused = run_families()
        result["families"] = dict(family_summary(frows, refused), refusals=refused,
                                  rows=[r.to_dict() for r in frows])
    if not args.no_7b:
        result["seven_b"] = seven_b()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print()
    for name, s in (("peak_allocated_bytes", peak), ("saved activations", saved)):
        print(summary_line(name, s, 22))
    print(f"grid traced in {result['grid_s']:.0f} s")
    if "families" in result:
        print_family_summary(result["families"])
    if "seven_b" in result:
        b = result["seven_b"]
        print(f"7B-class trace ({b['model']}, {b['settings']}): trace {b['trace_s']:.1f} s, process "
              f"{b['process_s']:.1f} s with imports, peak RSS {b['rss_bytes'] / 2**30:.2f} GiB, "
              f"layers traced {b['layers_traced']}, peak {b['peak_allocated_bytes'] / 2**30:.2f} GiB")
    return 0


def _families_only(args) -> int:
    start = time.perf_counter()
    if args.json:
        with contextlib.redirect_stdout(io.StringIO()):
            rows, refused = run_families()
    else:
        rows, refused = run_families()
    s = family_summary(rows, refused)
    if args.json:
        print(json.dumps(dict(s, refusals=refused, rows=[r.to_dict() for r in rows],
                              families_s=time.perf_counter() - start), indent=2))
        return 0
    print_family_summary(s)
    print(f"families traced in {time.perf_counter() - start:.0f} s")
    return 0


def _regimes_only(args) -> int:
    """The stack regimes at real widths, two layers deep (profiler.trace.grid REGIME_CASES, the cases
    tests/test_stacks.py holds): Llama-4 Scout's experts under autocast and Liger, Granite with Liger."""
    from profiler.trace.grid import REGIME_CASES, compare_regime

    start = time.perf_counter()
    rows = []
    for model, settings, _ in REGIME_CASES:
        with contextlib.redirect_stdout(io.StringIO()):
            row = compare_regime(model, settings)
        rows.append(row)
        if not args.json:
            print(f"{row.configuration:<72} peak {100 * row.peak_error:+7.2f}%   saved {100 * row.saved_error:+7.2f}%",
                  flush=True)
    peak, saved = summary([r.peak_error for r in rows]), summary([r.saved_error for r in rows])
    if args.json:
        print(json.dumps({"rows": [r.to_dict() for r in rows], "peak_allocated": peak, "saved_activations": saved,
                          "regimes_s": time.perf_counter() - start}, indent=2))
        return 0
    print()
    for name, s in (("regimes peak_allocated_bytes", peak), ("regimes saved activations", saved)):
        print(summary_line(name, s))
    print(f"regimes traced in {time.perf_counter() - start:.0f} s")
    return 0


def _catalog_only(args) -> int:
    """The catalog's own configs cut to two layers against the raw estimate (profiler.trace.grid
    `compare_catalog`): what the grid's few families and the trace-sized configs do not cover."""
    from profiler.trace.grid import catalog_cases, compare_catalog

    start = time.perf_counter()
    rows, refused = [], []
    for name, method in catalog_cases():
        with contextlib.redirect_stdout(io.StringIO()):
            row = compare_catalog(name, method)
        if isinstance(row, str):
            refused.append(f"{name} {method}: {row}")
            continue
        rows.append(row)
        if not args.json:
            saved = f"{100 * row.saved_error:+7.2f}%" if row.saved_error is not None else "       -"
            print(f"{row.configuration:<62} peak {100 * row.peak_error:+7.2f}%   saved {saved}", flush=True)
    peak = summary([r.peak_error for r in rows])
    saved = summary([r.saved_error for r in rows if r.saved_error is not None])
    if args.json:
        print(json.dumps({"rows": [r.to_dict() for r in rows], "refused": refused, "peak_allocated": peak,
                          "saved_activations": saved, "catalog_s": time.perf_counter() - start}, indent=2))
        return 0
    print()
    for name, s in (("catalog peak_allocated_bytes", peak), ("catalog saved activations", saved)):
        print(summary_line(name, s))
    for line in refused:
        print(f"not traced: {line}")
    print(f"catalog traced in {time.perf_counter() - start:.0f} s")
    return 0


def _measured(args) -> int:
    from profiler.trace.measured import against_measurements, measured_files

    if not measured_files(args.measured):
        print(f"bench_tracer.py: no measurements for GPU {args.measured!r} in calibrations/measurements/",
              file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows, left_out = against_measurements(args.measured, args.match, log=None if args.json else print)
    if not rows:
        print(f"bench_tracer.py: no traceable row of {args.measured!r}"
              + (f" contains {args.match!r}" if args.match else ""), file=sys.stderr)
        return 2
    sums = {what: summary([r.error(what) for r in rows]) for what in ("allocated", "reserved", "estimated")}
    if args.json:
        print(json.dumps({"gpu": args.measured, "summaries": sums, "left_out": left_out,
                          "rows": [r.to_dict() for r in rows], "seconds": time.perf_counter() - start}, indent=2))
        return 0
    print()
    for what, name in (("allocated", "traced peak_allocated_bytes"), ("reserved", "traced peak_reserved_bytes"),
                       ("estimated", "estimator peak_reserved_bytes")):
        s = sums[what]
        if not s["n"]:      # the estimator leaves superseded rows out (calibrations/measurements/superseded.csv)
            print(f"{name:<31} n=0")
            continue
        print(f"{name:<31} n={s['n']:<3} median |error| {100 * s['median_abs']:.2f}%   worst "
              f"{100 * s['worst_abs']:.2f}%   under-estimates {100 * s['under_rate']:.0f}%")
    for label, why in left_out:
        print(f"left out: {label}: {why}")
    print(f"traced in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
