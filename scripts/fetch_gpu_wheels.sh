#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels the GPU machine lacks, for Python 3.12 x86-64:
# bitsandbytes, torchao (fp8 training) and deepspeed (deepspeed ships an sdist: its wheel is pure
# Python, built here), and deepspeed's needs the machine's image does not have. About 50 MB: under
# the 64 MiB carry.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
# pydantic requires one exact pydantic-core: both pinned to the pair the project's venv resolved
# (tests/test_gpu_session.py checks the pins against pydantic's own metadata).
for pkg in bitsandbytes==0.50.2 torchao==0.18.0 hjson pydantic==2.14.3 pydantic-core==2.50.4 annotated-types typing-inspection typing-extensions; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl "$pkg"
done
python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
ls -la .whl
