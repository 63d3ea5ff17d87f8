#!/usr/bin/env python3
"""Benchmark the analytic estimator: estimates per second on one core, and the cold start of
`scripts/estimate.py --json` (targets: >= 20,000 estimates/s; < 0.5 s; no torch import)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from estimator.api import estimate  # noqa: E402
from estimator.configs import load_spec  # noqa: E402
from estimator.workload import Workload  # noqa: E402


def _workloads() -> list[Workload]:
    spec = load_spec("llama-3.1-8b")
    moe = load_spec("mixtral-8x7b")
    return [
        Workload(spec, method="full", zero=3, gpus=8, batch=4, seq=2048, grad_ckpt=True),
        Workload(spec, method="lora", batch=8, seq=1024),
        Workload(spec, method="qlora", quant="nf4", batch=4, seq=4096, grad_ckpt=True),
        Workload(spec, method="inference", batch=16, seq=1024, new_tokens=256),
        Workload(moe, method="qlora", quant="nf4", kbit_prep="off", batch=1, seq=2048, grad_ckpt=True),
    ]


def estimates_per_second(seconds: float = 2.0) -> float:
    items = _workloads()
    for w in items:  # warm caches (configs, tables, parameter counts)
        estimate(w, "a100-80gb", "none")
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for w in items:
            estimate(w.with_(batch=w.batch + n % 3), "a100-80gb", "none")
        n += len(items)
    return n / (time.perf_counter() - start)


def cold_start_s(runs: int = 5) -> tuple[float, bool]:
    """Median wall time of a fresh `estimate.py --json` process, and whether torch got imported."""
    code = ("import runpy, sys; sys.argv=['estimate.py','--model','llama-3.1-8b','--method','qlora',"
            "'--json']\ntry:\n runpy.run_path('scripts/estimate.py', run_name='__main__')\n"
            "except SystemExit: pass\nsys.stderr.write('TORCH=%s' % ('torch' in sys.modules))")
    times, torch_seen = [], False
    for _ in range(runs):
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        torch_seen |= "TORCH=True" in out.stderr
    return statistics.median(times), torch_seen


if __name__ == "__main__":
    rate = estimates_per_second()
    cold, torch_seen = cold_start_s()
    print(f"estimates per second (one core): {rate:,.0f}   target >= 20,000   {'OK' if rate >= 20000 else 'BELOW'}")
    print(f"cold start of estimate.py --json: {cold:.3f} s   target < 0.5 s   {'OK' if cold < 0.5 else 'ABOVE'}")
    print(f"torch imported by estimate.py: {torch_seen}")
