"""The estimator against the first real GPU measurements (an H100 80GB HBM3, 2026-11-27,
calibrations/measurements/h100-80gb/: scripts/gpu_session.sh with profiler/sweeps/first-contact.yaml,
16 configurations of 4 models: full, LoRA, QLoRA with and without kbit preparation, inference).

The expectations are the measurements, never the estimator's own output: the raw formulas (no
calibration) must land within 1.5% of every measured peak allocated (the exactly counted tensors),
and the uncalibrated safe bound (estimator/data/overheads.csv, set before these measurements
existed) must cover every measured device-used figure, so a user who plans on it does not OOM."""

import csv
import json
from pathlib import Path

import pytest

from estimator.api import estimate
from fitting.data import workload_from_row

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "calibrations" / "measurements" / "h100-80gb"
FILE = FOLDER / "h100-first-contact-2026-11-27.csv"
ROWS = [r for r in csv.DictReader(FILE.open()) if r["status"] == "ok"]
SECOND = FOLDER / "h100-second-contact-2026-11-27.csv"
SECOND_ROWS = [r for r in csv.DictReader(SECOND.open()) if r["status"] == "ok"]


def test_the_run_is_what_the_docstring_says():
    assert len(ROWS) == 16 and {r["gpu_name"] for r in ROWS} == {"NVIDIA H100 80GB HBM3"}
    assert {r["method"] for r in ROWS} == {"full", "lora", "qlora", "inference"}
    assert len({r["model"] for r in ROWS}) == 4


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_raw_peak_allocated_within_1_5_percent(row):
    est = estimate(workload_from_row(row), "h100-80gb", calibration="none")
    measured = int(row["peak_allocated_bytes"])
    assert abs(est.memory.peak_allocated_bytes - measured) <= 0.015 * measured, (est.memory.peak_allocated_bytes, measured)


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_uncalibrated_safe_bound_covers_device_used(row):
    est = estimate(workload_from_row(row), "h100-80gb", calibration="none")
    assert est.safe["device_used_bytes"] >= int(row["device_used_bytes"])


def test_bench_time_scores_the_run_per_quantity():
    from tests.scripts_loader import load_script

    found = load_script("bench_time").measured(["h100-80gb"])["h100-80gb"]
    rows = ROWS + [r for r in SECOND_ROWS if r["activation_offload"] != "True"]   # superseded: not scored
    training = sum(r["method"] != "inference" for r in rows)
    assert found["training step"]["n"] == training == 10 + 12
    assert found["prefill"]["n"] == found["decode, per token"]["n"] == len(rows) - training
    for label, m in found.items():
        assert 0 <= m["median_abs"] <= m["p90_abs"], label


OFFLOADED = [r for r in SECOND_ROWS if r["activation_offload"] == "True"]


def test_the_second_run_offloaded_activations_three_times():
    assert [(r["model"], r["method"], r["grad_ckpt"]) for r in OFFLOADED] == [
        ("llama-3.2-1b", "full", "False"), ("qwen3-1.7b", "full", "False"), ("llama-3.1-8b", "lora", "True")]


@pytest.mark.parametrize("row", OFFLOADED, ids=[r["id"] for r in OFFLOADED])
def test_offloading_traced_with_the_allocator_model_lands_within_1_5_percent(row):
    """These rows ran TRL 0.25.0-1.7.x's deduplication (calibrations/measurements/superseded.csv),
    which kept on the device a saved tensor at the address of one it offloaded and freed in this
    forward: the traces that leave the allocator out were 1.5-7.7% under these measurements; traced
    in that regime (profiler.trace.measured.regime_of) with profiler/trace/allocator.py placing the
    fake tensors they land within 1.5%."""
    from profiler.case import Case
    from profiler.trace import trace
    from profiler.trace.measured import regime_of

    w = workload_from_row(row)
    settings = {"method": w.method, "batch": w.batch, "seq": w.seq, "grad_ckpt": w.grad_ckpt,
                "activation_offload": True}
    with regime_of(SECOND, row["id"]):
        traced = trace(Case(row["model"], settings, 1, 1)).peak_allocated_bytes
    measured = int(row["peak_allocated_bytes"])
    assert abs(traced - measured) <= 0.015 * measured, (traced, measured)


@pytest.mark.parametrize("row", OFFLOADED, ids=[r["id"] for r in OFFLOADED])
def test_offloading_rows_of_the_old_trl_sit_inside_the_notes_range_and_the_bound(row):
    """The estimate follows TRL >= 1.8.0, these rows ran 0.25.0-1.7.x: each lies between the point
    and the point plus the note's highest share of the offloaded bytes (what that TRL also kept,
    estimator.memory.legacy_offload_share, whose range these rows and the traces set: the check
    that the range the note states still holds them), and the uncalibrated safe bound covers it."""
    from estimator.memory import legacy_offload_share

    est = estimate(workload_from_row(row), "h100-80gb", calibration="none")
    measured = int(row["peak_allocated_bytes"])
    high = legacy_offload_share()[1]
    assert est.memory.peak_allocated_bytes <= measured
    assert measured <= est.memory.peak_allocated_bytes + high * est.memory.offloaded_activations_bytes
    assert est.safe["peak_allocated_bytes"] >= measured
    assert est.safe["device_used_bytes"] >= int(row["device_used_bytes"])


def test_the_old_trl_rows_are_listed_superseded_and_not_fitted():
    from fitting.data import superseded_regime

    assert all(superseded_regime(SECOND, r["id"]) == "trl-legacy-dedupe" for r in OFFLOADED)
    listed = ([superseded_regime(FILE, r["id"]) for r in ROWS]
              + [superseded_regime(SECOND, r["id"]) for r in SECOND_ROWS])
    assert sum(regime is not None for regime in listed) == 3
    table = json.loads((ROOT / "calibrations" / "h100-80gb.json").read_text())
    assert table["provenance"]["points"] == len(ROWS) + len(SECOND_ROWS) - 3


# the rows whose reserved memory the raw formulas miss most: fragmentation under checkpointing
# (Qwen3-1.7B 2.34 GB, Qwen2.5-0.5B AMP 2.08 GB above allocated) and a 7.5 GB gap at 16k tokens
FRAGMENTED = [r for r in ROWS + SECOND_ROWS if r["id"] in (
    "Qwen/Qwen3-1.7B#4e536d35|batch=2|seq=1024|grad_ckpt=True",
    "Qwen/Qwen2.5-0.5B-Instruct#f21f466c|precision=amp-bf16|batch=2|seq=1024|grad_ckpt=True",
    "meta-llama/Llama-3.2-1B#f7d1d413|batch=8|seq=2048")]


def test_the_fragmented_rows_are_there():
    assert len(FRAGMENTED) == 3
    for row in FRAGMENTED:
        assert int(row["peak_reserved_bytes"]) - int(row["peak_allocated_bytes"]) > 2 * 10**9


@pytest.mark.parametrize("row", FRAGMENTED, ids=[r["id"] for r in FRAGMENTED])
def test_the_allocator_model_predicts_reserved_within_1_percent(row):
    """A whole-model trace of two steps (the first makes the optimizer states where the allocator
    finds room, as a real first step does) placed by profiler/trace/allocator.py: peak reserved
    within 1% of the H100's, where the raw formulas are 4.5-11% off."""
    from profiler.trace.measured import case_of
    from profiler.trace import trace

    case, _ = case_of(row)
    result = trace(case, reserved=True)
    measured = int(row["peak_reserved_bytes"])
    assert abs(result.peak_reserved_bytes - measured) <= 0.01 * measured, (result.peak_reserved_bytes, measured)
    assert result.layers_traced == (result.num_layers,)
