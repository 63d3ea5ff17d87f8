#!/usr/bin/env bash
# One call on a lent GPU machine (issue 6): install the carried wheels, run the gpu-marked tests,
# run the default sweep with the profiler, and pack everything it produced into $OUT.
#
# Prepare here (CPU machine), once: scripts/fetch_gpu_wheels.sh puts bitsandbytes, transformers, peft,
# deepspeed and DeepSpeed's pure-Python needs (or, with --fp8, torchao in their place) for Python 3.12
# into .whl/ (git-ignored).
# Then call the device tool with carry [".whl", "runs/gpu"] and the command:
#     bash scripts/gpu_session.sh [SWEEP_FILE] [LIMIT_S] [--no-tests]
# The first H100 call (2026-11-27) ran profiler/sweeps/first-contact.yaml and measured 16 of its 32
# configurations; the next call should run profiler/sweeps/second-contact.yaml (the other 16). About
# 20 s per configuration, 150 s for the GPU tests: a 560 s command fits one call of a 15-minute budget.
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
  # (the first H100 call ran them in one pytest under one timeout: 3 failures, no traceback came back)
  python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only tests/test_gpu.py 2>/dev/null \
    | grep '::' >"$OUT/gpu_tests.ids" || true
  : >"$OUT/gpu_tests.log"
  while read -r id; do
    echo "=== $id" >>"$OUT/gpu_tests.log"
    timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu "$id" >>"$OUT/gpu_tests.log" 2>&1
    echo "exit $?" >>"$OUT/gpu_tests.log"
  done <"$OUT/gpu_tests.ids"
  grep -c '^exit 0' "$OUT/gpu_tests.log" | sed 's/^/gpu tests passed: /' >>"$OUT/gpu_tests.log"
fi
timeout "$LIMIT_S" python3 scripts/profile.py $SWEEP --run runs/gpu --no-progress >"$OUT/profile.log" 2>&1
echo "profile exit $?" >>"$OUT/profile.log"
tar czf "$OUT/run.tgz" runs/gpu calibrations 2>/dev/null
tail -n 40 "$OUT"/*.log
