#!/usr/bin/env python3
"""How much of the profiler's CUDA-only code the simulated device runs (issue 16).

CUDA-only code is marked where it lives: a `# cuda-only` comment on a `def`, `class`, `if`, `with`
or `try` line marks that statement's whole block (code that runs only on the cuda backend: device
setup, NVML readings, the idle check, GPU detection, the cuda branches of measuring and of the
environment). A `# hardware-only: <reason>` comment marks a block only a real GPU can run (the
calls into torch.cuda and pynvml themselves); it leaves the count and is listed with its reason.
The script runs the simulated-device tests (tests/test_simulated_device.py: the real child,
measure, nvml, runner, search and profile.py code with PROFILER_SIMULATED_DEVICE;
tests/test_zero_simulated.py: ZeRO 2/3 and DDP ranks under DeepSpeed's launcher and torchrun;
tests/test_gpu.py: the GPU tests' simulated variants; and the Trainer callback's CUDA branch in
tests/test_callbacks.py) under coverage, children and ranks included,
and prints the CUDA-only lines never executed, the hardware-only blocks, and last:
`cuda paths: N/M lines executed (X%)` (target >= 95%).

    python scripts/check_gpu_paths.py [--tests tests/test_simulated_device.py ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "profiler"
MARK = re.compile(r"#\s*(cuda-only|hardware-only:\s*(?P<why>.+?))\s*$")
DEFAULT_TESTS = ["tests/test_simulated_device.py", "tests/test_zero_simulated.py", "tests/test_gpu.py",
                 "tests/test_callbacks.py::test_the_cuda_branch_through_the_simulated_device"]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def marked(path: Path) -> tuple[set[int], dict[int, str]]:
    """(CUDA-only line numbers, {first line of a hardware-only block: reason} with its lines removed)."""
    lines = path.read_text().splitlines()
    cuda, hardware, reasons = set(), set(), {}
    for i, line in enumerate(lines):
        m = MARK.search(line)
        if not m:
            continue
        block, j = {i + 1}, i + 1
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > _indent(line)):
            block.add(j + 1)
            j += 1
        if m.group(1) == "cuda-only":
            cuda |= block
        else:
            hardware |= block
            reasons[i + 1] = m.group("why")
    return cuda - hardware, reasons


def run_under_coverage(tests: list[str], data_file: Path) -> int:
    """pytest on `tests` with coverage in every process (sitecustomize + COVERAGE_PROCESS_START)."""
    tmp = data_file.parent
    rc = tmp / ".coveragerc"
    rc.write_text(f"[run]\nparallel = True\ndata_file = {data_file}\nsource = {PACKAGE}\n"
                  "concurrency = thread\n")
    (tmp / "sitecustomize.py").write_text("import coverage\ncoverage.process_startup()\n")
    env = {**os.environ, "COVERAGE_PROCESS_START": str(rc),
           "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                          env=env)
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tests", nargs="+", default=DEFAULT_TESTS)
    args = p.parse_args(argv)
    import coverage

    with tempfile.TemporaryDirectory(prefix="gpu-paths-") as tmp:
        data_file = Path(tmp) / ".coverage"
        code = run_under_coverage(args.tests, data_file)
        if code != 0:
            print(f"check_gpu_paths: the simulated-device tests failed (pytest exit {code})", file=sys.stderr)
            return 1
        cov = coverage.Coverage(data_file=str(data_file))
        cov.combine(data_paths=[tmp])
        cov.load()
        data = cov.get_data()
        total = executed = 0
        missing, hardware = [], []
        for path in sorted(PACKAGE.rglob("*.py")):
            cuda, reasons = marked(path)
            if not cuda and not reasons:
                continue
            statements = set(cov.analysis2(str(path))[1])
            ran = set(data.lines(str(path)) or ())
            lines = cuda & statements
            total += len(lines)
            executed += len(lines & ran)
            rel = path.relative_to(ROOT)
            missing += [f"  {rel}:{n}" for n in sorted(lines - ran)]
            hardware += [f"  {rel}:{n}: {why}" for n, why in sorted(reasons.items())]
    if missing:
        print("CUDA-only lines the simulated device did not run:")
        print("\n".join(missing))
    print("hardware-only (only a real GPU runs these):")
    print("\n".join(hardware) or "  none")
    share = executed / total if total else 0.0
    print(f"cuda paths: {executed}/{total} lines executed ({share:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
