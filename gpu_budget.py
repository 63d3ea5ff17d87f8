"""The `gpu-budget` console command (pyproject [project.scripts]): one program, sub-commands that
are the project's command lines.

  gpu-budget estimate ...   estimator/cli.py  (as python scripts/estimate.py)
  gpu-budget profile ...    profiler/cli.py   (as python scripts/profile.py)
  gpu-budget import FILE    profiler/imports.py (as python scripts/profile.py import FILE)
  gpu-budget fit ...        fitting/cli.py    (refit a calibration table from measurements)
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"estimate": ("estimator.cli", "predict memory, time and cost of a job"),
            "profile": ("profiler.cli", "measure real steps and compare with the estimator"),
            "import": ("profiler.imports", "store published or your own measurements (CSV/JSON) with provenance"),
            "fit": ("fitting.cli", "refit a GPU's calibration table from measurements")}


def _usage() -> str:
    lines = ["usage: gpu-budget {" + ",".join(COMMANDS) + "} ...", ""]
    lines += [f"  {name:<10}{what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"gpu-budget: error: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest, prog=f"gpu-budget {name}")


if __name__ == "__main__":
    sys.exit(main())
