"""profiler/compare.py and plot.py on hand-made rows: signed errors, "not measured" for what a
backend cannot measure (never 0, never a 100 % error), ranks merged, summary statistics on
hand-made numbers, the estimator wiring, and the files written (PNG checked by its magic bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from estimator.api import estimate
from profiler.case import Case
from profiler.compare import (Point, compare_rows, estimate_predictor, percentile, summarize,
                              write_comparison)
from profiler.plot import parity_plot
from profiler.record import empty_row, new_row

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "data" / "tiny-llama.json")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(case_id="a", backend="cuda", status="ok", method="full", **values) -> dict:
    r = empty_row()
    r.update(id=case_id, backend=backend, status=status, method=method, rank=0, gpu_slug="a100-80gb")
    r.update(values)
    return r


def fixed(**predicted):
    """A predictor returning the same numbers for every row."""
    def predict(_row):
        return "a100-80gb", predicted
    return predict


def by_quantity(points, case_id="a"):
    return {p.quantity: p for p in points if p.id == case_id}


def test_signed_errors_are_predicted_minus_measured_over_measured():
    rows = [row(peak_allocated_bytes=1000, peak_reserved_bytes=2000, device_used_bytes=4000, step_s=0.5)]
    got = by_quantity(compare_rows(rows, fixed(peak_allocated_bytes=1100, peak_reserved_bytes=1500,
                                               device_used_bytes=4000, step_s=1.0)))
    assert got["peak_allocated_bytes"].error == pytest.approx(0.10)   # 100 over 1000
    assert got["peak_reserved_bytes"].error == pytest.approx(-0.25)   # 500 under 2000
    assert got["device_used_bytes"].error == pytest.approx(0.0)
    assert got["step_s"].error == pytest.approx(1.0)
    assert "prefill_s" not in got  # inference-only quantities are not listed for training


def test_missing_measurements_are_not_measured_never_zero_or_minus_100_percent():
    rows = [row("cpu-row", backend="cpu", step_s=3.0, peak_allocated_bytes=None),
            row("cuda-row", peak_allocated_bytes=1000, device_used_bytes=None, step_s=float("nan")),
            row("trace-row", backend="trace", peak_allocated_bytes=800, peak_reserved_bytes=1600)]
    points = compare_rows(rows, fixed(peak_allocated_bytes=900, peak_reserved_bytes=1800,
                                      device_used_bytes=2000, step_s=1.0))
    cpu = by_quantity(points, "cpu-row")
    assert all(p.measured is None and p.error is None and "not measured" in p.note for p in cpu.values())
    cuda = by_quantity(points, "cuda-row")
    assert cuda["peak_allocated_bytes"].error == pytest.approx(-0.1)
    for name in ("device_used_bytes", "step_s", "peak_reserved_bytes"):
        assert cuda[name].measured is None and cuda[name].error is None
    trace = by_quantity(points, "trace-row")
    assert trace["peak_allocated_bytes"].error == pytest.approx(0.125)
    assert trace["peak_reserved_bytes"].measured is None  # a trace has no allocator segments
    summary = summarize(points)
    assert summary["peak_allocated_bytes"]["n"] == 2
    assert summary["device_used_bytes"]["n"] == 0 and summary["device_used_bytes"]["median_abs_error"] is None
    assert summary["step_s"]["not_measured"] == 3


def test_only_ok_rows_count_and_ranks_merge_to_their_largest_value():
    rows = [row("z", rank=0, peak_allocated_bytes=1000, step_s=1.0),
            row("z", rank=1, peak_allocated_bytes=1200, step_s=0.8),
            row("o", status="oom", peak_allocated_bytes=None),
            row("e", status="error")]
    points = compare_rows(rows, fixed(peak_allocated_bytes=1200, step_s=1.0))
    assert {p.id for p in points} == {"z"}
    got = by_quantity(points, "z")
    assert got["peak_allocated_bytes"].measured == 1200 and got["peak_allocated_bytes"].error == 0.0
    assert got["step_s"].measured == 1.0


def test_a_configuration_with_an_oom_rank_is_not_compared():
    rows = [row("z", rank=0, peak_allocated_bytes=1000, step_s=1.0),
            row("z", rank=1, status="oom", message="CUDA out of memory")]
    assert compare_rows(rows, fixed(peak_allocated_bytes=1000, step_s=1.0)) == []


def test_summary_statistics_on_hand_made_errors():
    errors = [0.1, -0.2, 0.3, -0.4, 0.5]
    points = [Point(str(i), "cuda", "x", "step_s", "s", 1.0 + e, 1.0, e) for i, e in enumerate(errors)]
    points.append(Point("n", "cpu", "x", "step_s", "s", None, None, None, "not measured on cpu"))
    s = summarize(points)["step_s"]
    assert s["n"] == 5 and s["not_measured"] == 1
    assert s["median_abs_error"] == pytest.approx(0.3)
    # |errors| sorted 0.1 0.2 0.3 0.4 0.5; p90 at position 0.9 * 4 = 3.6: 0.4 + 0.6 * 0.1
    assert s["p90_abs_error"] == pytest.approx(0.46)
    assert s["under_estimate_rate"] == pytest.approx(2 / 5)
    assert s["mean_error"] == pytest.approx(0.3 / 5)


def test_percentile_matches_numpy():
    import numpy as np

    values = [0.03, 0.5, 0.12, 0.07, 0.9, 0.33, 0.2]
    for pct in (0, 10, 50, 90, 100):
        assert percentile(values, pct) == pytest.approx(float(np.percentile(values, pct)))


def test_a_failing_prediction_is_reported_not_hidden():
    from estimator.errors import InputError

    def refuse(_row):
        raise InputError("the row names no GPU (pass --gpu)")

    points = compare_rows([row(peak_allocated_bytes=1000)], refuse)
    p = by_quantity(points)["peak_allocated_bytes"]
    assert p.error is None and p.note.startswith("not predicted") and "pass --gpu" in p.note
    assert summarize(points)["peak_allocated_bytes"]["not_predicted"] == 1


def test_the_estimator_predictor_rebuilds_the_workload_from_the_row():
    case = Case(TINY, {"method": "lora", "precision": "bf16", "batch": 4, "seq": 128, "grad_ckpt": True})
    r = new_row(case, "cuda", status="ok", gpu_slug="a100-80gb", peak_allocated_bytes=10**8, step_s=0.01)
    slug, predicted = estimate_predictor(calibration="none")(r)
    expected = estimate(case.workload(), "a100-80gb", calibration="none")
    assert slug == "a100-80gb"
    assert predicted["peak_allocated_bytes"] == expected.memory.peak_allocated_bytes
    assert predicted["device_used_bytes"] == expected.memory.device_used_bytes
    # the profiler's loop runs no host work between steps, and this row timed no clipping: the
    # estimate's step less its fixed overhead and its clipping
    t = expected.time
    assert t.overhead_s > 0 and t.clip_s > 0
    assert predicted["step_s"] == pytest.approx(t.step_s - t.overhead_s - t.clip_s)
    clipped = new_row(case, "cuda", status="ok", gpu_slug="a100-80gb", step_s=0.01, clip_s=0.001)
    assert estimate_predictor(calibration="none")(clipped)[1]["step_s"] == pytest.approx(t.step_s - t.overhead_s)
    assert estimate_predictor(calibration="none")(clipped)[1]["clip_s"] == t.clip_s
    slug, _ = estimate_predictor(gpu="h100-80gb", calibration="none")(r)  # --gpu wins over the row
    assert slug == "h100-80gb"


def test_a_trace_row_is_set_against_the_raw_formulas_without_cublas():
    """A fake-tensor trace counts exact tensor bytes on the CPU: under `auto` it is compared with the
    uncalibrated estimate (the published table corrects real-GPU effects), less the cuBLAS
    workspaces a CPU trace never takes."""
    case = Case(TINY, {"method": "lora", "precision": "bf16", "batch": 4, "seq": 128})
    r = new_row(case, "trace", status="ok", gpu_slug="", peak_allocated_bytes=10**8)
    _, predicted = estimate_predictor(calibration="auto")(r)
    raw = estimate(case.workload(), "h100-80gb", calibration="none").memory
    assert raw.blas_workspace_bytes > 0
    assert predicted["peak_allocated_bytes"] == raw.peak_allocated_bytes - raw.blas_workspace_bytes


def test_write_comparison_files(tmp_path):
    rows = [row("m", peak_allocated_bytes=2**30, peak_reserved_bytes=2**31, device_used_bytes=3 * 2**30, step_s=0.2),
            row("c", backend="cpu", step_s=5.0)]
    result = write_comparison(rows, tmp_path, calibration="none",
                              predict=fixed(peak_allocated_bytes=2**30, peak_reserved_bytes=2**31,
                                            device_used_bytes=2**31, step_s=0.3))
    for name in ("compare.csv", "compare.json", "compare.txt", "parity.png"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "parity.png").read_bytes()[:8] == PNG_MAGIC
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["quantities"]["device_used_bytes"]["median_abs_error"] == pytest.approx(1 / 3)
    assert data["quantities"]["step_s"]["under_estimate_rate"] == 0.0
    text = (tmp_path / "compare.txt").read_text()
    c_lines = [line for line in text.splitlines() if line.startswith("c ")]
    assert len(c_lines) == 1 and "not measured" in c_lines[0] and "%" not in c_lines[0]
    assert result["text"] == text


def test_parity_plot_without_points_is_still_a_png(tmp_path):
    path = parity_plot([], tmp_path / "empty.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_an_accumulating_ddp_run_compares_its_reducing_micro_batch():
    # the profiler times the no_sync micro-batches and the reducing one apart: the estimate's
    # micro-batch, and the same plus what its gradient all-reduce leaves exposed (estimator.timing)
    from estimator.tables import gpu
    from estimator.timing import communication

    case = Case("llama-3.2-1b", {"gpus": 2, "batch": 1, "seq": 256, "grad_accum": 4})
    r = new_row(case, "cuda", status="ok", gpu_slug="l40s-48gb", step_s=1.0, nosync_microbatch_s=0.05,
                sync_microbatch_s=0.2)
    _, predicted = estimate_predictor(calibration="none")(r)
    w = case.workload()
    t = estimate(w, "l40s-48gb", calibration="none").time
    assert predicted["nosync_microbatch_s"] == pytest.approx(t.compute_s / 4)
    exposed = communication(w, gpu("l40s-48gb"), "ib-hdr").last_reduction_exposed_s(t.compute_s / 4 * 2 / 3)
    # 2.5 GB of bf16 gradients over PCIe 4.0 (77 ms) against a backward of about 40 ms: half exposed
    assert 0.02 < exposed < t.comm_s
    assert predicted["sync_microbatch_s"] == pytest.approx(t.compute_s / 4 + exposed)
    points = by_quantity(compare_rows([r], estimate_predictor(calibration="none")), r["id"])
    assert points["sync_microbatch_s"].measured == 0.2 and points["sync_microbatch_s"].error is not None
    # one process, or no accumulation: nothing is timed apart, nothing predicted
    single = Case("llama-3.2-1b", {"batch": 1, "seq": 256, "grad_accum": 4})
    _, predicted = estimate_predictor(calibration="none")(new_row(single, "cuda", status="ok", gpu_slug="l40s-48gb"))
    assert predicted["nosync_microbatch_s"] is None and predicted["sync_microbatch_s"] is None
