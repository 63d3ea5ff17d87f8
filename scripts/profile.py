#!/usr/bin/env python3
"""Profile real steps of LLM configurations, compare them with the estimator, refresh calibration:
a thin wrapper of profiler/cli.py (also installed as `gpu-budget profile`).

Examples:
  python scripts/profile.py                                   # default sweep on this GPU (no GPU: traced)
  python scripts/profile.py profiler/sweeps/cpu-tiny.yaml --backend cpu
  python scripts/profile.py --model llama-3.1-8b --method qlora --max-batch --max-seq
"""

import os
import sys

# This file's folder would shadow the standard library's `profile` (imported by cProfile, which
# torch._dynamo imports): replace it on the path by the repository root.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from profiler.cli import _parser, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
