"""The safe upper bound every memory answer carries and the three-way verdict (estimator/bounds.py,
issue 12 item 5): hand-computed bounds from the point estimate and the stated factors, a table's
held-out factors, widening outside its data, the verdicts, the JSON keys, planners on the bound."""

from __future__ import annotations

import json
import math

import pytest

from tests.scripts_loader import call_main, load_script

from estimator import tables
from estimator.api import estimate
from estimator.bounds import verdict
from estimator.calibration import SCHEMA
from estimator.configs import load_spec
from estimator.planner import advice, max_batch, merged_flags
from estimator.workload import Workload

GPU = "a100-80gb"
CLI = load_script("estimate")


@pytest.fixture(scope="module")
def lora():
    return Workload(load_spec("llama-3.1-8b"), method="lora", batch=2, seq=2048).validate()


def _table(tmp_path, factors=(1.10, 1.20, 1.25), coverages=(0.97, 0.95, 0.96), rng=None):
    quantities = ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes")
    table = {"schema": SCHEMA, "gpu": GPU, "factors": {},
             "upper_bound": {q: {"factor": f, "coverage": c, "quantile": 0.95}
                             for q, f, c in zip(quantities, factors, coverages)}}
    if rng:
        table["range"] = rng
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    return str(path)


def test_uncalibrated_bound_is_the_point_plus_half_the_uncertain_part(lora):
    e = estimate(lora, GPU, "none")
    m = e.memory
    floor = 64 * 2**20                                              # overheads.csv bound_uncertain_floor_bytes
    exact = (m.weights_bytes + m.optimizer_states_bytes + m.master_weights_bytes + m.zero_buffers_bytes
             + m.kv_cache_bytes + m.blas_workspace_bytes)           # forward/backward peak: gradients not exact
    assert m.peak_phase == "forward/backward"
    for q in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert e.safe[q] == math.ceil(getattr(m, q) + 0.5 * (getattr(m, q) - exact + floor))
    assert e.safe["device_used_bytes"] == math.ceil(m.device_used_bytes + 0.5 * (
        m.device_used_bytes - exact - m.paged_optimizer_bytes + floor))
    assert e.safe["coverage"] == 0.95
    assert "uncalibrated default" in e.safe["source"] and "uncertain part" in e.safe["source"]


def test_a_hand_computed_bound_of_one_breakdown():
    from estimator.bounds import uncertain_bytes, bound_value
    from estimator.memory import MemoryBreakdown
    GiB = 2**30
    m = MemoryBreakdown(weights_bytes=10 * GiB, gradients_bytes=1 * GiB, optimizer_states_bytes=2 * GiB,
                        master_weights_bytes=0, activations_bytes=4 * GiB, logits_and_loss_bytes=1 * GiB,
                        kv_cache_bytes=0, optimizer_temporaries_bytes=0, autocast_weight_cache_bytes=0,
                        quant_workspace_bytes=0, zero_buffers_bytes=0, paged_optimizer_bytes=0,
                        cuda_context_bytes=GiB // 2, nccl_buffers_bytes=0, allocator_reserve_bytes=GiB,
                        peak_allocated_bytes=17 * GiB, peak_reserved_bytes=18 * GiB,
                        device_used_bytes=18 * GiB + GiB // 2, host_bytes=0, peak_phase="forward/backward")
    u = uncertain_bytes(m, floor_bytes=0)
    # exact: weights 10 + optimizer 2 = 12 GiB; the rest of each peak is uncertain
    assert u == {"peak_allocated_bytes": 5 * GiB, "peak_reserved_bytes": 6 * GiB, "device_used_bytes": 6 * GiB + GiB // 2}
    assert bound_value(m.peak_reserved_bytes, u["peak_reserved_bytes"], 0.5) == 21 * GiB
    # in the optimizer step every gradient exists, of known size: exact too
    step = MemoryBreakdown(**{**m.to_dict(), "peak_phase": "optimizer step"})
    assert uncertain_bytes(step, floor_bytes=0)["peak_allocated_bytes"] == 4 * GiB


def test_a_weight_dominated_inference_gets_a_bound_much_closer_to_its_point(lora):
    serve = Workload(load_spec("llama-3.1-8b"), method="inference", batch=1, seq=256).validate()
    tight, wide = estimate(serve, GPU, "none"), estimate(lora, GPU, "none")
    margin = lambda e: e.safe["device_used_bytes"] / e.memory.device_used_bytes - 1   # noqa: E731
    assert margin(tight) < 0.06 and margin(wide) > 3 * margin(tight)


def test_the_scale_of_the_uncertain_part_is_recovered_from_a_synthetic_set():
    import numpy as np
    from fitting.cv import covering_scale
    rng = np.random.default_rng(0)
    n = 4000
    exact = rng.uniform(5, 70, n) * 2**30                 # weights: counted exactly
    unc = rng.uniform(0.05, 30, n) * 2**30                # the uncertain part, known
    point = exact + unc
    e = rng.uniform(-0.2, 0.6, n)                         # measured = point + e x uncertain part
    measured = point + e * unc
    k = covering_scale((measured - point) / unc, 0.0)
    assert k == pytest.approx(-0.2 + 0.8 * 0.95, abs=0.02)   # the 95th percentile of e
    bound = point + k * unc
    assert np.mean(bound >= measured) == pytest.approx(0.95, abs=0.01)
    # one factor on the total covering the same share over-provisions far more
    f = covering_scale(measured / point, 1.0)
    assert np.median(point * f / measured - 1) > 2 * np.median(bound / measured - 1)


def test_a_table_bound_uses_each_quantity_factor_and_the_smallest_coverage(lora, tmp_path):
    e = estimate(lora, GPU, _table(tmp_path))
    assert e.safe["peak_allocated_bytes"] == math.ceil(e.memory.peak_allocated_bytes * 1.10)
    assert e.safe["peak_reserved_bytes"] == math.ceil(e.memory.peak_reserved_bytes * 1.20)
    assert e.safe["device_used_bytes"] == math.ceil(e.memory.device_used_bytes * 1.25)
    assert e.safe["coverage"] == 0.95
    assert "held-out" in e.safe["source"]


def test_a_workload_far_outside_the_data_widens_the_bound(lora, tmp_path):
    # the table saw 1-2B models at 128-1024 tokens: an 8B model at 4096 tokens is far outside
    path = _table(tmp_path, rng={"params_total": [1e9, 2e9], "tokens": [128, 1024]})
    e = estimate(lora, GPU, path)
    assert any("far outside" in w for w in e.warnings)
    assert e.safe["device_used_bytes"] == math.ceil(e.memory.device_used_bytes * 1.25 * 1.15)
    assert "widened" in e.safe["source"]


@pytest.mark.parametrize("point, bound, capacity, expected", [
    (50, 60, 80, "fits"), (50, 80, 80, "fits"), (70, 91, 80, "tight"), (80, 104, 80, "tight"),
    (81, 105, 80, "does not fit"),
])
def test_verdicts(point, bound, capacity, expected):
    assert verdict(point, bound, capacity) == expected


def test_json_carries_memory_safe_and_the_verdict(capsys):
    code, out, err = call_main(CLI, capsys, "--model", "llama-3.1-8b", "--method", "qlora", "--batch", "1",
                               "--seq", "4096", "--grad-ckpt", "--gpu", "a10g-24gb", "--calibration", "none",
                               "--json")
    assert code == 0, err
    data = json.loads(out)
    assert set(data["memory"]["safe"]) == {"peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes",
                                           "coverage", "source"}
    used, capacity = data["memory"]["device_used_bytes"], data["gpu"]["memory_bytes"]
    assert used <= capacity < data["memory"]["safe"]["device_used_bytes"]   # the point fits, the bound does not
    assert data["verdict"] == "tight"


def test_tight_text_says_by_how_much_and_what_would_fit(capsys):
    code, out, err = call_main(CLI, capsys, "--model", "llama-3.1-8b", "--method", "qlora", "--batch", "4",
                               "--seq", "4096", "--grad-ckpt", "--gpu", "a10g-24gb", "--calibration", "none")
    assert code == 0, err
    # batch 4 does not fit; batch 1 with accumulation fits the point estimate only: offered as tight
    assert "DOES NOT FIT" in out
    assert "--batch 1 --grad-accum 4 (tight: the estimate fits, its safe bound does not" in out


def test_advice_names_the_first_levers_in_order_with_their_time_cost():
    w = Workload(load_spec("llama-3.1-8b"), method="full", batch=4, seq=4096).validate()
    base = estimate(w, "a100-80gb", "none")
    assert not base.safe_fits
    tips = advice(base, "none")
    # no single lever fits the bound: the first run of levers, stacked in order, that does
    first = tips[0]
    assert first.startswith("--batch 1 --grad-accum 4 --grad-ckpt --optimizer adamw-8bit ("), tips
    trial = estimate(w.with_(batch=1, grad_accum=4, grad_ckpt=True, optimizer="adamw-8bit"), "a100-80gb", "none")
    assert trial.safe_fits
    change = (trial.time.step_s / 4) / (base.time.step_s / 4) - 1      # same samples per step
    assert f"time per sample {change:+.0%}" in first
    assert "--grad-ckpt (tight: the estimate fits, its safe bound does not" in tips[-1]   # said as tight


def test_stacked_levers_that_set_one_flag_twice_keep_the_later_value():
    w = Workload(load_spec("llama-3.1-70b"), method="full", precision="fp16").validate()
    tips = advice(estimate(w, "t4-16gb", "none"), "none")
    # full -> lora -> qlora stack: one --method, the last; ZeRO-3 over 8 GPUs named once
    assert tips[0].startswith("--grad-ckpt --optimizer adamw-8bit --method qlora --zero 3 --gpus 8 ("), tips
    assert estimate(w.with_(grad_ckpt=True, optimizer="adamw-8bit", method="qlora", quant="nf4", zero=3, gpus=8),
                    "t4-16gb", "none").safe_fits
    assert merged_flags(["--zero 3 --gpus 8", "--grad-ckpt", "--zero 3 --offload optimizer+params"]) == (
        "--zero 3 --gpus 8 --grad-ckpt --offload optimizer+params")


def test_advice_for_the_readme_example_names_batch_one_with_accumulation(capsys):
    code, out, err = call_main(CLI, capsys, "--model", "llama-3.1-8b", "--method", "qlora", "--batch", "4",
                               "--seq", "4096", "--grad-ckpt", "--gpu", "a10g-24gb", "--calibration", "none")
    assert code == 0, err
    assert "--batch 1 --grad-accum 4" in out.splitlines()[-1]


def test_planners_plan_on_the_bound(lora):
    b = max_batch(lora, GPU, "none")
    capacity = tables.gpu(GPU).memory_bytes
    assert estimate(lora.with_(batch=b), GPU, "none").safe["device_used_bytes"] <= capacity
    beyond = estimate(lora.with_(batch=b + 1), GPU, "none")
    assert beyond.safe["device_used_bytes"] > capacity and beyond.memory.device_used_bytes <= capacity
