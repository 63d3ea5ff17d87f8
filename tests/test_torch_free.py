"""The torch-free modules import with torch (and the libraries built on it) blocked.

The estimator never imports torch (docs/design.md section 1); fitting works on measurement files;
the parent side of profiling (sweeps, the runner, the run folder, the comparison) runs the
children that import torch but must not import it itself. Each module is imported in a fresh
interpreter whose meta-path finder refuses torch, transformers, peft, bitsandbytes, deepspeed and
accelerate, so a top-level import of any of them anywhere below the module fails the test.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "transformers", "peft", "bitsandbytes", "deepspeed", "accelerate")

# Every module of these packages, found on disk (a new module is covered without listing it).
TORCH_FREE_PACKAGES = ("estimator", "fitting")
# The profiler modules that must stay torch-free: what scripts/profile.py's parent process uses
# (profiler.session and what it imports), and the package entry points whose docstrings promise
# it (profiler.trace imports trace.step, trace.layers, build and steps). The rest run inside a
# child process that has torch (child, measure, zero, device.*) or import it at the top
# (trace.tracker, trace.patches, trace.qlora).
TORCH_FREE_PROFILER = (
    "profiler", "profiler.case", "profiler.record", "profiler.sweep", "profiler.store",
    "profiler.runner", "profiler.search", "profiler.compare", "profiler.plot", "profiler.session",
    "profiler.env", "profiler.device", "profiler.trace", "profiler.trace.layers", "profiler.trace.grid",
)
SCRIPTS = ("estimate", "profile")

_PROBE = r"""
import importlib, importlib.util, json, sys
BLOCKED = set(sys.argv[1].split(","))

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: this module must not import it")
        return None

sys.meta_path.insert(0, Refuse())
failed = {}
for name in json.loads(sys.argv[2]):
    try:
        if name.startswith("scripts/"):
            spec = importlib.util.spec_from_file_location("_script_" + name[8:-3], name)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        else:
            importlib.import_module(name)
    except BaseException as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps({"failed": failed, "leaked": leaked}))
"""


def _package_modules(package: str) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _modules() -> list[str]:
    names = [m for p in TORCH_FREE_PACKAGES for m in _package_modules(p)]
    return names + list(TORCH_FREE_PROFILER) + [f"scripts/{s}.py" for s in SCRIPTS]


def _import_blocked(names: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, ",".join(BLOCKED), json.dumps(names)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_torch_free_module_imports_with_torch_blocked():
    names = _modules()
    assert "estimator.api" in names and "fitting.data" in names and len(names) > 30
    result = _import_blocked(names)
    assert not result["failed"], "\n".join(f"{k}: {v}" for k, v in result["failed"].items())
    assert not result["leaked"], result["leaked"]


@pytest.mark.parametrize("module", ["profiler.trace.tracker"])
def test_the_probe_catches_a_module_that_imports_torch(module):
    """The blocker works: a module with a top-level `import torch` fails under it."""
    result = _import_blocked([module])
    assert module in result["failed"] and "blocked" in result["failed"][module]
