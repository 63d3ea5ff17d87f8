"""Small vocabularies have one owner each, and every user agrees with it.

Atomic writes and the UTC timestamp: estimator.files; library versions: estimator.versions;
quantity names: estimator.quantities; dense peak FLOP/s: estimator.tables.GpuSpec.peak_flops.
"""

import os
import re
from datetime import datetime, timedelta, timezone

import pytest

from estimator import files, quantities, tables, versions
from estimator.configs import load_spec
from estimator.timing import peak_flops
from estimator.workload import Workload


# ---- estimator.files ------------------------------------------------------------------------------

def test_atomic_write_replaces_the_file_and_fsyncs_file_and_folder(tmp_path, monkeypatch):
    path = tmp_path / "out.json"
    path.write_text("old")
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.path.isdir(f"/proc/self/fd/{fd}")) or real(fd))
    files.atomic_write_json(path, {"a": 1})
    assert path.read_text() == '{\n  "a": 1\n}\n'
    assert list(tmp_path.iterdir()) == [path]
    assert synced[0] is False and True in synced  # the file first, then its folder


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("previous complete file")

    def half(tmp):
        tmp.write_text("half of a")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        files.atomic_write(path, half)
    assert path.read_text() == "previous complete file"
    assert list(tmp_path.iterdir()) == [path]
    files.atomic_write_bytes(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"


def test_utc_timestamps():
    now = datetime.fromisoformat(files.utc_now())
    assert now.utcoffset() == timedelta(0)
    assert abs(datetime.now(timezone.utc) - now) < timedelta(seconds=5)
    assert re.fullmatch(r"\d{8}T\d{6}Z", files.utc_stamp())


# ---- estimator.versions ---------------------------------------------------------------------------

def test_the_record_and_the_table_carry_the_same_version_columns():
    from fitting import calibration_table
    from profiler.record import COLUMN_NAMES, _ENV

    env_columns = [name for name, _ in _ENV]
    assert [c for c in env_columns if c in versions.VERSION_COLUMNS] == list(versions.VERSION_COLUMNS)
    assert set(versions.VERSION_COLUMNS) <= set(COLUMN_NAMES)
    assert calibration_table.VERSION_COLUMNS is versions.VERSION_COLUMNS
    assert set(versions.LIBRARIES) <= set(versions.RUN_PACKAGES)


def test_a_missing_library_has_no_version():
    assert versions.package_version("no-such-package-xyz") is None
    got = versions.library_versions(("transformers", "no-such-package-xyz"))
    assert got["transformers"] and got["no-such-package-xyz"] is None
    assert "no-such-package-xyz" not in versions.installed_versions()
    assert versions.installed_versions()["transformers"] == got["transformers"]


# ---- estimator.quantities -------------------------------------------------------------------------

def test_every_quantity_is_a_record_column_with_its_unit():
    from profiler.compare import QUANTITIES as COMPARED
    from profiler.record import COLUMN_TYPES, MEASURED_BYTES

    for name in quantities.QUANTITIES:
        assert COLUMN_TYPES[name] is (int if quantities.unit(name) == "bytes" else float)
    assert set(quantities.MEMORY_QUANTITIES) < set(MEASURED_BYTES)
    for q in COMPARED:
        assert q.name in quantities.QUANTITIES and q.unit == quantities.unit(q.name)
    with pytest.raises(ValueError):
        quantities.unit("mfu")


def test_fitting_fits_the_owners_quantities():
    from fitting import cv, data, render

    assert data.QUANTITIES is cv.QUANTITIES is render.QUANTITIES is quantities.FITTED_QUANTITIES


# ---- peak FLOP/s ----------------------------------------------------------------------------------

def test_peak_flops_has_one_conversion():
    from profiler import measure

    a100 = tables.gpu("a100-80gb")
    assert a100.peak_flops("bf16") == 312e12 == a100.dense_tflops("bf16") * 1e12
    w = Workload(load_spec("llama-3.2-1b"), precision="fp32")
    assert peak_flops(a100, w) == a100.peak_flops("fp32") == measure.peak_flops_per_s(w, "a100-80gb")
    assert measure.peak_flops_per_s(w, None) is None


def test_every_quantity_has_a_plot_marker():
    from profiler import plot

    assert set(plot._MARKERS) == set(quantities.QUANTITIES)
    assert len(set(plot._MARKERS.values())) == len(quantities.QUANTITIES)
