"""profiler/runner.py and profiler/search.py with stand-in children (small scripts written here):
ok and oom rows, a crash, a hang past the timeout, unreadable results, multi-rank gathering, the
launcher commands, GPU slug matching, and the max-batch search against a known OOM threshold."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from profiler.case import Case
from profiler.env import match_gpu_slug
from profiler.record import new_row
from profiler.runner import Runner, collect_rows, launch_command, read_result_rows, run_sweep
from profiler.search import Boundary, max_value, search
from profiler.store import RunStore

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "data" / "tiny-llama.json")

HEADER = textwrap.dedent("""
    import argparse, json, os, signal, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--case"); p.add_argument("--out"); p.add_argument("--backend")
    a = p.parse_args()
    case = json.load(open(a.case))
    batch = case["settings"].get("batch", 1)
    def write(rows):
        json.dump(rows, open(a.out, "w"))
""")


def child(tmp_path: Path, body: str, name: str = "child.py") -> list[str]:
    """A stand-in child: the common header (argument parsing) plus `body`."""
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body))
    return [sys.executable, str(path)]


def case(**settings) -> Case:
    return Case(TINY, {"precision": "fp32", "seq": 64, **settings}, warmup=1, steps=2)


OK_CHILD = """
    with open(os.environ.get("CALLS", os.devnull), "a") as f:
        f.write(f"{batch}\\n")
    if batch > THRESHOLD:
        write([{"status": "oom", "backend": a.backend, "message": "CUDA out of memory. Tried to allocate"}])
    else:
        write([{"status": "ok", "backend": a.backend, "step_s": 0.5, "peak_allocated_bytes": 1000 * batch,
                "gpu_name": "stand-in"}])
"""


def threshold_child(tmp_path: Path, threshold: int) -> list[str]:
    return child(tmp_path, OK_CHILD.replace("THRESHOLD", str(threshold)))


def test_ok_row_is_completed_with_what_the_parent_knows(tmp_path):
    c = case(batch=2)
    rows = Runner(backend="cpu", child_cmd=threshold_child(tmp_path, 8), gpu_slug="a100-80gb").run(c)
    assert len(rows) == 1
    r = rows[0]
    assert r["status"] == "ok" and r["message"] == ""
    assert r["id"] == c.id and r["model"] == TINY and r["model_type"] == "llama"
    assert r["batch"] == 2 and r["seq"] == 64 and r["precision"] == "fp32" and r["method"] == "full"
    assert r["lora_targets"] == "q_proj,v_proj"
    assert r["warmup"] == 1 and r["steps"] == 2 and r["rank"] == 0 and r["world_size"] == 1
    assert r["backend"] == "cpu" and r["gpu_slug"] == "a100-80gb" and r["gpu_name"] == "stand-in"
    assert r["peak_allocated_bytes"] == 2000 and r["step_s"] == 0.5
    assert r["wall_s"] > 0 and r["started_at"] and r["hostname"]


def test_oom_is_recorded_and_the_sweep_goes_on(tmp_path):
    cases = [case(batch=b) for b in (1, 16, 2)]
    store = RunStore(tmp_path / "run")
    outcome = run_sweep(cases, Runner(child_cmd=threshold_child(tmp_path, 8)), store, progress=False)
    assert outcome.ran == 3 and outcome.statuses == {"ok": 2, "oom": 1}
    by_batch = {r["batch"]: r for r in store.rows()}
    assert by_batch[16]["status"] == "oom" and "out of memory" in by_batch[16]["message"]
    assert by_batch[16]["peak_allocated_bytes"] is None
    assert by_batch[1]["status"] == by_batch[2]["status"] == "ok"


def test_a_crash_becomes_an_error_row_with_the_last_stderr_lines(tmp_path):
    cmd = child(tmp_path, """
        print("loading model", file=sys.stderr)
        print("RuntimeError: CUDA error: an illegal memory access was encountered", file=sys.stderr)
        sys.exit(3)
    """)
    (r,) = Runner(child_cmd=cmd).run(case())
    assert r["status"] == "error"
    assert "code 3" in r["message"] and "illegal memory access" in r["message"]
    assert "\n" not in r["message"]


def test_a_signal_death_is_named(tmp_path):
    cmd = child(tmp_path, """
        print("about to fault", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    """)
    (r,) = Runner(child_cmd=cmd).run(case())
    assert r["status"] == "error" and "SIGSEGV" in r["message"] and "about to fault" in r["message"]


def test_a_hang_is_killed_at_the_timeout_with_its_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    cmd = child(tmp_path, f"""
        import subprocess
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pid_file)!r}, "w").write(str(g.pid))
        print("stuck in NCCL init", file=sys.stderr, flush=True)
        time.sleep(120)
    """)
    t0 = time.monotonic()
    (r,) = Runner(child_cmd=cmd, timeout_s=2).run(case())
    assert time.monotonic() - t0 < 30
    assert r["status"] == "error" and "timeout after 2 s" in r["message"] and "stuck in NCCL init" in r["message"]
    assert not alive(int(pid_file.read_text()))


def alive(pid: int) -> bool:
    """True while the process runs (a zombie waiting for init to reap it is dead)."""
    time.sleep(0.2)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_unreadable_results_and_invalid_rows_are_errors(tmp_path):
    garbage = child(tmp_path, 'open(a.out, "w").write("[{not json")', "garbage.py")
    (r,) = Runner(child_cmd=garbage).run(case())
    assert r["status"] == "error" and "unreadable result" in r["message"]
    zero = child(tmp_path, 'write([{"status": "ok", "backend": a.backend, "peak_allocated_bytes": 0}])', "zero.py")
    (r,) = Runner(child_cmd=zero).run(case())
    assert r["status"] == "error" and "invalid row" in r["message"]


def test_the_child_gets_the_case_and_backend(tmp_path):
    seen = tmp_path / "seen.json"
    cmd = child(tmp_path, f"""
        json.dump({{"case": case, "backend": a.backend, "cwd": os.getcwd()}}, open({str(seen)!r}, "w"))
        write([{{"status": "skipped", "backend": a.backend, "message": "bitsandbytes is not installed"}}])
    """)
    c = case(method="lora", lora_rank=8)
    (r,) = Runner(backend="trace", child_cmd=cmd).run(c)
    got = json.loads(seen.read_text())
    assert Case.from_dict(got["case"]) == c and got["backend"] == "trace"
    assert Path(got["cwd"]) == ROOT
    assert r["status"] == "skipped" and r["backend"] == "trace"


def test_child_command_from_the_environment(tmp_path, monkeypatch):
    cmd = threshold_child(tmp_path, 8)
    monkeypatch.setenv("PROFILER_CHILD_CMD", " ".join(cmd))
    (r,) = Runner().run(case())
    assert r["status"] == "ok" and r["peak_allocated_bytes"] == 1000


def test_logs_go_to_the_log_folder(tmp_path):
    cmd = child(tmp_path, 'print("hello from the child"); write([{"status": "ok", "backend": a.backend}])')
    Runner(child_cmd=cmd, log_dir=tmp_path / "logs").run(case())
    outs = list((tmp_path / "logs").glob("*.stdout"))
    assert len(outs) == 1 and "hello from the child" in outs[0].read_text()


# ---- several ranks -----------------------------------------------------------------------------

def test_rank_files_are_gathered_and_missing_ranks_become_errors(tmp_path):
    c = case(gpus=3, zero=2)
    out = tmp_path / "result.json"
    out.write_text(json.dumps([{"status": "ok", "backend": "cuda", "rank": 0, "peak_allocated_bytes": 10}]))
    (tmp_path / "result.rank1.json").write_text(json.dumps(
        [{"status": "ok", "backend": "cuda", "rank": 1, "peak_allocated_bytes": 11}]))
    (tmp_path / "result.rank0.json").write_text(json.dumps(  # rank 0 twice: the first seen is kept
        [{"status": "ok", "backend": "cuda", "rank": 0, "peak_allocated_bytes": 99}]))
    raw, problem = read_result_rows(out)
    assert problem is None and len(raw) == 3
    known = new_row(c, "cuda", message="")
    rows = collect_rows(c, raw, known, "child exited with code 1 without a result for this rank")
    assert [r["rank"] for r in rows] == [0, 1, 2]
    assert [r["peak_allocated_bytes"] for r in rows[:2]] == [10, 11]
    assert rows[2]["status"] == "error" and "code 1" in rows[2]["message"]
    assert all(r["world_size"] == 3 and r["id"] == c.id for r in rows)


def test_launch_commands():
    base = [sys.executable, "-m", "profiler.child"]
    assert launch_command(base, 1, 2, 0) == base
    ds = launch_command(base, 4, 2, 29511)
    assert ds[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert ds[ds.index("--num_gpus") + 1] == "4" and ds[ds.index("--master_port") + 1] == "29511"
    assert "--no_local_rank" in ds and ds[-2:] == ["--module", "profiler.child"]
    tr = launch_command(base, 2, 0, 29511)
    assert tr[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert tr[tr.index("--nproc_per_node") + 1] == "2" and tr[-2:] == ["-m", "profiler.child"]
    script = launch_command([sys.executable, "/x/child.py"], 2, 3, 1)
    assert script[-1] == "/x/child.py" and "--module" not in script


@pytest.mark.parametrize("name, gib, slug", [
    ("NVIDIA H100 80GB HBM3", 79.1, "h100-80gb"),
    ("NVIDIA H100 PCIe", 79.6, "h100-80gb-pcie"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", 39.4, "a100-40gb-pcie"),
    ("NVIDIA A10G", 22.0, "a10g-24gb"),
    ("NVIDIA A10", 22.0, "a10-24gb"),
    ("NVIDIA L4", 22.0, "l4-24gb"),
    ("NVIDIA L40S", 44.4, "l40s-48gb"),
    ("NVIDIA GeForce RTX 4090", 23.6, "rtx4090-24gb"),
    ("Tesla T4", 14.6, "t4-16gb"),
    ("NVIDIA H200", 139.8, "h200-141gb"),
    ("AMD Instinct MI300X", 192.0, None),
])
def test_gpu_names_match_their_table_rows(name, gib, slug):
    assert match_gpu_slug(name, int(gib * 2**30)) == slug


# ---- the max-batch search ------------------------------------------------------------------------

def fake_probe(threshold: int, calls: list):
    def probe(value: int) -> str:
        calls.append(value)
        return "ok" if value <= threshold else "oom"
    return probe


@pytest.mark.parametrize("threshold", [1, 2, 3, 5, 13, 16, 17, 100, 1023])
def test_search_finds_exactly_the_largest_fitting_value(threshold):
    calls = []
    b = search(fake_probe(threshold, calls), start=1, limit=1024)
    assert b.largest_ok == threshold and b.smallest_oom == threshold + 1
    assert len(calls) == len(set(calls)) == len(b.probes)  # nothing probed twice
    doubling = threshold.bit_length() + 1                   # 1, 2, 4, ... up to the first OOM
    assert len(calls) <= doubling + threshold.bit_length()  # then a bisection of the last octave
    assert [v for v, _ in b.probes] == calls


def test_search_edges():
    assert (search(fake_probe(0, []), 1, 1024).largest_ok, search(fake_probe(0, []), 1, 1024).smallest_oom) == (None, 1)
    top = search(fake_probe(10**6, []), 1, 1024)
    assert top.largest_ok == 1024 and top.smallest_oom is None
    seq = search(fake_probe(1000, []), start=256, limit=131072, step=64)
    assert seq.largest_ok == 960 and seq.smallest_oom == 1024
    low = search(fake_probe(100, []), start=256, limit=4096, step=64)  # the start OOMs: bisect down
    assert low.largest_ok == 64 and low.smallest_oom == 128


def test_search_stops_on_an_error():
    def probe(value):
        return "ok" if value < 4 else "error"
    b = search(probe, 1, 1024, boundary=Boundary("x", "batch"))
    assert b.largest_ok == 2 and b.smallest_oom is None and b.stopped == "error at batch=4"


def test_max_batch_with_a_child_whose_threshold_is_known(tmp_path, monkeypatch):
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("CALLS", str(calls))
    store = RunStore(tmp_path / "run")
    runner = Runner(child_cmd=threshold_child(tmp_path, 6))
    b = max_value(case(batch=3), "batch", runner, store)
    assert (b.largest_ok, b.smallest_oom) == (6, 7)
    probed = [int(x) for x in calls.read_text().split()]
    assert probed == [v for v, _ in b.probes] and len(probed) == len(set(probed))
    assert sorted(r["batch"] for r in store.rows()) == sorted(probed)  # every probe is a stored row
    assert b.base_id == case(batch=1).id
    again = max_value(case(batch=3), "batch", runner, store)           # resumed: probes are reused
    assert (again.largest_ok, again.smallest_oom) == (6, 7)
    assert [int(x) for x in calls.read_text().split()] == probed


def test_two_ranks_under_torchrun_write_one_row_each(tmp_path):
    """The launcher path for real (torchrun runs on CPU): each rank writes <stem>.rank<r>.json."""
    cmd = child(tmp_path, """
        rank = int(os.environ["RANK"])
        assert int(os.environ["WORLD_SIZE"]) == 2 and "--local_rank" not in " ".join(sys.argv)
        stem, _ = os.path.splitext(a.out)
        json.dump([{"status": "ok", "backend": a.backend, "rank": rank, "peak_allocated_bytes": 100 + rank}],
                  open(f"{stem}.rank{rank}.json", "w"))
    """)
    rows = Runner(child_cmd=cmd, timeout_s=120).run(case(gpus=2))
    assert [(r["rank"], r["status"], r["peak_allocated_bytes"]) for r in rows] == [(0, "ok", 100), (1, "ok", 101)]
    assert all(r["world_size"] == 2 for r in rows)


def test_a_timeout_during_the_result_write_names_both(tmp_path):
    cmd = child(tmp_path, """
        open(a.out, "w").write('[{"status": "ok", ')
        time.sleep(120)
    """)
    (r,) = Runner(child_cmd=cmd, timeout_s=2).run(case())
    assert r["status"] == "error" and "timeout after 2 s" in r["message"] and "unreadable result" in r["message"]


def test_max_seq_stays_within_the_position_table(tmp_path):
    """tiny-llama has 256 positions: with 8 generated tokens the longest prompt probed is 192."""
    cmd = child(tmp_path, 'write([{"status": "ok", "backend": a.backend}])')
    b = max_value(case(method="inference", new_tokens=8), "seq", Runner(child_cmd=cmd), RunStore(tmp_path / "run"))
    assert b.largest_ok == 192 and b.smallest_oom is None and [v for v, _ in b.probes] == [192]


def test_launcher_variables_from_the_shell_do_not_reach_children(monkeypatch, tmp_path):
    """RANK/WORLD_SIZE/MASTER_* left in the user's shell must not make a one-process child join a
    process group: the child's environment drops them (the launcher sets its workers' own)."""
    from profiler import runner

    for name, value in (("RANK", "3"), ("LOCAL_RANK", "3"), ("WORLD_SIZE", "8"), ("MASTER_PORT", "29500"),
                        ("TORCHELASTIC_RUN_ID", "x"), ("KEEP_ME", "1")):
        monkeypatch.setenv(name, value)
    out = tmp_path / "env.json"
    code, timed_out = runner.execute(
        [sys.executable, "-c", f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"],
        tmp_path / "o.log", tmp_path / "e.log", 60)
    assert code == 0 and not timed_out
    env = json.loads(out.read_text())
    assert env["KEEP_ME"] == "1"
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)


# ---- temporary case folders (issue 10 item 5) ---------------------------------------------------

@pytest.mark.parametrize("body, timeout_s", [
    ("write([{'status': 'ok', 'backend': a.backend, 'step_s': 0.1}])", 30),       # ok
    ("write([{'status': 'oom', 'backend': a.backend, 'message': 'CUDA out of memory'}])", 30),
    ("sys.exit(3)", 30),                                                          # crash
    ("os.kill(os.getpid(), signal.SIGKILL)", 30),                                 # killed
    ("time.sleep(60)", 1),                                                        # timeout
])
def test_the_case_folder_is_removed_however_the_configuration_ends(tmp_path, monkeypatch, body, timeout_s):
    import tempfile

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    cmd = child(tmp_path, "print(os.path.dirname(a.case))\n" + body)
    (r,) = Runner(child_cmd=cmd, timeout_s=timeout_s).run(case())
    assert r["status"] in ("ok", "oom", "error")
    assert list(temp.iterdir()) == []


def test_case_folders_of_dead_profilers_are_removed_and_living_ones_kept(tmp_path):
    import os
    import subprocess

    from profiler.runner import CASE_FOLDER_PREFIX, remove_stale_case_folders

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = tmp_path / f"{CASE_FOLDER_PREFIX}{int(dead.stdout)}-abc"
    living = tmp_path / f"{CASE_FOLDER_PREFIX}{os.getpid()}-def"
    other = tmp_path / "someone-elses-folder"
    for folder in (stale, living, other):
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "case.json").write_text("{}")
    assert remove_stale_case_folders(str(tmp_path)) == [stale]
    assert not stale.exists() and living.exists() and other.exists()
