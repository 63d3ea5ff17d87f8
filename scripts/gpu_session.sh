#!/usr/bin/env bash
# One call on a lent GPU machine (issue 6): install the carried wheels, run the gpu-marked tests,
# run the default sweep with the profiler, and pack everything it produced into $OUT.
#
# Prepare here (CPU machine), once: scripts/fetch_gpu_wheels.sh puts bitsandbytes, transformers, peft,
# deepspeed and DeepSpeed's pure-Python needs (or, with --fp8, torchao in their place) for Python 3.12
# into .whl/ (git-ignored).
# Then call the device tool with carry [".whl", "runs/gpu"] and the command:
#     bash scripts/gpu_session.sh [SWEEP_FILE] [LIMIT_S] [--no-tests]
# with GPU_SESSION_S (default 540) at most the device call's timeout_s less 30 s: the tests stop
# starting after half of it and the sweep ends in time for the packing.
# The first H100 call (2026-11-27) ran profiler/sweeps/first-contact.yaml and measured 16 of its 32
# configurations; the second (same day) ran profiler/sweeps/second-contact.yaml, 17 of 19 (its GPU
# tests took 400 s of the call: pass --no-tests when the tests' logs are not what the call is for).
# The next call should run profiler/sweeps/third-contact.yaml (13 configurations). About
# 20 s per configuration, up to 200 s per GPU test: a 560 s command fits one call of a 15-minute budget.
# A device command may run 10 minutes: the sweep stops after LIMIT_S seconds (default 420) and
# the run folder resumes on the next call: unpack the returned run.tgz here first, so that carrying
# runs/gpu brings it back (a carried path that is missing here is REMOVED there, warm machine or not:
# the first H100 call's second run measured its first 7 configurations again). Every call
# returns $OUT/run.tgz (runs/gpu and calibrations/: the measurements copied under
# calibrations/measurements/<gpu>/ and the refreshed calibrations/<gpu>.json) with the logs:
# unpack, check, commit.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
SWEEP=${1:-}
LIMIT_S=${2:-420}
TESTS=${3:-}
export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1 || echo "wheel install failed: see pip.log"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  python3 -c "import bitsandbytes, deepspeed; print('bitsandbytes', bitsandbytes.__version__, 'deepspeed', deepspeed.__version__)"
} >"$OUT/env.txt" 2>&1
if [ "$TESTS" != "--no-tests" ]; then
  # one pytest per test, each under its own timeout, so that every failure's traceback is written
  # (the first H100 call ran them in one pytest under one timeout: 3 failures, no traceback came back;
  # the second gave each 100 s, which Llama-3.1-8B's int8 build did not finish in)
  python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only tests/test_gpu.py 2>/dev/null \
    | grep '::' >"$OUT/gpu_tests.ids" || true
  : >"$OUT/gpu_tests.log"
  while read -r id; do
    echo "=== $id" >>"$OUT/gpu_tests.log"
    if [ "$SECONDS" -gt $(( ${GPU_SESSION_S:-540} / 2 )) ]; then   # half the call at most for the tests
      echo "not run: the tests had half of GPU_SESSION_S" >>"$OUT/gpu_tests.log"
      continue
    fi
    timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu "$id" >>"$OUT/gpu_tests.log" 2>&1
    echo "exit $?" >>"$OUT/gpu_tests.log"
  done <"$OUT/gpu_tests.ids"
  grep -c '^exit 0' "$OUT/gpu_tests.log" | sed 's/^/gpu tests passed: /' >>"$OUT/gpu_tests.log"
fi
# the device call's own limit kills everything, the packing below included: the sweep gets what the
# tests left of GPU_SESSION_S (default 540 s; the second H100 call's tests took 400 s and its device
# limit cut the sweep before run.tgz was written)
LEFT_S=$(( ${GPU_SESSION_S:-540} - SECONDS - 20 ))
if [ "$LEFT_S" -lt "$LIMIT_S" ]; then LIMIT_S=$LEFT_S; fi
if [ "$LIMIT_S" -lt 30 ]; then LIMIT_S=30; fi
echo "sweep limit ${LIMIT_S} s" >"$OUT/profile.log"
timeout "$LIMIT_S" python3 scripts/profile.py $SWEEP --run runs/gpu --no-progress >>"$OUT/profile.log" 2>&1
echo "profile exit $?" >>"$OUT/profile.log"
tar czf "$OUT/run.tgz" runs/gpu calibrations 2>/dev/null
tail -n 40 "$OUT"/*.log
