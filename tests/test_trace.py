"""The tracer (profiler.trace): exact parameter, gradient and optimizer-state bytes, the KV cache
against the formula, layer extrapolation against full traces, fake against real tensors.

Tiny configs (written to tmp files) keep every trace under a second; the 7B timing check lives
in scripts/bench_tracer.py and in test_trace_speed.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.distributed._tools.mem_tracker import _MemRefType

from estimator.memory import estimate_memory, inference_kv_bytes, kv_dtype_bytes
from profiler.case import Case
from profiler.trace import trace, trace_row
from profiler.trace import tracker as tk
from profiler.trace.tracker import GRANULE, LiveBytes, rounded

LLAMA = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 176,
         "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 512, "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "vocab_size": 1000, "n_embd": 64, "n_layer": 6, "n_head": 4, "n_positions": 256,
        "activation_function": "gelu_new", "tie_word_embeddings": True}
GEMMA2 = {"model_type": "gemma2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "sliding_window": 16, "max_position_embeddings": 512}
QWEN_MOE = {"model_type": "qwen2_moe", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 4,
            "num_experts_per_tok": 2, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 4, "mlp_only_layers": [1, 4], "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("configs")
    out = {}
    for name, cfg in (("llama", LLAMA), ("gpt2", GPT2), ("gemma2", GEMMA2), ("moe", QWEN_MOE)):
        path = folder / f"{name}.json"
        path.write_text(json.dumps(cfg))
        out[name] = str(path)
    return out


def _params(case):
    """The model as the tracer builds it, materialised with real (CPU) tensors."""
    from profiler.build import build_model
    from profiler.trace.step import _materialize

    model = build_model(case.config(), case.workload(), "meta")
    _materialize(model, "cpu")
    return model


def _bytes(tensors) -> int:
    """Sum of 512-B-rounded storage bytes of distinct tensors."""
    seen = {id(t): t for t in tensors}
    return sum(rounded(t.numel() * t.element_size()) for t in seen.values())


# ---- exact states ----------------------------------------------------------------------------

@pytest.mark.parametrize("settings", [
    dict(method="full", precision="bf16", adamw_impl="fused"),
    dict(method="full", precision="amp-bf16", adamw_impl="foreach"),
    dict(method="lora", precision="bf16"),
])
def test_parameters_gradients_optimizer_states_are_exact(configs, settings):
    case = Case(configs["llama"], dict(batch=2, seq=32, **settings))
    w = case.workload()
    r = trace(case, layers=w.model.num_layers)
    model = _params(case)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    assert r.by_category["Parameter"] == _bytes(params)
    assert r.category_max["Gradient"] == _bytes(trainable)
    # AdamW: exp_avg and exp_avg_sq like each parameter, plus a scalar fp32 `step` per parameter
    states = 2 * _bytes(trainable) + len(trainable) * GRANULE
    assert r.category_max["Optstate"] == states
    # the estimator's exact counts, within the allocator's rounding (one granule per tensor)
    m = estimate_memory(w, 0.0, 0)
    assert abs(r.by_category["Parameter"] - m.weights_bytes) <= GRANULE * len(params)
    assert abs(r.category_max["Gradient"] - m.gradients_bytes) <= GRANULE * len(trainable)
    assert abs(r.category_max["Optstate"] - m.optimizer_states_bytes) <= 3 * GRANULE * len(trainable)


def test_categories_are_named_as_pytorch_memtracker_names_them():
    """The installed torch's MemTracker (`_MemRefType`) names the shared categories."""
    assert (tk.PARAMETER, tk.BUFFER, tk.GRADIENT, tk.ACTIVATION, tk.TEMP, tk.OPTSTATE) == (
        _MemRefType.PARAM.value, _MemRefType.BUFFER.value, _MemRefType.GRAD.value,
        _MemRefType.ACT.value, _MemRefType.TEMP.value, _MemRefType.OPT.value)
    assert len(set(tk.CATEGORIES)) == len(tk.CATEGORIES) == 9
    ours = set(tk.CATEGORIES) - {m.value for m in _MemRefType}
    assert ours == {tk.INPUT, tk.KV_CACHE, tk.OPTIMIZER_TEMP}


def test_a_training_trace_files_every_kind_of_storage(configs):
    case = Case(configs["llama"], dict(batch=2, seq=32))
    r = trace(case, layers=2)
    seen = set(r.category_max)
    assert {"Parameter", "Gradient", "Optstate", "Activation", "Temp", "Input"} <= seen, seen
    assert r.saved_activations_bytes == r.phase_start["backward"]["Activation"] > 0


def test_qlora_storage_matches_bitsandbytes_layout(configs):
    """NF4 with double quantization: packed uint8 + uint8 absmax per 64 + fp32 per 256 blocks, the
    rest (embeddings, norms, lm_head) upcast to fp32 by peft's kbit preparation."""
    case = Case(configs["llama"], dict(method="qlora", quant="nf4", batch=1, seq=32))
    w = case.workload()
    r = trace(case, layers=w.model.num_layers)
    m = estimate_memory(w, 0.0, 0)
    stored = r.by_category["Parameter"] + r.by_category.get("Buffer", 0)
    tensors = 7 * w.model.num_layers * 6 + 4 * w.model.num_layers + 4   # per linear: 6 tensors
    assert abs(stored - m.weights_bytes) <= GRANULE * tensors
    assert stored > 0.99 * m.weights_bytes


# ---- KV cache --------------------------------------------------------------------------------

@pytest.mark.parametrize("name, settings", [
    ("llama", dict(batch=2, seq=24, new_tokens=6)),
    ("llama", dict(batch=1, seq=40, new_tokens=3, precision="amp-bf16")),   # fp32 rotary keys
    ("gemma2", dict(batch=2, seq=40, new_tokens=5, attn="eager")),          # sliding layers
])
def test_kv_cache_equals_the_formula(configs, name, settings):
    case = Case(configs[name], dict(method="inference", **settings))
    w = case.workload()
    r = trace(case, layers=w.model.num_layers)
    expected = inference_kv_bytes(w.model, w.batch, w.seq, w.new_tokens, kv_dtype_bytes(w))
    tensors = 2 * w.model.num_layers
    assert expected <= r.category_max["KV cache"] <= expected + GRANULE * tensors


# ---- layer extrapolation ---------------------------------------------------------------------

@pytest.mark.parametrize("name, settings", [
    ("llama", dict(batch=2, seq=64)),
    ("llama", dict(batch=1, seq=32, grad_ckpt=True)),                 # the backward's end rises fastest
    ("llama", dict(method="lora", precision="amp-bf16", attn="eager", batch=2, seq=64)),
    ("gpt2", dict(batch=2, seq=64, precision="amp-bf16", grad_ckpt=True)),
    ("gemma2", dict(method="lora", attn="eager", batch=1, seq=48)),   # alternating sliding/full layers
    ("moe", dict(method="lora", batch=2, seq=32)),                    # MoE and dense layers mixed
    ("llama", dict(method="inference", batch=2, seq=48, new_tokens=4)),
])
def test_extrapolation_equals_a_full_trace(configs, name, settings):
    case = Case(configs[name], settings)
    n = case.workload().model.num_layers
    small, full = trace(case), trace(case, layers=n)
    assert small.extrapolated and max(small.layers_traced) < n and not full.extrapolated
    assert small.phases == full.phases
    assert small.peak_allocated_bytes == full.peak_allocated_bytes
    assert small.by_category == full.by_category


# ---- fake tensors against real ones ----------------------------------------------------------

def _real_cpu_peak(case) -> int:
    """The same step on real CPU tensors, counted by the same tracker."""
    from profiler.build import build_model, make_batch, make_optimizer
    from profiler.trace.step import _register, _warm_up
    from profiler.trace.patches import tracing_patches
    from profiler.steps import train_step

    w = case.workload()
    model = build_model(case.config(), w, "cpu")
    with tracing_patches():
        optimizer = make_optimizer(model, w)
        batch = make_batch(w, w.model.vocab_size, "cpu")
        _warm_up(model, optimizer, w)
        tracker = LiveBytes()
        _register(tracker, model, optimizer, batch)
        tracker.watch(model, optimizer)
        with tracker:
            train_step(model, optimizer, batch, w, "cpu")
        tracker.close()
    return tracker.peak.total


@pytest.mark.parametrize("settings", [dict(attn="eager"), dict(attn="sdpa", method="lora")])
def test_fake_trace_equals_real_cpu_step(configs, settings):
    """Fake tensors allocate what real ones do (shapes, dtypes, what autograd saves)."""
    case = Case(configs["llama"], dict(batch=2, seq=32, precision="fp32", **settings))
    fake = trace(case, layers=case.workload().model.num_layers)
    assert fake.peak_allocated_bytes == _real_cpu_peak(case)


# ---- records ---------------------------------------------------------------------------------

def test_trace_row_is_a_record_row(configs):
    from profiler.record import COLUMN_NAMES

    row = trace_row(Case(configs["llama"], dict(batch=1, seq=16)))
    assert set(row) == set(COLUMN_NAMES)
    assert row["backend"] == "trace" and row["status"] == "ok"
    assert row["peak_allocated_bytes"] > 0 and row["peak_allocated_bytes"] % GRANULE == 0
    assert row["peak_reserved_bytes"] is None and row["step_s"] is None and row["device_used_bytes"] is None


def test_untraceable_configuration_is_skipped_not_crashed(configs):
    row = trace_row(Case(configs["llama"], dict(method="lora", quant="int8", batch=1, seq=16)))
    assert row["status"] == "skipped", row["message"]
    assert row["message"].startswith("not traceable: int8") and row["peak_allocated_bytes"] is None


def test_result_dict_is_json_ready(configs):
    r = trace(Case(configs["llama"], dict(batch=1, seq=16)))
    d = json.loads(json.dumps(r.to_dict()))
    assert d["peak_allocated_bytes"] == r.peak_allocated_bytes
    assert d["saved_activations_bytes"] == r.saved_activations_bytes
    assert math.isfinite(d["trace_s"]) and d["rss_bytes"] > 0
