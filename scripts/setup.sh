#!/usr/bin/env bash
# Create .venv and install the project with its pinned dependencies (CPU torch 2.13.0 first, so
# that nothing pulls the multi-GB CUDA build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# triton (liger-kernel's dependency) pinned with it: the CPU torch names no triton, a CUDA torch its own
.venv/bin/python -m pip install -q torch==2.13.0 triton==3.9.0
.venv/bin/python -m pip install -q -e ".[test]"
