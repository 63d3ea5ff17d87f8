#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels the GPU machine lacks, for Python 3.12 x86-64:
# bitsandbytes, the project's transformers and peft (the machine's image holds older ones: the first
# H100 run carried these so that the rows measure the versions the estimator models), liger-kernel
# (pure Python, 0.9 MB; the machine's CUDA torch brings its triton), and deepspeed
# (an sdist: its wheel is pure Python, built here) with the needs the image does not have.
# About 63 MB: what travels (the working tree and the carried paths) must stay under 64 MiB, so
#     scripts/fetch_gpu_wheels.sh --fp8
# fetches torchao (fp8 training) in place of deepspeed and its needs (a sweep with fp8 and no ZeRO).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
# pydantic requires one exact pydantic-core: both pinned to the pair the project's venv resolved
# (tests/test_gpu_session.py checks the pins against pydantic's own metadata and pyproject.toml).
pkgs=(bitsandbytes==0.50.2 transformers==5.23.0 peft==0.21.2 liger-kernel==0.8.5)
if [ "${1:-}" = "--fp8" ]; then
  pkgs+=(torchao==0.18.0)
else
  pkgs+=(hjson pydantic==2.14.3 pydantic-core==2.50.4 annotated-types typing-inspection typing-extensions)
fi
for pkg in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl "$pkg"
done
[ "${1:-}" = "--fp8" ] || python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
ls -la .whl
du -cb .whl/* | tail -1
