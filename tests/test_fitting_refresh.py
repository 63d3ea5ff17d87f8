"""Tables are validated and written atomically; a refresh merges earlier runs (never silently
dropping them), compares before and after, and refuses corrupt or foreign tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.api import estimate
from estimator.calibration import SCHEMA
from estimator.configs import load_spec
from estimator.workload import Workload
from fitting import calibration_table, synthetic
from fitting.pipeline import fit_files
from fitting.refresh import NEW_LABEL, refresh
from profiler.store import RunStore

GPU = "h100-80gb"
ROOT = Path(__file__).resolve().parents[1]
RUN1 = ("llama-3.2-1b", "tinyllama", "qwen2.5-0.5b", "qwen3-0.6b")
RUN2 = ("llama-3.2-3b", "qwen2.5-1.5b")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    one = synthetic.write_csv(synthetic.rows(GPU, noise=0.01, seed=1, models=RUN1), base / "sweep-1" / "results.csv")
    two = synthetic.write_csv(synthetic.rows(GPU, noise=0.01, seed=2, models=RUN2), base / "sweep-2" / "results.csv")
    return one.parent, two.parent


@pytest.fixture(scope="module")
def fitted(runs):
    return fit_files([runs[0]], GPU)


def test_built_table_is_valid_and_read_by_the_estimator(fitted, tmp_path):
    t = fitted.table
    assert t["schema"] == SCHEMA and t["gpu"] == GPU
    assert t["provenance"]["points"] == len(fitted.data.frame) and t["provenance"]["runs"][0]["sha256"]
    assert t["versions"]["torch"] == ["2.13.0"]
    assert set(t["cv_error"]["peak_allocated_bytes"]) >= {"median_abs", "p90_abs", "under_rate", "points",
                                                         "uncalibrated"}
    assert t["range"]["params_total"][0] <= t["range"]["params_total"][1]
    path = calibration_table.write(tmp_path / f"{GPU}.json", t)
    est = estimate(Workload(load_spec("llama-3.2-1b"), method="lora", seq=1024), GPU, str(path))
    assert est.corrections["activation_scale"]["from"].startswith("calibration")
    assert est.device_used_upper_bytes >= est.memory.device_used_bytes
    assert est.to_dict()["calibration"]["cv_error"] == t["cv_error"]


def test_write_is_atomic_and_refuses_invalid_tables(fitted, tmp_path):
    path = calibration_table.write(tmp_path / "t.json", fitted.table)
    before = path.read_text()
    broken = json.loads(before)
    broken["factors"]["logits_scale"] = 99.0
    with pytest.raises(calibration_table.TableError, match="logits_scale"):
        calibration_table.write(path, broken)
    broken["factors"]["logits_scale"] = float("nan")
    with pytest.raises(calibration_table.TableError):
        calibration_table.write(path, broken)
    assert path.read_text() == before  # untouched
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left behind


def test_read_refuses_corrupt_and_foreign_tables(fitted, tmp_path):
    assert calibration_table.read(tmp_path / "absent.json", GPU) is None
    corrupt = tmp_path / "c.json"
    corrupt.write_text('{"schema": "gpu-budget-calibration/2", "gpu": ')
    with pytest.raises(calibration_table.TableError, match="is corrupt"):
        calibration_table.read(corrupt, GPU)
    foreign = calibration_table.write(tmp_path / "f.json", fitted.table)
    with pytest.raises(calibration_table.TableError, match="fitted on h100-80gb, not a100-80gb"):
        calibration_table.read(foreign, "a100-80gb")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema": "gpu-budget-calibration/1", "factors": {}}))
    with pytest.raises(calibration_table.TableError, match="retired schema"):
        calibration_table.read(old, GPU)


def _layout(tmp_path):
    return tmp_path / "calibrations" / f"{GPU}.json", tmp_path / "calibrations" / "measurements"


def test_refresh_writes_merges_and_keeps_earlier_runs(runs, tmp_path):
    table_path, meas = _layout(tmp_path)
    first = refresh([runs[0]], GPU, table_path, write=True, measurements_dir=meas)
    assert first.written and table_path.is_file()
    assert first.copied == [str(meas / GPU / "sweep-1.csv")]
    assert "uncalibrated" in first.before and NEW_LABEL in first.after
    assert "current table" not in first.before
    second = refresh([runs[1]], GPU, table_path, write=True, measurements_dir=meas)
    assert second.written
    assert "current table" in second.before and "current table" in second.this_run
    files = [r["file"] for r in second.table["provenance"]["runs"]]
    assert files == [str(meas / GPU / "sweep-1.csv"), str(meas / GPU / "sweep-2.csv")]
    models = set(second.table["range"]["models"])
    assert len(models) == len(RUN1) + len(RUN2)
    text = second.text
    for word in ("before and after", "uncalibrated", "current table", NEW_LABEL, "this run's points",
                 "new factors", "safe upper bounds", "written:"):
        assert word in text, word
    # refreshing again with the same run adds nothing twice
    third = refresh([runs[1]], GPU, table_path, write=True, measurements_dir=meas)
    assert third.table["provenance"]["points"] == second.table["provenance"]["points"]
    assert third.copied == []


def test_compare_only_writes_nothing(runs, tmp_path):
    table_path, meas = _layout(tmp_path)
    result = refresh([runs[0]], GPU, table_path, write=False, measurements_dir=meas)
    assert not result.written and not table_path.exists() and not meas.exists()
    assert result.table is not None and "compare only" in result.text


def test_missing_earlier_file_is_never_dropped_silently(runs, tmp_path):
    table_path, meas = _layout(tmp_path)
    refresh([runs[0]], GPU, table_path, write=True, measurements_dir=meas)
    written = table_path.read_text()
    (meas / GPU / "sweep-1.csv").rename(tmp_path / "elsewhere.csv")
    result = refresh([runs[1]], GPU, table_path, write=True, measurements_dir=meas)
    assert not result.written and result.missing and "NOT WRITTEN" in result.text
    assert table_path.read_text() == written
    forced = refresh([runs[1]], GPU, table_path, write=True, measurements_dir=meas, allow_missing=True)
    assert forced.written
    assert any("dropped earlier measurement files" in n for n in forced.table["notes"])


def test_refresh_refuses_a_corrupt_or_foreign_table(runs, tmp_path):
    table_path, meas = _layout(tmp_path)
    table_path.parent.mkdir(parents=True)
    table_path.write_text("{corrupt")
    with pytest.raises(calibration_table.TableError, match="corrupt"):
        refresh([runs[0]], GPU, table_path, write=True, measurements_dir=meas)
    assert table_path.read_text() == "{corrupt"
    other = refresh([runs[0]], "a100-80gb", tmp_path / "a100.json", write=False, measurements_dir=meas)
    assert other.table is None and "nothing measured on this GPU" in other.text
    assert other.before == {}


def test_refresh_warns_about_new_versions(runs, tmp_path):
    table_path, meas = _layout(tmp_path)
    refresh([runs[0]], GPU, table_path, write=True, measurements_dir=meas)
    newer = synthetic.write_csv(synthetic.rows(GPU, seed=4, models=("qwen2.5-1.5b",),
                                               versions={**synthetic.VERSIONS, "torch": "2.14.0"}),
                                tmp_path / "sweep-3" / "results.csv")
    result = refresh([newer.parent], GPU, table_path, write=False, measurements_dir=meas)
    assert any("torch 2.13.0" in w and "2.14.0" in w for w in result.warnings)
    assert any("several versions of torch" in n for n in result.table["notes"])


def test_bench_without_measurements_shows_a_labelled_synthetic_demo(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/bench_calibration.py", "--measurements", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "no GPU measurements are committed" in proc.stdout
    assert "SYNTHETIC DEMONSTRATION (not a measurement)" in proc.stdout
    assert "recovery of the known factors" in proc.stdout


def test_bench_on_committed_style_measurements(runs, tmp_path):
    meas = tmp_path / "measurements"
    (meas / GPU).mkdir(parents=True)
    os.link(runs[0] / "results.csv", meas / GPU / "sweep-1.csv")
    proc = subprocess.run([sys.executable, "scripts/bench_calibration.py", "--measurements", str(meas)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"{GPU}: GPU measurements" in proc.stdout and "calibrated (LOMO CV)" in proc.stdout
    assert "SYNTHETIC" not in proc.stdout


def test_a_grown_results_file_is_not_counted_twice(runs, tmp_path):
    """profile.py resumes a sweep by rewriting results.csv with old and new rows: a refresh after
    the resume sees the earlier copy and the grown file, and counts each record once."""
    table_path, meas = _layout(tmp_path)
    first = refresh([runs[0]], GPU, table_path, write=True, measurements_dir=meas)
    grown = tmp_path / "sweep-1" / "results.csv"
    grown.parent.mkdir()
    old = (runs[0] / "results.csv").read_text()
    extra = (runs[1] / "results.csv").read_text().split("\n", 1)[1]
    grown.write_text(old + extra)
    second = refresh([grown.parent], GPU, table_path, write=True, measurements_dir=meas)
    both = refresh([runs[0], runs[1]], GPU, tmp_path / "other.json", write=False, measurements_dir=tmp_path / "m")
    assert second.table["provenance"]["points"] == both.table["provenance"]["points"]
    assert second.table["provenance"]["points"] > first.table["provenance"]["points"]
    assert any("duplicate of a row" in n for n in second.table["notes"])


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_refresh_reads_the_profiler_run_store(tmp_path, fmt):
    """The run folder profile.py writes (profiler.store.RunStore) is what a refresh reads."""
    store = RunStore(tmp_path / "runs" / "h100-run", fmt=fmt)
    rows = synthetic.rows(GPU, noise=0.01, seed=9, models=("llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b"))
    by_id: dict = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(row)
    for case_id, group in by_id.items():
        store.put(case_id, group)
    table_path, meas = _layout(tmp_path)
    result = refresh([store.path], GPU, table_path, write=True, measurements_dir=meas)
    direct = fit_files([synthetic.write_csv(rows, tmp_path / "direct.csv")], GPU)
    assert result.written
    assert result.table["provenance"]["points"] == len(direct.data.frame)
    assert result.table["factors"]["activation_scale"] == direct.table["factors"]["activation_scale"]
    assert result.copied == [str(meas / GPU / "h100-run.csv")]
