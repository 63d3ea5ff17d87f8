"""profiler/store.py: rows survive a round trip with their types, a configuration run again
replaces its rows (never duplicates), resume rules, and atomic writes (a writer killed at any
moment leaves a complete, readable file)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from profiler.case import Case
from profiler.record import COLUMN_NAMES, empty_row
from profiler.store import RunStore, default_run_dir

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "data" / "tiny-llama.json")


def row(case_id: str, status: str = "ok", **values) -> dict:
    r = empty_row()
    r.update(id=case_id, status=status, backend="cuda", message="", rank=0, world_size=1)
    r.update(values)
    return r


def test_round_trip_keeps_types_and_not_measured(tmp_path):
    store = RunStore(tmp_path)
    store.put("a", [row("a", peak_allocated_bytes=85899345921, device_used_bytes=None, step_s=0.125,
                        grad_ckpt=True, double_quant=False, batch=3, lora_targets="q_proj,v_proj",
                        message="it, has \"quotes\", and commas")])
    got = RunStore(tmp_path).rows()[0]
    assert got["peak_allocated_bytes"] == 85899345921 and isinstance(got["peak_allocated_bytes"], int)
    assert got["device_used_bytes"] is None          # not measured stays absent, never 0
    assert got["peak_reserved_bytes"] is None
    assert got["step_s"] == 0.125 and isinstance(got["step_s"], float)
    assert got["grad_ckpt"] is True and got["double_quant"] is False
    assert got["batch"] == 3 and got["rank"] == 0
    assert got["lora_targets"] == "q_proj,v_proj"
    assert got["message"] == "it, has \"quotes\", and commas"
    header = (tmp_path / "results.csv").read_text().splitlines()[0].split(",")
    assert header == COLUMN_NAMES


def test_put_replaces_the_rows_of_an_id_and_keeps_the_others(tmp_path):
    store = RunStore(tmp_path)
    store.put("a", [row("a", status="error", message="timeout")])
    store.put("b", [row("b", rank=0), row("b", rank=1)])
    store.put("a", [row("a", step_s=1.5)])
    rows = RunStore(tmp_path).rows()
    assert sorted(r["id"] for r in rows) == ["a", "b", "b"]
    assert [r["status"] for r in rows if r["id"] == "a"] == ["ok"]


def test_put_refuses_rows_that_would_lie(tmp_path):
    store = RunStore(tmp_path)
    store.put("a", [row("a")])
    with pytest.raises(ValueError):
        store.put("b", [row("b", peak_allocated_bytes=0)])  # a measured 0 is refused
    with pytest.raises(ValueError):
        store.put("c", [row("d")])                           # id mismatch
    assert [r["id"] for r in RunStore(tmp_path).rows()] == ["a"]


def test_pending_resume_rules(tmp_path):
    cases = [Case(TINY, {"batch": b}) for b in (1, 2, 3, 4)]
    store = RunStore(tmp_path)
    store.put(cases[0].id, [row(cases[0].id, "ok")])
    store.put(cases[1].id, [row(cases[1].id, "oom")])
    store.put(cases[2].id, [row(cases[2].id, "error", message="child killed by SIGSEGV")])
    resumed = RunStore(tmp_path)
    assert resumed.pending(cases) == [cases[3]]                                   # error kept as a result
    assert resumed.pending(cases, retry_errors=True) == [cases[2], cases[3]]
    assert resumed.pending(cases, force=True) == cases
    assert resumed.is_finished(cases[2].id) and not resumed.is_finished(cases[2].id, retry_errors=True)


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    import pandas as pd

    store = RunStore(tmp_path)
    store.put("a", [row("a")])
    before = (tmp_path / "results.csv").read_bytes()

    def half_then_fail(self, path, *args, **kwargs):
        Path(path).write_text("id,model\nhalf")
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_csv", half_then_fail)
    with pytest.raises(OSError):
        store.put("b", [row("b")])
    assert (tmp_path / "results.csv").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["results.csv"]


WRITER = textwrap.dedent("""
    import sys
    from profiler.record import empty_row
    from profiler.store import RunStore
    store = RunStore(sys.argv[1])
    for i in range(100000):
        r = empty_row()
        r.update(id=f"case{i}", status="ok", backend="cuda", peak_allocated_bytes=1000 + i, message="")
        store.put(f"case{i}", [r])
""")


def test_a_writer_killed_mid_sweep_leaves_a_complete_file(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not (tmp_path / "results.csv").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    rows = RunStore(tmp_path).rows()
    assert rows, "the writer never finished a single put"
    assert [r["id"] for r in rows] == [f"case{i}" for i in range(len(rows))]  # a prefix, none torn
    assert all(r["peak_allocated_bytes"] == 1000 + i for i, r in enumerate(rows))
    assert not list(tmp_path.glob(".results.*.tmp"))  # a new store cleans a killed writer's temporary


def test_sweep_copy_keeps_an_edited_sweep_beside_the_first(tmp_path):
    store = RunStore(tmp_path / "run")
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("grid: [{model: x}]\n")
    second.write_text("grid: [{model: y}]\n")
    assert store.keep_sweep_copy(first) == "sweep.yaml"
    assert store.keep_sweep_copy(first) == "sweep.yaml"          # same text: nothing new
    other = store.keep_sweep_copy(second)
    assert other != "sweep.yaml" and other.startswith("sweep-")
    assert (store.run_dir / "sweep.yaml").read_text() == first.read_text()
    assert (store.run_dir / other).read_text() == second.read_text()


def test_run_json_records_every_invocation(tmp_path):
    store = RunStore(tmp_path)
    i = store.log_invocation({"argv": ["x"]})
    store.finish_invocation(i, finished_at="later")
    j = RunStore(tmp_path).log_invocation({"argv": ["y"]})
    import json
    data = json.loads((tmp_path / "run.json").read_text())
    assert j == 1 and [d["argv"] for d in data["invocations"]] == [["x"], ["y"]]
    assert data["invocations"][0]["finished_at"] == "later"


def test_default_run_dir_is_labelled_and_never_reused(tmp_path):
    first = default_run_dir("h100-80gb", tmp_path)
    assert first.parent == tmp_path and first.name.startswith("h100-80gb-")
    first.mkdir()
    second = default_run_dir("h100-80gb", tmp_path)
    assert second != first and not second.exists()


def test_parquet_round_trip_when_pyarrow_is_installed(tmp_path):
    pytest.importorskip("pyarrow")
    store = RunStore(tmp_path, "parquet")
    store.put("a", [row("a", peak_allocated_bytes=85899345921, step_s=0.25, grad_ckpt=True)])
    got = RunStore(tmp_path).rows()[0]  # the format is found from the file
    assert got["peak_allocated_bytes"] == 85899345921 and got["step_s"] == 0.25 and got["grad_ckpt"] is True
    assert got["device_used_bytes"] is None


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    from estimator.errors import InputError
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    with pytest.raises(InputError, match="pyarrow"):
        RunStore(tmp_path, "parquet")


def test_resuming_in_the_other_format_is_refused(tmp_path):
    from estimator.errors import InputError

    RunStore(tmp_path).put("a", [row("a")])
    with pytest.raises(InputError, match="results.csv"):
        RunStore(tmp_path, "parquet")
