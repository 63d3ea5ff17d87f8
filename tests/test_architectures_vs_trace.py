"""The newer families' activations and working sets against the fake-tensor tracer (profiler.trace,
the oracle): tiny configs (tests/arch_configs.py TRACED) traced whole for a full fine-tune, LoRA
and inference; the estimator's raw peak_allocated_bytes and saved activations within 3 %."""

from __future__ import annotations

import copy

import pytest
import transformers

from estimator.memory import estimate_memory, saved_activation_bytes
from estimator.model import spec_from_config
from estimator.workload import Workload
from profiler.trace.step import trace
from tests.arch_configs import TRACED

transformers.logging.set_verbosity_error()
TOLERANCE = 0.03
_LORA = {"deepseek_v3": ("q_b_proj", "kv_b_proj", "o_proj"), "deepseek_v2": ("q_proj", "kv_b_proj", "o_proj")}
CASES = [(name, method) for name in sorted(TRACED) for method in ("full", "lora", "inference")]


@pytest.mark.parametrize("name,method", CASES)
def test_estimate_matches_trace(name, method):
    cfg = TRACED[name]
    settings = dict(method=method, batch=2, seq=256, lora_targets=_LORA[cfg["model_type"]])
    if method == "inference":
        settings["new_tokens"] = 4
    w = Workload(spec_from_config(cfg, name), **settings).validate()
    traced = trace(w, copy.deepcopy(cfg), layers=cfg["num_hidden_layers"])
    peak = estimate_memory(w, 0.0, 0).peak_allocated_bytes
    assert abs(peak / traced.peak_allocated_bytes - 1) <= TOLERANCE, (peak, traced.peak_allocated_bytes)
    if w.training:
        saved = saved_activation_bytes(w)
        assert abs(saved / traced.saved_activations_bytes - 1) <= TOLERANCE, (saved, traced.saved_activations_bytes)



# Qwen3-Next: the tracer runs the gated delta-net's torch fallback (torch_chunk_gated_delta_rule,
# causal_conv1d's reference path) on CPU, as transformers does wherever flash-linear-attention is not
# installed; the estimator counts what those layers save (estimator.activations._linear_attention).
def _qwen3_next(method):
    from tests.arch_configs import TRACED_LINEAR_ATTENTION

    cfg = TRACED_LINEAR_ATTENTION["qwen3_next"]
    settings = dict(method=method, batch=2, seq=256, lora_targets=("q_proj", "v_proj", "in_proj_qkvz", "out_proj"))
    if method == "inference":
        settings["new_tokens"] = 4
    w = Workload(spec_from_config(cfg, "qwen3_next"), **settings).validate()
    return w, trace(w, copy.deepcopy(cfg), layers=cfg["num_hidden_layers"])


@pytest.mark.parametrize("method", ["full", "lora"])
def test_qwen3_next_training_peak_matches_trace(method):
    w, traced = _qwen3_next(method)
    peak = estimate_memory(w, 0.0, 0).peak_allocated_bytes
    assert abs(peak / traced.peak_allocated_bytes - 1) <= TOLERANCE, (peak, traced.peak_allocated_bytes)
    saved = saved_activation_bytes(w)
    assert abs(saved / traced.saved_activations_bytes - 1) <= TOLERANCE, (saved, traced.saved_activations_bytes)


def test_qwen3_next_inference_peak_matches_trace():
    w, traced = _qwen3_next("inference")
    peak = estimate_memory(w, 0.0, 0).peak_allocated_bytes
    assert abs(peak / traced.peak_allocated_bytes - 1) <= TOLERANCE, (peak, traced.peak_allocated_bytes)
