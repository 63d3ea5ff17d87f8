"""Beyond one GPU (issue 16): `--parallel` (one configuration per GPU at once, each child pinned by
CUDA_VISIBLE_DEVICES; a multi-GPU configuration takes the GPUs it needs) and `--executor submitit`
(one job per configuration, tested with submitit's local executor). Stand-in children record
what they saw (their CUDA_VISIBLE_DEVICES, pid, start and end) so the tests check placement and
overlap from the children's side, not from the scheduler's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from profiler.case import Case
from profiler.device import simulated
from profiler.runner import Runner, run_sweep, visible_devices
from profiler.store import RunStore

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "data" / "tiny-llama.json")

CHILD = textwrap.dedent("""
    import argparse, json, os, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--case"); p.add_argument("--out"); p.add_argument("--backend")
    a = p.parse_args()
    seen = {"cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(), "start": time.time(),
            "batch": json.load(open(a.case))["settings"].get("batch", 1)}
    time.sleep(float(os.environ.get("CHILD_SLEEP", "1.0")))
    seen["end"] = time.time()
    with open(os.path.join(os.environ["SEEN_DIR"], f"{os.getpid()}.json"), "w") as f:
        json.dump(seen, f)
    json.dump([{"status": "ok", "backend": a.backend, "step_s": 0.1}], open(a.out, "w"))
""")


def _child(tmp_path: Path) -> list[str]:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return [sys.executable, str(path)]


def _seen(folder: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in folder.glob("*.json")), key=lambda s: s["start"])


def _cases(n: int, **settings) -> list[Case]:
    return [Case(TINY, {"precision": "fp32", "seq": 64, "batch": b, **settings}, warmup=1, steps=1)
            for b in range(1, n + 1)]


@pytest.fixture
def seen_dir(tmp_path, monkeypatch):
    folder = tmp_path / "seen"
    folder.mkdir()
    monkeypatch.setenv("SEEN_DIR", str(folder))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return folder


def test_one_configuration_per_gpu_at_once_in_the_sweeps_order(tmp_path, seen_dir):
    store = RunStore(tmp_path / "run")
    cases = _cases(4)
    outcome = run_sweep(cases, Runner(backend="cuda", child_cmd=_child(tmp_path)), store, progress=False,
                        devices=["0", "1"])
    assert outcome.ran == 4 and outcome.statuses == {"ok": 4}
    seen = _seen(seen_dir)
    assert sorted(s["cvd"] for s in seen) == ["0", "0", "1", "1"]       # each child pinned to one GPU
    first, second = seen[0], seen[1]
    assert second["start"] < first["end"]                             # two ran at the same time
    for a in seen:                                                    # never two on one GPU at once
        for b in seen:
            if a is not b and a["cvd"] == b["cvd"]:
                assert a["end"] <= b["start"] or b["end"] <= a["start"]
    assert [r["id"] for r in store.rows()] == [c.id for c in cases]    # stored in the sweep's order


def test_a_two_process_configuration_takes_two_gpus(tmp_path, seen_dir):
    store = RunStore(tmp_path / "run")
    two = Case(TINY, {"precision": "fp32", "seq": 64, "gpus": 2}, warmup=1, steps=1)
    run_sweep([two, *_cases(1)], Runner(backend="cuda", child_cmd=_child(tmp_path), timeout_s=120), store,
              progress=False, devices=["0", "1"])
    seen = _seen(seen_dir)
    pinned = [s["cvd"] for s in seen]
    assert pinned.count("0,1") == 2 and pinned[-1] in ("0", "1")      # both ranks see both GPUs; then one


def test_the_users_device_list_is_kept_as_given(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa, GPU-bbbb,MIG-cccc")
    assert visible_devices(8) == ["GPU-aaaa", "GPU-bbbb", "MIG-cccc"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_devices(3) == ["0", "1", "2"]


def _profile(args: list[str], env: dict, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "scripts/profile.py", *args], cwd=ROOT, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _sweep_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"name": "parallel-test", "timeout_s": 120,
                                "defaults": {"precision": "fp32", "seq": 64, "warmup": 1, "steps": 1},
                                "grid": [{"model": TINY, "batch": list(range(1, n + 1))}]}))
    return path


def test_profile_py_parallel_on_two_simulated_gpus(tmp_path, seen_dir):
    env = {**simulated.environment(count=2), "PROFILER_CHILD_CMD": " ".join(_child(tmp_path)), "CHILD_SLEEP": "0.5"}
    proc = _profile([str(_sweep_file(tmp_path, 4)), "--run", str(tmp_path / "run"), "--parallel", "2",
                     "--backend", "cuda", "--no-progress", "--no-refresh", "--json"], env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert json.loads(out)["statuses"] == {"ok": 4}
    assert sorted(s["cvd"] for s in _seen(seen_dir)) == ["0", "0", "1", "1"]


def test_parallel_beyond_the_gpus_present_is_refused(tmp_path):
    proc = _profile([str(_sweep_file(tmp_path, 2)), "--run", str(tmp_path / "run"), "--parallel", "3",
                     "--backend", "cuda"], simulated.environment(count=2))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.strip().splitlines() == [
        "profile.py: error: --parallel 3 asks for 3 GPUs; this machine has 2"]
    assert not (tmp_path / "run").exists()


def _stand_ins(parent: psutil.Process) -> list:
    out = []
    for p in parent.children(recursive=True):
        try:
            if "child.py" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:          # gone, or a zombie, meanwhile
            pass
    return out


def test_sigterm_during_a_parallel_sweep_leaves_no_child(tmp_path, seen_dir):
    env = {**simulated.environment(count=2), "PROFILER_CHILD_CMD": " ".join(_child(tmp_path)), "CHILD_SLEEP": "30"}
    proc = _profile([str(_sweep_file(tmp_path, 4)), "--run", str(tmp_path / "run"), "--parallel", "2",
                     "--backend", "cuda", "--no-progress", "--no-refresh"], env)
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    children = []
    while time.monotonic() < deadline:       # both GPUs busy: two stand-in children asleep
        children = _stand_ins(parent)
        if len(children) == 2:
            break
        time.sleep(0.2)
    assert len(children) == 2
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    gone, alive = psutil.wait_procs(children, timeout=20)
    assert not alive, [p.pid for p in alive]


def test_submitit_local_executor_runs_each_configuration_as_a_job(tmp_path, seen_dir):
    env = {"PROFILER_CHILD_CMD": " ".join(_child(tmp_path)), "CHILD_SLEEP": "0.1"}
    proc = _profile([str(_sweep_file(tmp_path, 2)), "--run", str(tmp_path / "run"), "--executor", "submitit",
                     "--submitit-cluster", "local", "--backend", "cpu", "--no-progress", "--no-refresh", "--json"], env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert json.loads(out)["statuses"] == {"ok": 2}
    assert len(_seen(seen_dir)) == 2
    jobs = list((tmp_path / "run" / "submitit").glob("*_result.pkl"))
    assert len(jobs) == 2                               # one submitit job per configuration
    store = RunStore(tmp_path / "run")                  # rows came back through the jobs' results
    assert [r["batch"] for r in store.rows()] == [1, 2]
