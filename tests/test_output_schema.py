"""The --json output has a versioned, documented JSON Schema (docs/estimate-output.schema.json) that
real outputs validate against (issue 15 item 2); the `gpu-budget` console command and the Python API
of README work."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from tests.scripts_loader import call_main, load_script

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "estimate-output.schema.json").read_text())
CLI = load_script("estimate")
FILES = ROOT / "tests" / "data" / "userfiles"

CASES = [
    ["--model", "llama-3.2-1b"],
    ["--model", "llama-3.1-8b", "--method", "qlora", "--batch", "4", "--seq", "4096", "--gpu", "a10g-24gb"],
    ["--model", "llama-3.1-8b", "--method", "lora", "--zero", "3", "--gpus", "8", "--samples", "10000"],
    ["--model", "llama-3.1-8b", "--method", "inference", "--new-tokens", "128", "--compiled"],
    ["--model", "mixtral-8x7b", "--method", "lora", "--fsdp", "full", "--gpus", "8", "--liger"],
    ["--axolotl", str(FILES / "axolotl_qlora.yaml"), "--samples", "5000"],
    ["--model", "qwen3-8b", "--method", "lora", "--gpu", "h20-96gb", "--samples", "1000"],   # no public price
]


def test_the_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$id"] == "gpu-budget-estimate/1"


@pytest.mark.parametrize("argv", CASES, ids=range(len(CASES)))
def test_outputs_validate(capsys, argv):
    code, out, err = call_main(CLI, capsys, *argv, "--json", "--calibration", "none")
    assert code == 0, err
    data = json.loads(out)
    jsonschema.validate(data, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert data["schema"] == SCHEMA["$id"]


def test_an_undocumented_key_fails_validation(capsys):
    code, out, err = call_main(CLI, capsys, "--model", "llama-3.2-1b", "--json")
    data = json.loads(out)
    data["surprise"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, SCHEMA, cls=jsonschema.Draft202012Validator)


def test_the_console_command_runs_the_sub_commands():
    exe = Path(sys.executable).with_name("gpu-budget")
    assert exe.exists(), "pip install -e . installs the gpu-budget console command"
    out = subprocess.run([str(exe), "estimate", "--model", "llama-3.2-1b", "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]["name"] == "meta-llama/Llama-3.2-1B"
    bad = subprocess.run([str(exe), "estimate", "--model", "llama-3.2-1b", "--batch", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("gpu-budget estimate: error: ")
    unknown = subprocess.run([str(exe), "estimat"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown command 'estimat'" in unknown.stderr
    fit = subprocess.run([str(exe), "fit", "--help"], capture_output=True, text=True, timeout=60)
    assert fit.returncode == 0 and "--gpu" in fit.stdout


def test_the_readme_python_example_runs():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(from estimator import .*?)```", text, re.S)
    assert block, "README shows the Python API"
    scope: dict = {}
    exec(block.group(1), scope)                                  # noqa: S102 - README's own example
    assert scope["e"].verdict in ("fits", "tight", "does not fit")
