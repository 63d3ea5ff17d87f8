"""scripts/profile.py refuses bad input before any work and before anything is written (issue 10):
exit 2, exactly one stderr line, no traceback, no child started, the file tree (inputs, run folder,
calibrations/) byte for byte unchanged. Children are stand-ins (PROFILER_CHILD_CMD), as in
tests/test_profile_cli.py, so a case that wrongly got through would be counted."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.bad_input import assert_refused
from tests.scripts_loader import load_script

import estimator.calibration
from estimator.calibration import SCHEMA

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "tiny-llama.json"
CLI = load_script("profile")

STAND_IN = textwrap.dedent("""
    import os, sys
    with open(os.environ["CALLS"], "a") as f:
        f.write("ran\\n")
    sys.exit(1)
""")
GOOD_ROW = {"id": "tiny#abc", "status": "ok", "backend": "cpu", "model": str(TINY), "batch": "1"}


@pytest.fixture()
def world(tmp_path, monkeypatch):
    """A stand-in child that records every start; calibrations/ in a temporary folder."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    monkeypatch.setenv("PROFILER_CHILD_CMD", f"{sys.executable} {script}")
    monkeypatch.setenv("CALLS", str(tmp_path / "calls.txt"))
    cal = tmp_path / "calibrations"
    cal.mkdir()
    monkeypatch.setattr(estimator.calibration, "CALIBRATION_DIR", cal)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _csv(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    return ",".join(columns) + "\n" + "".join(",".join(str(r.get(c, "")) for c in columns) + "\n" for r in rows)


def _run_folder(base: Path, name: str, files: dict[str, str | bytes]) -> Path:
    folder = base / name
    folder.mkdir()
    for file, content in files.items():
        (folder / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


def _cases(base: Path) -> list[tuple[list[str], str]]:
    sweeps = base / "sweeps"
    sweeps.mkdir()

    def sweep(name: str, content: str | bytes) -> str:
        path = sweeps / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    tiny = ["--model", str(TINY), "--backend", "cpu"]
    run = ["--run", str(base / "new-run")]
    good_sweep = f"grid:\n  - {{model: {TINY}, batch: 1}}\n"
    table = {"schema": SCHEMA, "gpu": "h100-80gb", "factors": {}}
    (base / "corrupt-table.json").write_text("{not json")
    (base / "range-table.json").write_text(json.dumps({**table, "range": ["a"]}))
    (base / "runs-table.json").write_text(json.dumps({**table, "provenance": {"runs": "x"}}))
    (base / "a-file").write_text("not a folder\n")
    folders = {
        "foreign": _run_folder(base, "foreign", {"results.csv": "name,score\nalice,3\n"}),
        "batch": _run_folder(base, "batch", {"results.csv": _csv([{**GOOD_ROW, "batch": "two"}])}),
        "no-id": _run_folder(base, "no-id", {"results.csv": _csv([{**GOOD_ROW, "id": ""}])}),
        "status": _run_folder(base, "status", {"results.csv": _csv([{**GOOD_ROW, "status": "great"}])}),
        "bytes": _run_folder(base, "bytes", {"results.csv": _csv([{**GOOD_ROW, "peak_allocated_bytes": "-5"}])}),
        "latin1": _run_folder(base, "latin1", {"results.csv": "id,status\ncaf\xe9,ok\n".encode("latin-1")}),
        "run-json": _run_folder(base, "run-json", {"run.json": "{broken"}),
        "run-list": _run_folder(base, "run-list", {"run.json": "[]"}),
        "run-invocations": _run_folder(base, "run-invocations", {"run.json": '{"invocations": "many"}'}),
        "run-nan": _run_folder(base, "run-nan", {"run.json": '{"invocations": [{"x": NaN}]}'}),
    }
    return [
        # sweep files
        ([sweep("latin1.yaml", "grid:\n  - {model: caf\xe9}\n".encode("latin-1"))] + run, "not UTF-8"),
        ([sweep("latin1.json", '{"grid": [{"model": "caf\xe9"}]}'.encode("latin-1"))] + run, "not UTF-8"),
        ([sweep("deep.json", "[" * 50_000 + "]" * 50_000)] + run, "nested"),
        ([sweep("nan.json", '{"grid": [{"model": "x", "batch": NaN}]}')] + run, "NaN"),
        ([sweep("nan.yaml", f"grid:\n  - {{model: {TINY}, batch: .nan}}\n")] + run, "malformed"),
        ([sweep("all-invalid.yaml", f"grid:\n  - {{model: {TINY}, batch: [0, -1]}}\n")] + run, "nothing to run"),
        ([sweep("grid-text.yaml", "grid: everything\n")] + run, "grid"),
        ([sweep("empty.yaml", "")] + run, "sweep"),
        ([sweep("huge.json", '{"grid": [{"model": "x", "batch": ' + "9" * 5000 + "}]}")] + run, "digits"),
        ([sweep("seq.yaml", f"grid:\n  - {{model: {TINY}, seq: 1000000000000}}\n")] + run, "nothing to run"),
        ([sweep("unknown.yaml", "grid:\n  - {model: no-such-model-anywhere}\n")] + run, "unknown model"),
        ([sweep("missing-model.yaml", "grid:\n  - {batch: 2}\n")] + run, "model"),
        # run folders
        (tiny + ["--run", str(base / "a-file")], "is a file, not a run folder"),
        (tiny + ["--run", str(folders["foreign"])], "unknown columns"),
        (tiny + ["--run", str(folders["batch"])], "batch"),
        (tiny + ["--run", str(folders["no-id"])], "no id"),
        (tiny + ["--run", str(folders["status"])], "status"),
        (tiny + ["--run", str(folders["bytes"])], "peak_allocated_bytes"),
        (tiny + ["--run", str(folders["latin1"])], "cannot read results"),
        (tiny + ["--run", str(folders["run-json"])], "run.json is corrupt"),
        (tiny + ["--run", str(folders["run-list"])], "run.json is corrupt"),
        (tiny + ["--run", str(folders["run-invocations"])], "run.json is corrupt"),
        (tiny + ["--run", str(folders["run-nan"])], "run.json is corrupt"),
        # calibration tables: checked before the sweep
        (tiny + run + ["--calibration", str(base / "corrupt-table.json")], "is corrupt"),
        (tiny + run + ["--calibration", str(base / "range-table.json")], "range must be"),
        (tiny + run + ["--calibration", str(base / "runs-table.json")], "provenance.runs"),
        (tiny + run + ["--calibration", str(base / "no-table.json")], "calibration file not found"),
        # numbers
        (tiny + run + ["--timeout", "nan"], "--timeout: value must be a finite number"),
        (tiny + run + ["--timeout", "inf"], "--timeout: value must be a finite number"),
        (tiny + run + ["--timeout", "-3"], "--timeout: value must be above 0"),
        (tiny + run + ["--limit", "0"], "--limit: value must be between 1"),
        (tiny + run + ["--warmup", "-1"], "--warmup: value must be between 0"),
        (tiny + run + ["--steps", "0"], "--steps: value must be between 1"),
        (tiny + run + ["--steps", "10000000000"], "--steps: value must be between 1"),
        (tiny + run + ["--batch", "0"], "batch must be between 1"),
        (tiny + run + ["--seq", "1000000000000"], "seq must be between 1"),
        (tiny + run + ["--gpus", "0"], "--gpus must be between 1"),
        (tiny + run + ["--gpu", "no-such-gpu"], "no-such-gpu"),
        (tiny + run + ["--format", "xlsx"], "invalid choice"),
        ([good_sweep and sweep("good.yaml", good_sweep), "--model", str(TINY)] + run, "not both"),
    ]


def test_bad_input_is_refused_before_anything_runs_or_is_written(world, capsys):
    cases = _cases(world)
    for argv, words in cases:
        assert_refused(CLI, capsys, argv, words, "profile.py", world)
    assert not (world / "calls.txt").exists()          # no child ever started
    assert not (world / "new-run").exists()            # no run folder was made
    assert len(cases) >= 40


def test_a_corrupt_table_it_would_refresh_is_refused_before_the_sweep(world, capsys):
    (world / "calibrations" / "h100-80gb.json").write_text('{"schema": "' + SCHEMA + '", "gpu": 5}')
    assert_refused(CLI, capsys, ["--model", str(TINY), "--backend", "cpu", "--gpu", "h100-80gb",
                                 "--run", str(world / "new-run")], "gpu must name", "profile.py", world)
    assert not (world / "calls.txt").exists()
    assert not (world / "new-run").exists()
