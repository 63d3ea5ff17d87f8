"""Load a command-line script of scripts/ as a module (the scripts folder is not a package)."""

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """scripts/<name>.py as a fresh module named `<name>_cli_under_test`."""
    spec = importlib.util.spec_from_file_location(f"{name}_cli_under_test", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call_main(module, capsys, *argv) -> tuple:
    """(exit code, stdout, stderr) of `module.main(argv)`; argparse errors raise SystemExit."""
    try:
        code = module.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err
