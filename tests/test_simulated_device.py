"""The CUDA path on a simulated device (profiler/device/simulated.py, issue 16): the real child,
measure, nvml, runner, search, session and profile.py code run with `backend cuda` while tensors live
on the CPU; the allocator (the tracer's byte accounting), OOM past the capacity, events and NVML
(per-process, none, MIG) are simulated. Rows say backend `simulated` and are never fitted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts_loader import call_main, load_script

import estimator.calibration
from profiler.case import Case
from profiler.device import simulated

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "data" / "tiny-llama.json")
GiB = 2**30


def _child(tmp_path, settings: dict, **device) -> dict:
    case = Case(TINY, {"precision": "fp32", "seq": 64, "batch": 2, **settings}, warmup=1, steps=2)
    (tmp_path / "case.json").write_text(case.to_json())
    env = {**os.environ, **simulated.environment(**device)}
    done = subprocess.run([sys.executable, "-m", "profiler.child", "--case", str(tmp_path / "case.json"),
                           "--out", str(tmp_path / "out.json"), "--backend", "cuda"],
                          env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads((tmp_path / "out.json").read_text())
    return row


def test_a_training_step_is_measured_through_the_cuda_path(tmp_path):
    row = _child(tmp_path, {"method": "full"}, capacity_bytes=80 * GiB, nvml="per-process")
    assert (row["status"], row["backend"]) == ("ok", "simulated"), row["message"]
    assert row["gpu_name"] == "NVIDIA H100 80GB HBM3 (simulated)" and row["gpu_slug"] == "h100-80gb"
    # reserved: the allocated peak in whole 2 MiB segments; NVML: reserved + the 512 MiB context
    assert row["peak_reserved_bytes"] == -(-row["peak_allocated_bytes"] // (2 * 2**20)) * 2 * 2**20
    assert row["device_used_source"] == "nvml-process"
    assert row["device_used_bytes"] >= row["peak_reserved_bytes"] + 512 * 2**20
    assert row["context_bytes"] == 512 * 2**20 and row["alloc_retries"] == 0 and row["step_s"] > 0


def test_the_simulated_peak_is_the_tracer_s(tmp_path):
    # numbers from the tracer where hardware numbers are unknowable: the same byte accounting on real
    # CPU tensors as on fake ones (CPU kernels may allocate a little differently)
    from profiler.trace import trace

    settings = {"method": "lora", "precision": "fp32", "seq": 64, "batch": 2}
    row = _child(tmp_path, settings, capacity_bytes=80 * GiB)
    traced = trace(Case(TINY, settings, warmup=1, steps=2)).peak_allocated_bytes
    assert row["peak_allocated_bytes"] == pytest.approx(traced, rel=0.10)


@pytest.mark.parametrize("mode, source", [("none", "nvml-device-delta"), ("mig", None)])
def test_nvml_without_process_lists_or_on_mig(tmp_path, mode, source):
    row = _child(tmp_path, {"method": "full"}, nvml=mode)
    assert row["status"] == "ok" and row["device_used_source"] == source
    if mode == "mig":
        assert row["device_used_bytes"] is None                  # not measured, never GPU 0's reading
    else:
        assert row["device_baseline_bytes"] == 256 * 2**20


def test_past_the_capacity_the_row_is_oom(tmp_path):
    row = _child(tmp_path, {"method": "full"}, capacity_bytes=3_000_000)
    assert (row["status"], row["backend"]) == ("oom", "simulated")
    assert "CUDA out of memory" in row["message"]


def test_profile_py_runs_a_sweep_and_a_search_on_the_simulated_device(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(simulated.ENV, json.dumps({"capacity_bytes": 8 * 2**20}))
    monkeypatch.setattr(estimator.calibration, "CALIBRATION_DIR", tmp_path / "calibrations")
    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"defaults: {{precision: fp32, seq: 64, method: full}}\ngrid:\n  - model: {TINY}\n"
                     f"    batch: [1, 512]\n  - {{model: {TINY}, attn: flash, precision: bf16}}\n")
    cli = load_script("profile")
    code, out, err = call_main(cli, capsys, str(sweep), "--backend", "cuda", "--run", str(tmp_path / "run"),
                               "--gpu", "h100-80gb", "--no-progress", "--timeout", "300")
    assert code == 0, err
    rows = [json.loads(json.dumps(r)) for r in __import__("csv").DictReader(open(tmp_path / "run" / "results.csv"))]
    status = {(r["batch"], r["attn"]): (r["status"], r["backend"]) for r in rows}
    assert status[("1", "sdpa")] == ("ok", "simulated")
    assert status[("512", "sdpa")] == ("oom", "simulated")                  # 8 MiB cannot hold it
    assert status[("1", "flash")][0] == "skipped"                           # flash_attn not installed
    table = tmp_path / "calibrations" / "h100-80gb.json"    # simulated rows are never fitted: a table
    if table.exists():                                       # comes from the committed H100 rows alone
        files = [r["file"] for r in json.loads(table.read_text())["provenance"]["runs"]]
        assert files and all("measurements/h100-80gb/" in f for f in files), files
    committed = Path(__file__).resolve().parents[1] / "calibrations" / "measurements" / "h100-80gb"
    assert not (committed / "run.csv").exists()              # nor copied among the committed measurements
    code, out, err = call_main(cli, capsys, "--model", TINY, "--precision", "fp32", "--seq", "64", "--max-batch",
                               "--backend", "cuda", "--run", str(tmp_path / "search"), "--no-progress")
    assert code == 0, err
    found = json.loads((tmp_path / "search" / "max_batch.json").read_text())[0]
    assert found["field"] == "batch" and found["largest_ok"] >= 1
    assert found["smallest_oom"] == found["largest_ok"] + 1
    rows = list(__import__("csv").DictReader(open(tmp_path / "search" / "results.csv")))
    by_batch = {int(r["batch"]): r["status"] for r in rows}
    assert by_batch[found["largest_ok"]] == "ok" and by_batch[found["smallest_oom"]] == "oom"


def test_a_busy_device_is_refused_after_the_idle_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("PROFILER_IDLE_WAIT_S", "1")
    row = _child(tmp_path, {"method": "full"}, busy=[[4242, 2**30]])
    assert row["status"] == "error"
    assert "GPU not idle before measuring: pid 4242 (1024 MiB) still hold it after 1 s" in row["message"]


def test_without_a_baseline_whole_device_memory_is_not_recorded(tmp_path):
    row = _child(tmp_path, {"method": "full"}, nvml="none", baseline_bytes=0)
    assert row["status"] == "ok" and row["device_used_bytes"] is None and row["device_used_source"] is None


def test_after_a_sticky_cuda_error_the_row_keeps_no_cpu_name(tmp_path):
    row = _child(tmp_path, {"method": "full"}, fault="properties")
    assert row["backend"] == "simulated"
    assert row["gpu_name"] is None and row["gpu_memory_bytes"] is None     # never the CPU's name


def test_launcher_family_is_empty_when_the_parent_is_gone(monkeypatch):
    import psutil

    from profiler import child

    def gone(pid):
        raise psutil.NoSuchProcess(pid)

    monkeypatch.setattr(psutil, "Process", gone)
    assert child.launcher_family() == set()


def test_without_process_lists_a_device_not_back_at_rest_is_busy(tmp_path, monkeypatch):
    # containers: NVML lists no process; 4 GiB in use before CUDA starts means another tenant or a
    # run left behind (an idle GPU's driver reserve is well under 1 GiB)
    monkeypatch.setenv("PROFILER_IDLE_WAIT_S", "1")
    row = _child(tmp_path, {"method": "full"}, nvml="none", baseline_bytes=4 * GiB)
    assert row["status"] == "error"
    assert "processes NVML does not list (4096 MiB) still hold it" in row["message"]
