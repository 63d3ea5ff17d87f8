"""DoRA (`--dora`, peft `LoraConfig(use_dora=True)`): trainable magnitude vectors counted by hand and
against peft's own count; the estimator's peaks and saved activations against fake-tensor traces of
the real transformers + peft step on small configurations where DoRA's weight-norm transient sets
the peak (tracer: profiler.trace); time; refusals in one line."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest

from estimator import memory
from estimator.api import estimate
from estimator.configs import load_spec
from estimator.errors import InputError
from estimator.flops import training_flops
from estimator.memory import estimate_memory, saved_activation_bytes
from estimator.model import spec_from_config
from estimator.params import count_params
from estimator.states import dora_params, lora_params, model_states, states_key
from estimator.workload import Workload, lora_targets_from_text
from tests.bad_input import assert_refused
from tests.scripts_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
TINY_PATH = ROOT / "tests" / "data" / "tiny-llama.json"
TINY_CFG = json.loads(TINY_PATH.read_text())
# hidden 64, 4 heads of 16, 2 kv heads (kv width 32), MLP 176, 2 layers
TINY = spec_from_config(TINY_CFG, "tiny")
# wider inputs than outputs, so the identity DoRA builds (d_in^2) and the d_out x d_in sums are the
# largest tensors of a short step: its transient sets the peak
WIDE_CFG = {**TINY_CFG, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 512}
WIDE = spec_from_config(WIDE_CFG, "tiny-wide")


# ---- trainable parameters ------------------------------------------------------------------------

def test_magnitude_vectors_counted_by_hand():
    # q_proj: 64 outputs, v_proj: 32 (2 kv heads x 16), in each of 2 layers: one magnitude per output
    w = Workload(TINY, method="lora").validate()
    assert dora_params(w) == 0
    assert dora_params(w.with_(dora=True)) == 2 * (64 + 32) == 192
    # all-linear: q 64, k 32, v 32, o 64, gate 176, up 176, down 64 per layer
    wide = w.with_(lora_targets=lora_targets_from_text("all-linear"), dora=True)
    assert dora_params(wide) == 2 * (64 + 32 + 32 + 64 + 176 + 176 + 64) == 1216
    p = count_params(TINY)
    # r x (d_in + d_out) per adapter, 16 x (64 + 64) + 16 x (64 + 32) per layer, plus the magnitudes
    assert lora_params(w.with_(dora=True), p) == 2 * (16 * 128 + 16 * 96) + 192


def _peft_trainable(cfg: dict, targets, rank: int = 16, dora: bool = True) -> tuple[int, dict]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
        model = get_peft_model(model, LoraConfig(r=rank, target_modules=targets, use_dora=dora))
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    magnitudes = {n: p for n, p in trained if "lora_magnitude_vector" in n}
    return sum(p.numel() for _, p in trained), magnitudes


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_trainable_count_equals_peft(targets):
    total, magnitudes = _peft_trainable(TINY_CFG, targets)
    text = targets if isinstance(targets, str) else ",".join(targets)
    w = Workload(TINY, method="lora", lora_targets=lora_targets_from_text(text), dora=True).validate()
    assert lora_params(w, count_params(TINY)) == total
    assert dora_params(w) == sum(p.numel() for p in magnitudes.values())
    assert {p.dim() for p in magnitudes.values()} == {1}


def test_trainable_count_equals_peft_on_gpt2_conv1d():
    # GPT-2's fused c_attn (a Conv1D, fan_in_fan_out): one magnitude of 3 x hidden per layer
    from tests.test_lora_targets import FAMILIES

    cfg = FAMILIES["gpt2"]
    spec = spec_from_config(cfg, "gpt2")
    total, _ = _peft_trainable(cfg, ["c_attn"], rank=8)
    w = Workload(spec, method="lora", lora_rank=8, lora_targets=("c_attn",), dora=True).validate()
    assert lora_params(w, count_params(spec)) == total


def test_magnitudes_carry_gradients_and_adam_states():
    w = Workload(load_spec("llama-3.2-1b"), method="lora", lora_targets=lora_targets_from_text("all-linear"))
    off, on = model_states(states_key(w.validate())), model_states(states_key(w.with_(dora=True)))
    extra = dora_params(w.with_(dora=True))
    assert extra == 16 * (2048 + 512 + 512 + 2048 + 8192 + 8192 + 2048)
    assert on.gradients - off.gradients == 4 * extra            # fp32, as peft keeps the adapters
    assert on.optimizer - off.optimizer == 8 * extra            # AdamW: two fp32 states
    assert on.weights - off.weights == 4 * extra


# ---- against the tracer --------------------------------------------------------------------------

# (settings, whether the whole peak is held to 1 %): on this small, wide model the estimator's LoRA
# baseline itself is off by 5-12 % for checkpointed autocast/QLoRA steps (allocator rounding of many
# small tensors), so there the DoRA step's whole peak is held to 3 % (the recomputed layer's weight
# casts counted: the autocast one was 11 % under before) and its increment over the baseline to 6 %
_CASES = [
    (dict(method="lora", lora_targets="all-linear", seq=16), True),
    (dict(method="lora", lora_targets="all-linear", seq=16, grad_ckpt=True), True),
    (dict(method="lora", seq=128, batch=2), True),
    (dict(method="qlora", quant="nf4", lora_targets="all-linear", seq=16), True),
    (dict(method="lora", precision="amp-bf16", lora_targets="all-linear", seq=16, grad_ckpt=True), False),
    (dict(method="qlora", quant="nf4", lora_targets="all-linear", seq=16, grad_ckpt=True), False),
    (dict(method="qlora", quant="nf4", kbit_prep="off", lora_targets="all-linear", seq=32, grad_ckpt=True), False),
]


def _workload(settings: dict, dora: bool = True) -> Workload:
    s = dict(settings)
    if "lora_targets" in s:
        s["lora_targets"] = lora_targets_from_text(s["lora_targets"])
    return Workload(WIDE, dora=dora, **s).validate()


@lru_cache(maxsize=None)
def _traced(key: str, dora: bool = True):
    from profiler.trace import trace

    return trace(_workload(json.loads(key), dora), dict(WIDE_CFG), layers=2)


def _id(case) -> str:
    return "-".join(f"{k}={v}" for k, v in case[0].items())


@pytest.mark.parametrize("case", _CASES, ids=_id)
def test_dora_increment_peak_and_saved_activations_match_the_trace(case):
    settings, whole = case
    key = json.dumps(settings, sort_keys=True)
    w, plain = _workload(settings), _workload(settings, dora=False)
    traced, traced_plain = _traced(key), _traced(key, False)
    est, est_plain = (estimate_memory(x, 0.0, 0).peak_allocated_bytes for x in (w, plain))
    added, added_traced = est - est_plain, traced.peak_allocated_bytes - traced_plain.peak_allocated_bytes
    assert added_traced > 0
    assert abs(added - added_traced) <= (0.03 if whole else 0.06) * added_traced, (added, added_traced)
    assert abs(est - traced.peak_allocated_bytes) <= (0.01 if whole else 0.03) * traced.peak_allocated_bytes, \
        (est, traced.peak_allocated_bytes)
    # what DoRA adds to the saved activations (base and adapter outputs, three vectors per module);
    # the estimator does not add the allocator's 512-byte rounding per tensor (README), a few percent
    # of what a 16-token step saves: 3 % or 32 tensors' rounding
    kept = saved_activation_bytes(w) - saved_activation_bytes(plain)
    kept_traced = traced.saved_activations_bytes - traced_plain.saved_activations_bytes
    assert (kept_traced > 0) == (not settings.get("grad_ckpt"))   # checkpointing keeps only layer inputs
    assert abs(kept - kept_traced) <= max(0.03 * kept_traced, 32 * 512), (kept, kept_traced)


def test_the_transient_sets_these_peaks():
    # without the weight-norm transient the estimate would miss the traced peak by far: the cases
    # above test the transient, not only the saved tensors
    for settings, _ in (_CASES[0], _CASES[1], _CASES[5]):
        w = _workload(settings)
        traced = _traced(json.dumps(settings, sort_keys=True)).peak_allocated_bytes
        transient = memory.dora_transient(w)
        assert transient > 0.2 * traced
        # the transient of down_proj (d_in 1024, d_out 256) in bf16 LoRA, counted by hand: the fp32
        # identity 1024^2 x 4, lora_A's output 1024 x 16 x 4, then four 256 x 1024 fp32 matrices (the
        # adapters' product, the base weight's fp32 copy, scaling x product, the sum)
    bf16 = _workload(_CASES[0][0])
    assert memory.dora_transient(bf16) == 1024 * 1024 * 4 + 1024 * 16 * 4 + 4 * (256 * 1024 * 4)


def test_estimate_with_dora_is_larger_and_dora_off_is_unchanged():
    w = _workload(_CASES[0][0])
    plain = replace(w, dora=False)
    assert memory.dora_transient(plain) == 0
    assert estimate_memory(w, 0.0, 0).peak_allocated_bytes > estimate_memory(plain, 0.0, 0).peak_allocated_bytes


# ---- time ----------------------------------------------------------------------------------------

def test_norm_flops_counted_by_hand():
    w = Workload(TINY, method="lora").validate()
    extra = training_flops(w.with_(dora=True)).forward - training_flops(w).forward
    # per layer: q_proj (64 -> 64) and v_proj (64 -> 32), rank 16: the identity through lora_A
    # (2 x 64 x 64 x 16) and lora_B (2 x 64 x 16 x d_out), and 4 x d_out x 64 for the norm
    per_layer = sum(2 * 64 * 64 * 16 + 2 * 64 * 16 * out + 4 * out * 64 for out in (64, 32))
    assert extra == pytest.approx(2 * per_layer)
    ckpt = w.with_(grad_ckpt=True)
    assert training_flops(ckpt.with_(dora=True)).recompute - training_flops(ckpt).recompute == pytest.approx(2 * per_layer)


def test_dora_step_is_slower():
    w = Workload(load_spec("llama-3.1-8b"), method="qlora", quant="nf4", batch=1, seq=2048, grad_ckpt=True,
                 lora_targets=lora_targets_from_text("all-linear")).validate()
    plain = estimate(w, "a100-80gb", calibration="none")
    dora = estimate(w.with_(dora=True), "a100-80gb", calibration="none")
    assert dora.time.compute_parts["adapter_s"] > plain.time.compute_parts["adapter_s"]
    assert dora.time.step_s > plain.time.step_s


# ---- refusals ------------------------------------------------------------------------------------

def test_dora_needs_lora_or_qlora():
    for method in ("full", "inference"):
        with pytest.raises(InputError, match="--dora is a LoRA variant"):
            Workload(TINY, method=method, dora=True).validate()


def test_dora_refused_on_parameter_and_embedding_targets():
    mixtral = load_spec("mixtral-8x7b")
    with pytest.raises(InputError, match="refuses DoRA on parameter targets"):
        Workload(mixtral, method="lora", lora_targets=lora_targets_from_text("all-linear"), dora=True).validate()
    for targets in (("q_proj", "lm_head"), ("embed_tokens",)):
        with pytest.raises(InputError, match="embedding or lm_head is not modelled"):
            Workload(TINY, method="lora", lora_targets=targets, dora=True).validate()


def test_cli_refuses_dora_with_a_full_fine_tune_in_one_line(tmp_path, capsys):
    cli = load_script("estimate")
    assert_refused(cli, capsys, ["--model", str(TINY_PATH), "--method", "full", "--dora"],
                   "--dora is a LoRA variant", "estimate.py", tmp_path)


def test_peft_config_sets_dora(tmp_path):
    from estimator.sources import peft as peft_source

    reading = peft_source.read({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"], "use_dora": True,
                                "lora_dropout": 0.05})
    assert reading.fields["dora"] is True
    assert any("lora_dropout" in u for u in reading.unmodelled)
    assert not any("use_dora" in u for u in reading.unmodelled)
    assert peft_source.read({"use_dora": False}).fields["dora"] is False
