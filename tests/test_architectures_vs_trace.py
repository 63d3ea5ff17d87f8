"""The newer families' activations and working sets against the fake-tensor tracer (profiler.trace,
the oracle): tiny configs (tests/arch_configs.py TRACED) traced whole for a full fine-tune, LoRA
and inference; the estimator's raw peak_allocated_bytes and saved activations within 3 %.

Where the estimator does not reach 3 % the bound it does reach is asserted instead, with the gap
measured (never skipped): `LOOSER` below."""

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
_LORA = {"deepseek_v3": ("q_b_proj", "kv_b_proj", "o_proj"), "deepseek_v2": ("q_proj", "kv_b_proj", "o_proj"),
         # the families' own names: GPT-J's out_proj and fc_in, GLM's fused gate_up_proj
         "gptj": ("q_proj", "v_proj", "out_proj", "fc_in"), "glm": ("q_proj", "v_proj", "o_proj", "gate_up_proj"),
         "glm4": ("q_proj", "v_proj", "o_proj", "gate_up_proj")}
_DEFAULT_LORA = ("q_proj", "v_proj", "o_proj", "down_proj")
_ATTN = {"gptj": "eager"}   # GPT-J has no SDPA path in transformers 5.23
# (name, method) -> the bound reached, measured 2026-11-24 (estimate / trace - 1), not yet modelled:
# StableLM's prefill working set (-3.7 %; with per-head q/k norms and the parallel residual +3.6 %).
# The saved activations of every training case are within 3 %.
LOOSER = {("stablelm", "inference"): 0.04, ("stablelm-qk-parallel", "inference"): 0.04}
CASES = [(name, method) for name in sorted(TRACED) for method in ("full", "lora", "inference")]


@pytest.mark.parametrize("name,method", CASES)
def test_estimate_matches_trace(name, method):
    cfg = TRACED[name]
    mt = cfg["model_type"]
    settings = dict(method=method, batch=2, seq=256, lora_targets=_LORA.get(mt, _DEFAULT_LORA),
                    attn=_ATTN.get(mt, "sdpa"))
    if method == "inference":
        settings["new_tokens"] = 4
    w = Workload(spec_from_config(cfg, name), **settings).validate()
    traced = trace(w, copy.deepcopy(cfg), layers=cfg.get("num_hidden_layers", cfg.get("n_layer")))
    peak = estimate_memory(w, 0.0, 0).peak_allocated_bytes
    bound = LOOSER.get((name, method), TOLERANCE)
    assert abs(peak / traced.peak_allocated_bytes - 1) <= bound, (peak, traced.peak_allocated_bytes)
    if w.training:
        saved = saved_activation_bytes(w)
        assert abs(saved / traced.saved_activations_bytes - 1) <= TOLERANCE, (saved, traced.saved_activations_bytes)


def test_the_looser_bounds_are_still_needed():
    # A bound above 3 % must describe a gap that exists: once the estimator closes it, this fails and
    # the entry is removed.
    for (name, method), bound in LOOSER.items():
        cfg = TRACED[name]
        w = Workload(spec_from_config(cfg, name), method=method, batch=2, seq=256, new_tokens=4).validate()
        traced = trace(w, copy.deepcopy(cfg), layers=cfg["num_hidden_layers"])
        error = abs(estimate_memory(w, 0.0, 0).peak_allocated_bytes / traced.peak_allocated_bytes - 1)
        assert TOLERANCE < error <= bound, (name, method, error)


def test_gptj_refuses_sdpa_as_transformers_does():
    from estimator.errors import InputError

    with pytest.raises(InputError, match="no SDPA"):
        Workload(spec_from_config(TRACED["gptj"], "gptj"), method="full").validate()
    assert Workload(spec_from_config(TRACED["gptj"], "gptj"), method="full", attn="eager").validate()


def test_the_clip_flag_leaves_stored_fingerprints_alone():
    # ModelSpec.qkv_clip came after measurements were stored under ids carrying fingerprints: a spec
    # without it keeps its fingerprint (Llama-2-7b's, computed before the field existed)
    from estimator.configs import load_spec

    assert load_spec("meta-llama/Llama-2-7b-hf").fingerprint == "e5159878"
    clipped, plain = (spec_from_config(TRACED[n], n) for n in ("olmo-clip", "olmo"))
    assert clipped.qkv_clip and not plain.qkv_clip and clipped.fingerprint != plain.fingerprint


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
