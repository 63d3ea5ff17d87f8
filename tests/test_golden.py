"""Published reference values, each with its source and an explicit tolerance."""

from __future__ import annotations

import math

import pytest

from estimator.configs import load_spec
from estimator.flops import training_flops
from estimator.memory import estimate_memory, kv_cache_bytes
from estimator.params import count_params
from estimator.planner import compute_optimal
from estimator.workload import Workload

# Llama-2-7B (config: hidden 4096, intermediate 11008, 32 layers, 32 heads, vocab 32000, untied)
# Touvron et al. 2023 report "7B"; the Hugging Face model has exactly 6,738,415,616 parameters:
#   per layer 4 x 4096^2 (q,k,v,o) + 3 x 4096 x 11008 (gate,up,down) + 2 x 4096 (norms) = 202,383,360
#   32 layers = 6,476,267,520; + final norm 4096 + embedding 131,072,000 + lm_head 131,072,000
LLAMA2_7B_PARAMS = 6_738_415_616
EXACT = 1e-12  # relative tolerance for values that are exact by construction


@pytest.fixture(scope="module")
def llama2():
    return load_spec("llama-2-7b")


def mem(spec, **kw):
    return estimate_memory(Workload(model=spec, **kw).validate(), reserve_fraction=0.0, context_bytes=0)


def test_llama2_7b_param_count(llama2):
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    by_hand = 32 * per_layer + 4096 + 2 * 32000 * 4096
    assert by_hand == LLAMA2_7B_PARAMS
    assert count_params(llama2).total == LLAMA2_7B_PARAMS
    # the paper's "7B" is a rounded figure: within 5 %
    assert abs(LLAMA2_7B_PARAMS - 7e9) / 7e9 < 0.05


def test_mixed_precision_adam_16_bytes_per_param_amp(llama2):
    """Rajbhandari et al. 2020 (ZeRO) section 3.1: mixed-precision Adam keeps 2Ψ + 2Ψ + KΨ with
    K = 12, i.e. 16 B per parameter. The torch AMP regime (fp32 weights 4 + fp32 grads 4 + Adam 8,
    docs/design.md section 3) reaches the same 16 B."""
    m = mem(llama2, precision="amp-bf16", seq=128)
    states = m.weights_bytes + m.gradients_bytes + m.optimizer_states_bytes + m.master_weights_bytes
    assert states == pytest.approx(16 * LLAMA2_7B_PARAMS, rel=EXACT)


def test_zero_paper_k12_and_deepspeed_20_bytes(llama2):
    """ZeRO stage 1 on one GPU holds everything (no partitioning). ZeRO paper (Rajbhandari et al.
    2020, section 3.1): 2Ψ fp16/bf16 weights, 2Ψ gradients, K = 12 (fp32 master 4 + momentum 4 +
    variance 4) = 16Ψ. DeepSpeed 0.19.8 stage_1_and_2.py step() casts the flat bf16 gradient
    partition to fp32 before `free_grad_in_param_list` frees the bf16 gradients, so at that moment
    2 + 2 + 4 (fp32 gradients) + 4 + 8 = 20 B per parameter are live; DeepSpeed's own
    estimate_zero2_model_states_mem_needs gives the same 2P + 18P/N = 20P at N = 1."""
    m = mem(llama2, zero=1, gpus=1, seq=128)
    n = LLAMA2_7B_PARAMS
    assert m.weights_bytes == pytest.approx(2 * n, rel=EXACT)
    assert m.optimizer_states_bytes + m.master_weights_bytes == pytest.approx(12 * n, rel=EXACT)
    paper = 2 * n + 2 * n + 12 * n
    states = m.weights_bytes + m.gradients_bytes + m.optimizer_states_bytes + m.master_weights_bytes
    assert states == pytest.approx(paper + 4 * n, rel=EXACT)


def test_pure_bf16_8_bytes_per_param(llama2):
    # docs/design.md section 3: pure bf16 (LitGPT bf16-true, torchtune) 2 + 2 + 4 = 8 B
    m = mem(llama2, seq=128)
    states = m.weights_bytes + m.gradients_bytes + m.optimizer_states_bytes
    assert states == pytest.approx(8 * LLAMA2_7B_PARAMS, rel=EXACT)


def test_chinchilla_optimal_point():
    """Hoffmann et al. 2022: Chinchilla, 70B parameters on 1.4T tokens; C = 6 N D
    = 6 x 70e9 x 1.4e12 = 5.88e23 FLOPs. Tolerance 5 %."""
    opt = compute_optimal(6 * 70e9 * 1.4e12)
    assert opt.params == pytest.approx(70e9, rel=0.05)
    assert opt.tokens == pytest.approx(1.4e12, rel=0.05)
    assert 6 * opt.params * opt.tokens == pytest.approx(5.88e23, rel=1e-6)  # C = 6ND holds


def test_chinchilla_scales_as_sqrt_of_compute():
    # approaches 1/2 of Hoffmann et al.: N_opt and D_opt both ~ C^0.5 (a ~ b ~ 0.5)
    small, big = compute_optimal(1e21), compute_optimal(1e23)
    assert big.params / small.params == pytest.approx(10.0, rel=0.05)
    assert big.tokens / small.tokens == pytest.approx(10.0, rel=0.05)


def test_llama2_7b_kv_cache_half_mib_per_token(llama2):
    # widely published: 2 (K,V) x 32 layers x 4096 (32 heads x 128) x 2 B = 524,288 B = 0.5 MiB
    assert kv_cache_bytes(llama2, batch=1, tokens=1, dtype_bytes=2) == 524_288
    # so a 4096-token fp16 context is exactly 2 GiB
    m = mem(llama2, method="inference", precision="fp16", batch=1, seq=4096)
    assert m.kv_cache_bytes == 4096 * 524_288 == 2 * 2**30


def test_llama31_8b_gqa_kv_cache_128_kib_per_token():
    # Llama-3.1-8B: 32 layers, 8 kv heads x 128 = 1024: 2 x 32 x 1024 x 2 B = 131,072 B (128 KiB);
    # using the 32 attention heads instead would give 512 KiB (the GQA mistake of
    # docs/design.md section 3)
    spec = load_spec("llama-3.1-8b")
    assert kv_cache_bytes(spec, batch=1, tokens=1, dtype_bytes=2) == 131_072


def test_training_flops_6n_plus_attention(llama2):
    """Kaplan et al. 2020 (table 1) / PaLM (Chowdhery et al. 2022, appendix B): training FLOPs per
    token = 6N + 12 L H Q T, with N the non-embedding parameters (the lm_head is a matmul and
    counts; the token-embedding lookup does not), L layers, H heads, Q head dim, T sequence.
    Tolerance 1 %."""
    seq, batch = 4096, 1
    non_embedding = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 4096 + 32000 * 4096
    assert non_embedding == 6_607_343_616
    per_token = 6 * non_embedding + 12 * 32 * 32 * 128 * seq
    f = training_flops(Workload(model=llama2, batch=batch, seq=seq).validate())
    assert f.model_flops == pytest.approx(per_token * batch * seq, rel=0.01)
    # the forward share is one third
    assert f.forward == pytest.approx(f.model_flops / 3, rel=0.01)


def test_recompute_adds_a_forward_to_hardware_flops_only(llama2):
    plain = training_flops(Workload(model=llama2, seq=2048).validate())
    ckpt = training_flops(Workload(model=llama2, seq=2048, grad_ckpt=True).validate())
    assert ckpt.model_flops == plain.model_flops  # MFU is quoted against model FLOPs
    # recomputation repeats the decoder layers' forward (not the lm_head): ~ 2 x 6.476e9 x T + attention
    layers = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    expected = 2 * layers * 2048 + 4 * 32 * 4096 * 2048 * 2048
    assert ckpt.hardware_flops - plain.hardware_flops == pytest.approx(expected, rel=0.01)
    assert math.isclose(plain.hardware_flops, plain.model_flops)
