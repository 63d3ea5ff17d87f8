"""Quiet by default (issue 15 item 6): `estimate.py --trace` for plain LoRA prints no library warning
or log line on stderr (at most the progress line of a step that takes over two seconds); with
--verbose the libraries' lines come through (so the check can fail)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRESS = "tracing the real step on fake tensors (profiler.trace; seconds to a minute)..."
ARGV = [sys.executable, str(ROOT / "scripts" / "estimate.py"), "--model", str(ROOT / "tests" / "data" / "tiny-llama.json"),
        "--method", "lora", "--batch", "1", "--seq", "64", "--precision", "fp32", "--trace", "--calibration", "none"]


def test_trace_is_quiet_unless_verbose():
    quiet = subprocess.run(ARGV, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert quiet.returncode == 0, quiet.stderr
    assert [line for line in quiet.stderr.splitlines() if line != PROGRESS] == []
    assert "trace (fake tensors" in quiet.stdout
    loud = subprocess.run(ARGV + ["--verbose"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert loud.returncode == 0, loud.stderr
    assert "Warning" in loud.stderr or "Failed to load" in loud.stderr
