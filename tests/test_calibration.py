"""The estimator applies a calibration table exactly as stated, reads only valid tables, and warns.

A table's effect is checked against an independent computation from the uncalibrated breakdown:
the estimate with a table differs from the estimate without it by exactly the stored factors.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from estimator import calibration as calmod
from estimator.api import estimate
from estimator.calibration import SCHEMA, Calibration, resolve, size_bucket
from estimator.configs import load_spec
from estimator.errors import InputError
from estimator.workload import Workload

MiB, GiB = 2**20, 2**30
GPU = "h100-80gb"
# torch 2.13's default cuBLAS workspace on Hopper (CUBLAS_WORKSPACE_CONFIG ':4096:8'), one per thread
# that runs GEMMs: the forward's and, in training, the autograd engine's
WORKSPACE = 4096 * 1024 * 8
FACTORS = {
    "cuda_context_bytes": 700 * MiB,
    "non_pytorch_bytes": 150 * MiB,
    "nccl_buffers_bytes": 500 * MiB,
    "allocated_constant_bytes": 64 * MiB,
    "reserve": {"full": {"fraction": 0.05, "bytes": 300 * MiB}, "*": {"fraction": 0.2, "bytes": 100 * MiB}},
    "activation_scale": {"llama|sdpa": 1.25, "llama": 1.1, "*": 0.9},
    "inference_activation_scale": {"*": 1.5},
    "logits_scale": 1.1,
    "optimizer_temporaries_scale": 2.0,
    "mfu": {"full|1-10B": 0.5, "lora": 0.3, "inference-prefill": 0.6},
    "decode_bandwidth_fraction": 0.8,
}
UPPER = {"device_used_bytes": {"factor": 1.07, "quantile": 0.95, "coverage": 0.93, "points": 40, "models": 5}}


def table(**extra) -> dict:
    data = {"schema": SCHEMA, "gpu": GPU, "created": "2026-11-22T00:00:00Z", "factors": FACTORS,
            "versions": {"torch": ["2.13.0"], "driver": ["570.86.15"]},
            "range": {"params_total": [1_000_000_000, 9_000_000_000], "tokens": [512, 16384],
                      "methods": {"full": 10, "lora": 10, "qlora": 5, "inference": 5},
                      "model_types": {"llama": 20, "qwen2": 10}, "world_sizes": [1, 2]},
            "upper_bound": UPPER}
    data.update(extra)
    return data


@pytest.fixture()
def table_file(tmp_path):
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(table()))
    return path


@pytest.fixture(scope="module")
def llama():
    return load_spec("llama-3.1-8b")


def _workloads(llama):
    qwen = load_spec("qwen2.5-0.5b")
    return {
        "full fwd/bwd": Workload(llama, method="full", batch=2, seq=2048),
        "full foreach optimizer step": Workload(qwen, method="full", adamw_impl="foreach", batch=1, seq=64),
        "lora accum": Workload(llama, method="lora", batch=2, seq=1024, grad_accum=4),
        "qlora amp ckpt": Workload(llama, method="qlora", quant="nf4", precision="amp-bf16", batch=4,
                                   seq=2048, grad_ckpt=True),
        "eager other family": Workload(qwen, method="full", attn="eager", batch=4, seq=1024),
        "zero2 two gpus": Workload(llama, method="full", zero=2, gpus=2, batch=1, seq=1024),
        "paged 8bit": Workload(qwen, method="full", optimizer="paged-adamw-8bit", batch=1, seq=512),
        "inference decode": Workload(llama, method="inference", batch=8, seq=1024, new_tokens=128),
        # a dequantized weight (117 MB) outweighs the scaled prefill of 16 tokens: the scale moves nothing
        "int8 inference short prompt": Workload(llama, method="inference", quant="int8", batch=1, seq=16),
    }


def _expected(plain, w):
    """The calibrated peaks computed here from the uncalibrated estimate's unrounded components
    (`Estimate.components`) and FACTORS: each scale multiplies its component, the peak is the
    persistent states plus the larger working set, then the constant, the reserve and the rest."""
    c = plain.components
    family = w.model.model_type
    if w.training:
        scales = FACTORS["activation_scale"]
        s = scales.get(f"{family}|{w.attn}", scales.get(family, scales["*"]))
    else:
        s = FACTORS["inference_activation_scale"]["*"]
    acts = c.activations * s
    if w.training:
        logits = c.logits_and_loss * FACTORS["logits_scale"]
        temps = c.optimizer_temporaries * FACTORS["optimizer_temporaries_scale"]
        accumulated = c.gradients if w.grad_accum > 1 else 0
        persistent = c.weights + c.optimizer_states + c.master_weights + c.zero_buffers + 2 * WORKSPACE
        working = max(acts + logits + c.autocast_weight_cache + c.quant_workspace + accumulated,
                      c.gradients + temps)
    else:
        logits, temps = c.logits_and_loss, c.optimizer_temporaries
        # a decode step's transient on one layer: DynamicCache concatenates keys, then values (the
        # old and new copy of one of them); eager attention repeats both to the query heads
        layer = c.kv_cache / w.model.num_layers
        spec = w.model
        growth = layer * spec.num_heads / spec.num_kv_heads if w.attn == "eager" else layer / 2
        # Llama: every layer caches every token, so the generated tokens' share of the final cache
        generated = c.kv_cache * w.new_tokens / (w.seq + w.new_tokens)
        persistent = c.weights + c.kv_cache - generated + WORKSPACE
        working = max(acts, generated + growth + c.quant_workspace)
    allocated = int(persistent + working) + FACTORS["allocated_constant_bytes"]
    res = FACTORS["reserve"].get(w.method, FACTORS["reserve"]["*"])
    reserved = math.ceil((allocated * (1 + res["fraction"]) + res["bytes"]) / (2 * MiB)) * 2 * MiB
    nccl = FACTORS["nccl_buffers_bytes"] if w.world_size > 1 else 0
    used = (reserved + FACTORS["cuda_context_bytes"] + nccl + plain.memory.paged_optimizer_bytes
            + FACTORS["non_pytorch_bytes"])
    return dict(activations_bytes=int(acts), logits_and_loss_bytes=int(logits),
                optimizer_temporaries_bytes=int(temps),
                peak_allocated_bytes=allocated, peak_reserved_bytes=reserved, device_used_bytes=used)


def test_table_changes_the_estimate_by_exactly_the_stored_factors(table_file, llama):
    for name, w in _workloads(llama).items():
        plain = estimate(w, GPU, "none")
        cal = estimate(w, GPU, str(table_file))
        assert cal.raw_memory == plain.memory, name  # the raw breakdown is the uncalibrated one
        for key, value in _expected(plain, w).items():
            assert getattr(cal.memory, key) == value, (name, key)
        for key in ("weights_bytes", "gradients_bytes", "optimizer_states_bytes", "master_weights_bytes",
                    "kv_cache_bytes", "autocast_weight_cache_bytes", "quant_workspace_bytes",
                    "zero_buffers_bytes", "paged_optimizer_bytes", "host_bytes"):
            assert getattr(cal.memory, key) == getattr(plain.memory, key), (name, key)
        assert cal.memory.cuda_context_bytes == FACTORS["cuda_context_bytes"]
        assert cal.memory.allocator_reserve_bytes == cal.memory.peak_reserved_bytes - cal.memory.peak_allocated_bytes


def test_phase_follows_the_scaled_working_sets(table_file, llama):
    w = _workloads(llama)["full foreach optimizer step"]
    plain, cal = estimate(w, GPU, "none"), estimate(w, GPU, str(table_file))
    assert plain.memory.peak_phase == "optimizer step"
    # temporaries doubled: the optimizer step grows by exactly the extra temporaries
    assert cal.memory.peak_allocated_bytes - plain.memory.peak_allocated_bytes == (
        plain.memory.optimizer_temporaries_bytes + FACTORS["allocated_constant_bytes"])


def test_step_time_scales_by_the_mfu_ratio(table_file, llama):
    w = Workload(llama, method="full", batch=2, seq=2048)  # 8B: bucket 1-10B
    plain, cal = estimate(w, GPU, "none"), estimate(w, GPU, str(table_file))
    assert cal.corrections["mfu"] == {"value": 0.5, "from": "calibration (full|1-10B)"}
    # the GEMM FLOPs term scales by the achieved-fraction ratio; attention, elementwise, the GEMMs'
    # bytes term (estimator.compute_time.hfu_terms), optimizer step and overhead do not
    from estimator.compute_time import hfu_terms
    from estimator.tables import gpu as gpu_spec
    _, fixed = hfu_terms(w, gpu_spec(GPU))
    assert cal.time.compute_s - fixed == pytest.approx(
        (plain.time.compute_s - fixed) * plain.corrections["mfu"]["value"] / 0.5, rel=1e-9)
    assert cal.time.step_s - cal.time.compute_s == pytest.approx(plain.time.step_s - plain.time.compute_s,
                                                                 rel=1e-12)
    assert cal.raw_time.step_s == pytest.approx(plain.time.step_s, rel=1e-12)
    lora = Workload(llama, method="lora", batch=2, seq=2048)
    assert estimate(lora, GPU, str(table_file)).corrections["mfu"]["from"] == "calibration (lora)"


def test_inference_prefill_and_decode_use_the_table(table_file, llama):
    # compiled at batch 32: bandwidth-bound (no launch floor, no eager attention term)
    w = Workload(llama, method="inference", batch=32, seq=512, new_tokens=64, compiled=True)
    plain, cal = estimate(w, GPU, "none"), estimate(w, GPU, str(table_file))
    from estimator.compute_time import hfu_terms
    from estimator.tables import gpu as gpu_spec
    _, fixed = hfu_terms(w, gpu_spec(GPU))   # the part of the prefill that does not scale with HFU
    assert cal.time.prefill_s - fixed == pytest.approx(
        (plain.time.prefill_s - fixed) * plain.corrections["mfu"]["value"] / 0.6, rel=1e-9)
    bw = plain.corrections["decode_bandwidth_fraction"]["value"]
    assert cal.time.decode_s_per_token == pytest.approx(plain.time.decode_s_per_token * bw / 0.8, rel=1e-9)


def test_empty_table_is_the_uncalibrated_estimate(tmp_path, llama):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"schema": SCHEMA, "gpu": GPU, "factors": {}}))
    for name, w in _workloads(llama).items():
        assert estimate(w, GPU, str(path)).memory == estimate(w, GPU, "none").memory, name


def test_apply_memory_matches_the_memory_model_assembly(llama):
    """apply_memory re-decides the peak from the components as estimator.memory assembles them:
    persistent states + max(forward/backward, optimizer step). If memory.py changes that
    assembly, this test says so."""
    qwen = load_spec("qwen2.5-0.5b")
    cases = list(_workloads(llama).values()) + [
        Workload(qwen, method=m, batch=b, seq=s, grad_accum=g, **kw)
        for m, kw in (("full", {}), ("lora", {}), ("qlora", {"quant": "nf4"}))
        for b, s, g in ((1, 32, 1), (4, 4096, 2), (2, 512, 1))]
    for w in cases:
        if not w.training:
            continue
        m = estimate(w, GPU, "none").memory
        acc = m.gradients_bytes if w.grad_accum > 1 else 0
        fwd = (m.activations_bytes + m.logits_and_loss_bytes + m.autocast_weight_cache_bytes
               + m.quant_workspace_bytes + acc)
        step = m.gradients_bytes + m.optimizer_temporaries_bytes
        persistent = (m.weights_bytes + m.optimizer_states_bytes + m.master_weights_bytes + m.zero_buffers_bytes
                      + m.blas_workspace_bytes)
        assert m.blas_workspace_bytes == 2 * WORKSPACE, w.id
        assert abs(persistent + max(fwd, step) - m.peak_allocated_bytes) <= 16, w.id
        assert m.peak_phase == ("forward/backward" if fwd >= step else "optimizer step"), w.id


def test_lookup_fallbacks():
    cal = Calibration.from_table(table(), "t")
    assert cal.activation_scale("llama", "sdpa") == (1.25, "calibration (llama|sdpa)")
    assert cal.activation_scale("llama", "eager") == (1.1, "calibration (llama)")
    assert cal.activation_scale("gemma2", "eager") == (0.9, "calibration (*)")
    assert cal.activation_scale("llama", "sdpa", training=False) == (1.5, "calibration (*)")
    assert calmod.NONE.activation_scale("llama") == (1.0, "default")
    assert cal.reserve("full") == (0.05, 300 * MiB, "calibration (full)")
    assert cal.reserve("qlora") == (0.2, 100 * MiB, "calibration (*)")
    assert calmod.NONE.reserve("qlora")[1:] == (0, "default")
    assert cal.mfu("full", GPU, 8e9) == (0.5, "calibration (full|1-10B)")
    assert cal.mfu("full", GPU, 70e9)[1] == "default"
    assert cal.mfu("inference", GPU, 8e9) == (0.6, "calibration (inference-prefill)")
    assert [size_bucket(x) for x in (5e8, 1e9, 3e10, 4e11)] == ["<1B", "1-10B", "10-100B", ">=100B"]


def _write(tmp_path, data, name="t.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.parametrize("bad, message", [
    ("{not json", "is corrupt"),
    ({"schema": "something-else/1", "factors": {}}, "is not a gpu-budget-calibration/2 table"),
    ({"schema": "gpu-budget-calibration/1", "factors": {}}, "retired schema"),
    ([1, 2], "not a JSON object"),
    ({"schema": SCHEMA, "factors": {}}, "gpu must name"),
    ({"schema": SCHEMA, "gpu": GPU, "factors": {"warp_factor": 9}}, "unknown factors"),
    ({"schema": SCHEMA, "gpu": GPU, "factors": {"logits_scale": 50.0}}, "logits_scale must be"),
    ({"schema": SCHEMA, "gpu": GPU, "factors": {"logits_scale": True}}, "logits_scale must be"),
    ({"schema": SCHEMA, "gpu": GPU, "factors": {"cuda_context_bytes": 1.5}}, "must be an integer"),
    ({"schema": SCHEMA, "gpu": GPU, "factors": {"reserve": {"full": {"fraction": 0.1}}}}, "reserve[full]"),
    ({"schema": SCHEMA, "gpu": GPU, "factors": {"mfu": {"full": 1.5}}}, "mfu[full]"),
    ({"schema": SCHEMA, "gpu": GPU, "factors": {}, "upper_bound": {"device_used_bytes": {"factor": 0.5}}},
     "upper_bound"),
    ({"schema": SCHEMA, "gpu": GPU, "factors": {}, "cv_error": {"step_s": {"median_abs": -1}}}, "cv_error"),
    ({"schema": SCHEMA, "gpu": GPU, "factors": {}, "surprise": 1}, "unknown keys"),
    ({"schema": SCHEMA, "gpu": GPU}, "has no factors"),
])
def test_corrupt_or_foreign_tables_are_refused(tmp_path, bad, message, llama):
    path = _write(tmp_path, bad)
    with pytest.raises(InputError) as exc:
        estimate(Workload(llama), GPU, path)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_auto_picks_the_gpu_table_and_refuses_a_foreign_one(tmp_path, monkeypatch, llama):
    monkeypatch.setattr(calmod, "CALIBRATION_DIR", tmp_path)
    w = Workload(llama, method="lora")
    assert estimate(w, GPU, "auto").calibration.path is None  # no table: uncalibrated
    (tmp_path / f"{GPU}.json").write_text(json.dumps(table()))
    est = estimate(w, GPU, "auto")
    assert est.calibration.path.endswith(f"{GPU}.json")
    assert est.corrections["cuda_context_bytes"]["from"] == "calibration"
    (tmp_path / "a100-80gb.json").write_text(json.dumps(table()))  # an h100 table under the a100 name
    with pytest.raises(InputError, match="fitted on h100-80gb, not a100-80gb"):
        estimate(w, "a100-80gb", "auto")


def test_another_gpus_table_by_path_lends_only_device_independent_factors(table_file, llama):
    w = Workload(llama, method="full", batch=2, seq=2048)
    est = estimate(w, "a100-80gb", str(table_file))
    assert any("fitted on h100-80gb, not a100-80gb" in text for text in est.warnings)
    assert est.corrections["activation_scale"]["value"] == 1.25
    assert est.corrections["cuda_context_bytes"]["from"] == "default"
    assert est.corrections["mfu"]["from"] == "default"
    assert est.upper_bound is None


def test_upper_bound_and_calibration_section(table_file, llama):
    w = Workload(llama, method="full", batch=2, seq=2048)
    est = estimate(w, GPU, str(table_file))
    assert est.device_used_upper_bytes == math.ceil(est.memory.device_used_bytes * 1.07)
    data = est.to_dict()["calibration"]
    assert data["upper_bound"]["coverage"] == 0.93 and data["upper_bound"]["within_data_range"] is True
    assert data["gpu"] == GPU and data["versions"]["torch"] == ["2.13.0"] and data["warnings"] == []
    assert estimate(w, GPU, "none").upper_bound is None
    assert estimate(w, GPU, "none").to_dict()["calibration"]["upper_bound"] is None


def test_range_warnings(table_file):
    big = Workload(load_spec("llama-3.1-70b"), method="full", batch=8, seq=8192, gpus=8, zero=3)
    est = estimate(big, GPU, str(table_file))
    text = " | ".join(est.warnings)
    assert "70.55B parameters is far outside" in text
    assert "65536 tokens is far outside" in text
    assert est.upper_bound["within_data_range"] is False
    gemma = Workload(load_spec("gemma-2-2b"), method="full", attn="eager")
    assert any("no gemma2 model" in t for t in estimate(gemma, GPU, str(table_file)).warnings)
    single = Calibration.from_table(table(range={"world_sizes": [1], "methods": {"full": 3}}), "t")
    lora2 = Workload(load_spec("llama-3.1-8b"), method="lora", gpus=2)
    text = " | ".join(single.range_warnings(lora2, 8_000_000_000))
    assert "single-GPU runs only" in text and "no lora runs" in text


def test_version_warnings():
    cal = Calibration.from_table(table(), "t")
    assert cal.version_warnings({"torch": "2.13.0", "driver": "570.86.15"}) == []
    (msg,) = cal.version_warnings({"torch": "2.14.0", "transformers": "5.30.0"})
    assert "torch 2.13.0" in msg and "2.14.0" in msg


def test_reloads_a_table_changed_on_disk(table_file, llama):
    w = Workload(llama, method="full")
    first = estimate(w, GPU, str(table_file)).memory.cuda_context_bytes
    changed = table(factors={**FACTORS, "cuda_context_bytes": 900 * MiB})
    table_file.write_text(json.dumps(changed))
    os.utime(table_file, ns=(1, 10**18))  # a different mtime even on coarse clocks
    assert first == 700 * MiB
    assert estimate(w, GPU, str(table_file)).memory.cuda_context_bytes == 900 * MiB


def test_resolve_accepts_a_calibration_object():
    cal = Calibration.from_table(table(), "<memory>")
    assert resolve(cal, GPU) is cal


def _cli(argv):
    from tests.scripts_loader import load_script

    return load_script("estimate").main(argv)


def test_cli_json_and_text_with_a_table(table_file, capsys):
    args = ["--model", "llama-3.1-8b", "--method", "lora", "--batch", "2", "--seq", "1024", "--gpu", GPU,
            "--calibration", str(table_file)]
    assert _cli(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["calibration"]["file"] == str(table_file.resolve())
    assert data["memory"]["raw"]["peak_allocated_bytes"] < data["memory"]["peak_allocated_bytes"]
    assert data["calibration"]["upper_bound"]["device_used_bytes"] >= data["memory"]["device_used_bytes"]
    assert _cli(args) == 0
    assert "calibration:" in capsys.readouterr().out


def test_cli_text_shows_the_upper_bound_warnings_and_calibrated_extras(table_file, capsys):
    # 70B is far outside the table's 1B-9B range: the bound says its coverage was not measured
    args = ["--model", "llama-3.1-70b", "--method", "qlora", "--batch", "1", "--seq", "1024", "--gpu", GPU,
            "--calibration", str(table_file)]
    assert _cli(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    bound_gib = data["calibration"]["upper_bound"]["device_used_bytes"] / GiB
    assert _cli(args) == 0
    out = capsys.readouterr().out
    assert f"table's device-used bound before widening: {bound_gib:.2f} GiB" in out
    safe_gib = data["memory"]["safe"]["device_used_bytes"] / GiB   # the safe bound: the table's, widened
    assert safe_gib > bound_gib and f"{safe_gib:.2f} GiB   covers" in out
    assert "covered 93% of held-out measurements; workload outside the table's data" in out
    assert "warning:" in out and "non_pytorch" in out and "allocated_constant" in out


def test_a_table_fitted_on_other_library_versions_is_flagged(table_file, llama):
    from estimator.versions import installed_versions

    here = installed_versions()
    assert here.get("transformers"), "transformers is a dependency: its version must be found"
    w = Workload(model=llama, method="lora", batch=2, seq=1024).validate()
    same = dict(table(), versions={lib: [v] for lib, v in here.items()})
    table_file.write_text(json.dumps(same))
    assert not [t for t in estimate(w, GPU, str(table_file)).warnings if "fitted with" in t]
    other = dict(table(), versions={"transformers": ["4.0.0"]})
    table_file.write_text(json.dumps(other))
    flagged = [t for t in estimate(w, GPU, str(table_file)).warnings if "fitted with" in t]
    assert flagged == [f"calibration fitted with transformers 4.0.0; this run has {here['transformers']}"]


def test_a_fitted_gemm_level_may_pass_the_rated_peak_like_the_table(tmp_path, llama):
    # the calibration's mfu is the GEMM level mfu.csv holds: a GeForce card's measured matmul rate
    # passes its rated peak (RTX 3090 1.06), so a fitted table may say so too, up to the same cap
    from estimator.tables import GEMM_LEVEL_MAX
    w = Workload(llama, method="lora", batch=2, seq=2048)
    path = _write(tmp_path, {"schema": SCHEMA, "gpu": "rtx3090-24gb", "factors": {"mfu": {"lora": 1.08}}})
    est = estimate(w, "rtx3090-24gb", path)
    assert est.corrections["mfu"] == {"value": 1.08, "from": "calibration (lora)"}
    assert estimate(w, "rtx3090-24gb", "none").corrections["mfu"]["value"] == 1.06
    too_high = {"mfu": {"lora": GEMM_LEVEL_MAX + 0.01}}
    path = _write(tmp_path, {"schema": SCHEMA, "gpu": "rtx3090-24gb", "factors": too_high})
    with pytest.raises(InputError, match=r"mfu\[lora\]"):
        estimate(w, "rtx3090-24gb", path)
