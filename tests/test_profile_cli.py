"""scripts/profile.py: one-line errors with exit 2 for bad input; the no-GPU path traces the default
sweep and says so in one line; a sweep killed between configurations keeps what it finished
and resumes with only the rest; --force, --retry-errors and --limit. Children are stand-ins
(PROFILER_CHILD_CMD), so no model is built here."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.scripts_loader import call_main, load_script

import profiler.runner
from profiler.sweep import CPU_SWEEP, DEFAULT_SWEEP, expand, load_sweep

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "profile.py"
TINY = ROOT / "tests" / "data" / "tiny-llama.json"


CLI = load_script("profile")

STAND_IN = textwrap.dedent("""
    import argparse, json, os, signal, sys
    p = argparse.ArgumentParser()
    p.add_argument("--case"); p.add_argument("--out"); p.add_argument("--backend")
    a = p.parse_args()
    case = json.load(open(a.case))
    batch = case["settings"].get("batch", 1)
    with open(os.environ["CALLS"], "a") as f:
        f.write(f"{batch}\\n")
    if batch == int(os.environ.get("KILL_PARENT_AT", "0")):
        os.kill(os.getppid(), signal.SIGKILL)   # the sweep dies between configurations
        sys.exit(0)
    if batch == int(os.environ.get("FAIL_AT", "0")):
        print("Traceback: boom", file=sys.stderr)
        sys.exit(1)
    json.dump([{"status": "ok", "backend": a.backend, "step_s": 0.1 * batch}], open(a.out, "w"))
""")


@pytest.fixture()
def stand_in(tmp_path, monkeypatch):
    """PROFILER_CHILD_CMD points at the stand-in; CALLS collects the batch of every child run."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("PROFILER_CHILD_CMD", f"{sys.executable} {script}")
    monkeypatch.setenv("CALLS", str(calls))
    return calls


def calls_of(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def run_cli(capsys, *argv):
    return call_main(CLI, capsys, *argv)


def sweep_file(tmp_path: Path, batches=(1, 2, 3, 4)) -> Path:
    path = tmp_path / "four.yaml"
    path.write_text(f"defaults: {{precision: fp32, seq: 64}}\ngrid:\n  - model: {TINY}\n    batch: {list(batches)}\n")
    return path


def result_rows(run: Path) -> list[dict]:
    with open(run / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


# ---- bad input -------------------------------------------------------------------------------------

def bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    (tmp_path / "broken.yaml").write_text("grid: [\n  - model: x\n")
    (tmp_path / "unknown.yaml").write_text("grid:\n  - {model: no-such-model-anywhere}\n")
    (tmp_path / "field.yaml").write_text(f"grid:\n  - {{model: {TINY}, bacth: 2}}\n")
    return [
        ([str(tmp_path / "missing.yaml")], "sweep file not found"),
        ([str(tmp_path / "broken.yaml")], "malformed YAML"),
        ([str(tmp_path / "unknown.yaml")], "unknown model"),
        ([str(tmp_path / "field.yaml")], "unknown key 'bacth'"),
        (["--model", "no-such-model-anywhere"], "unknown model"),
        (["--model", str(TINY), "--method", "qlora", "--precision", "fp32"], "QLoRA with fp32"),
        (["--model", str(TINY), "--gpu", "no-such-gpu"], "no-such-gpu"),
        (["--model", str(TINY), "--batch", "0"], "batch must be between 1 and"),
        ([str(tmp_path / "field.yaml"), "--model", str(TINY)], "not both"),
        (["--model", str(TINY), "--timeout", "-3"], "--timeout"),
        (["--model", str(TINY), "--calibration", str(tmp_path / "nope.json")], "calibration file not found"),
        (["--model", str(TINY), "--backend", "gpu"], "invalid choice"),
    ]


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, stand_in):
    for argv, words in bad_inputs(tmp_path):
        code, out, err = run_cli(capsys, *argv, "--run", str(tmp_path / "run"))
        assert code == 2, (argv, err)
        assert out == "" and err.count("\n") == 1 and err.startswith("profile.py: error: "), (argv, err)
        assert words in err, (argv, err)
    assert calls_of(stand_in) == []                 # nothing ran
    assert not (tmp_path / "run").exists()          # and no run folder was made


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    (tmp_path / "broken.yaml").write_text("grid: [\n")
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "broken.yaml")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr and "malformed YAML" in done.stderr


# ---- no GPU --------------------------------------------------------------------------------------

def test_without_a_gpu_the_default_sweep_is_traced(tmp_path, capsys, stand_in, monkeypatch):
    monkeypatch.setattr(profiler.runner, "detect_gpu", lambda *a, **k: None)
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "--run", str(run), "--no-progress", "--limit", "3")
    assert code == 0, err
    notes = [line for line in err.splitlines() if "CUDA" in line]
    assert len(notes) == 1 and notes[0].startswith("no CUDA GPU found") and "default.yaml" in notes[0]
    rows = result_rows(run)
    expected = [c.id for c in expand(load_sweep(DEFAULT_SWEEP)).cases]
    assert [r["id"] for r in rows] == expected[:3]
    assert {r["backend"] for r in rows} == {"trace"}
    assert (run / "sweep.yaml").read_text() == DEFAULT_SWEEP.read_text()
    invocation = json.loads((run / "run.json").read_text())["invocations"][0]
    assert invocation["backend"] == "trace"


def test_backend_cpu_runs_the_embedded_cpu_sweep(tmp_path, capsys, stand_in, monkeypatch):
    monkeypatch.setattr(profiler.runner, "detect_gpu", lambda *a, **k: None)
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "--backend", "cpu", "--run", str(run), "--no-progress")
    assert code == 0, err
    rows = result_rows(run)
    expected = expand(load_sweep(CPU_SWEEP)).cases
    assert sorted(r["id"] for r in rows) == sorted(c.id for c in expected)
    assert {r["backend"] for r in rows} == {"cpu"} and {r["status"] for r in rows} == {"ok"}
    assert {r["method"] for r in rows} == {"full", "lora", "qlora", "inference"}
    assert (run / "sweep.yaml").read_text() == (ROOT / "profiler" / "sweeps" / "cpu-tiny.yaml").read_text()
    assert (run / "parity.png").read_bytes()[:4] == b"\x89PNG"
    invocation = json.loads((run / "run.json").read_text())["invocations"][0]
    assert invocation["backend"] == "cpu" and invocation["argv"] == ["--backend", "cpu", "--run", str(run), "--no-progress"]
    assert invocation["finished_at"] and invocation["environment"]["packages"]["torch"]
    assert "not measured" in out and "%" not in out.split("quantity")[1].splitlines()[1]  # nothing compared


def test_backend_cuda_without_a_gpu_is_bad_input(tmp_path, capsys, stand_in, monkeypatch):
    monkeypatch.setattr(profiler.runner, "detect_gpu", lambda *a, **k: None)
    code, _, err = run_cli(capsys, "--backend", "cuda", "--run", str(tmp_path / "run"))
    assert code == 2 and "no CUDA GPU found" in err and err.count("\n") == 1


# ---- kill, resume, force, retry, limit ---------------------------------------------------------

def test_a_sweep_killed_between_configurations_resumes_with_the_rest(tmp_path, stand_in):
    sweep, run = sweep_file(tmp_path), tmp_path / "run"
    argv = [sys.executable, str(SCRIPT), str(sweep), "--backend", "cpu", "--run", str(run), "--no-progress"]
    env = {**os.environ, "KILL_PARENT_AT": "3"}
    killed = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert killed.returncode == -9
    rows = result_rows(run)
    assert sorted(int(r["batch"]) for r in rows) == [1, 2] and {r["status"] for r in rows} == {"ok"}
    assert calls_of(stand_in) == [1, 2, 3]

    resumed = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert calls_of(stand_in) == [1, 2, 3, 3, 4]                 # only the unfinished ones ran
    rows = result_rows(run)
    assert sorted(int(r["batch"]) for r in rows) == [1, 2, 3, 4]  # nothing lost, nothing duplicated
    assert len({r["id"] for r in rows}) == 4
    assert len(json.loads((run / "run.json").read_text())["invocations"]) == 2


def test_force_retry_errors_and_limit(tmp_path, capsys, stand_in, monkeypatch):
    sweep, run = sweep_file(tmp_path), tmp_path / "run"
    base = [str(sweep), "--backend", "cpu", "--run", str(run), "--no-progress"]
    monkeypatch.setenv("FAIL_AT", "2")
    code, _, err = run_cli(capsys, *base, "--limit", "3")
    assert code == 0, err
    assert calls_of(stand_in) == [1, 2, 3]
    errors = [r for r in result_rows(run) if r["status"] == "error"]
    assert [int(r["batch"]) for r in errors] == [2] and "Traceback: boom" in errors[0]["message"]

    monkeypatch.delenv("FAIL_AT")
    run_cli(capsys, *base)                                   # plain rerun: the error row is kept
    assert calls_of(stand_in) == [1, 2, 3, 4]
    run_cli(capsys, *base, "--retry-errors")                 # now it runs again and is replaced
    assert calls_of(stand_in) == [1, 2, 3, 4, 2]
    assert sorted((int(r["batch"]), r["status"]) for r in result_rows(run)) == [(b, "ok") for b in (1, 2, 3, 4)]
    run_cli(capsys, *base, "--force")
    assert calls_of(stand_in)[-4:] == [1, 2, 3, 4]
    assert len(result_rows(run)) == 4


def test_every_configuration_failing_exits_1(tmp_path, capsys, stand_in, monkeypatch):
    monkeypatch.setenv("FAIL_AT", "1")
    code, _, _ = run_cli(capsys, str(sweep_file(tmp_path, (1,))), "--backend", "cpu",
                         "--run", str(tmp_path / "run"), "--no-progress")
    assert code == 1


def test_max_batch_from_flags(tmp_path, capsys, stand_in, monkeypatch):
    monkeypatch.setenv("FAIL_AT", "0")
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN.replace('json.dump([{"status": "ok"',
                                       'json.dump([{"status": "oom" if batch > 11 else "ok"'))
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "--model", str(TINY), "--precision", "fp32", "--seq", "64", "--max-batch",
                             "--backend", "cpu", "--run", str(run), "--no-progress", "--json")
    assert code == 0, err
    (search,) = json.loads(out)["searches"]
    assert (search["largest_ok"], search["smallest_oom"]) == (11, 12)
    assert json.loads((run / "max_batch.json").read_text()) == [search]
    assert len(result_rows(run)) == len(search["probes"]) == len(calls_of(stand_in))


def test_on_a_gpu_the_default_sweep_runs_filtered_by_prediction(tmp_path, capsys, stand_in, monkeypatch):
    gpu = profiler.runner.GpuInfo("NVIDIA H100 80GB HBM3", int(79.1 * 2**30), 1)
    monkeypatch.setattr(profiler.runner, "detect_gpu", lambda *a, **k: gpu)
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "--run", str(run), "--no-progress", "--limit", "2", "--no-refresh",
                             "--calibration", "none", "--json")
    assert code == 0, err
    assert "no CUDA GPU" not in err
    assert "predicted over 1.3 x the 80 GiB of h100-80gb" in err
    rows = result_rows(run)
    assert len(rows) == 2 and {r["backend"] for r in rows} == {"cuda"} and {r["gpu_slug"] for r in rows} == {"h100-80gb"}
    assert (run / "sweep.yaml").read_text() == (ROOT / "profiler" / "sweeps" / "default.yaml").read_text()
    summary = json.loads(out)
    assert summary["gpu"] == "h100-80gb" and summary["ran"] == 2
    assert summary["compare"]["step_s"]["n"] == 2               # stand-in rows measure step_s only
    assert summary["compare"]["peak_allocated_bytes"]["not_measured"] == 2
