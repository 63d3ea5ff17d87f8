"""Directions the memory and time model must respect on real (catalog) architectures.

Each test compares the estimator with itself under one change; the expected direction comes from
the mechanism named in the test (more tokens keep more activations, ZeRO partitions states, ...).
"""

from __future__ import annotations

import pytest

from estimator.api import estimate
from estimator.configs import load_spec
from estimator.memory import estimate_memory
from estimator.workload import Workload


@pytest.fixture(scope="module")
def l8b():
    return load_spec("llama-3.1-8b")


def mem(spec, **kw):
    if kw.get("method") == "qlora":
        kw.setdefault("quant", "nf4")
    return estimate_memory(Workload(model=spec, **kw).validate(), reserve_fraction=0.0, context_bytes=0)


def _strictly_increasing(xs):
    return all(a < b for a, b in zip(xs, xs[1:]))


def _strictly_decreasing(xs):
    return all(a > b for a, b in zip(xs, xs[1:]))


def _states(m):
    return m.weights_bytes + m.gradients_bytes + m.optimizer_states_bytes + m.master_weights_bytes


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_more_batch_more_memory(l8b, method):
    ms = [mem(l8b, method=method, batch=b, seq=512) for b in (1, 2, 4, 8)]
    assert _strictly_increasing([m.activations_bytes for m in ms])
    assert _strictly_increasing([m.logits_and_loss_bytes for m in ms])
    # The peak may stay flat while the optimizer step (gradients + temporaries) is the larger
    # phase (full fine-tune at batch 1-2: 16 GB of bf16 gradients vs 4 GB of activations), so
    # the peak is non-decreasing, and strictly larger once activations dominate.
    peaks = [m.peak_allocated_bytes for m in ms]
    assert all(a <= b for a, b in zip(peaks, peaks[1:]))
    assert peaks[-1] > peaks[0]


@pytest.mark.parametrize("attn", ["eager", "sdpa", "flash"])
def test_more_sequence_more_memory(l8b, attn):
    ms = [mem(l8b, method="lora", attn=attn, seq=s) for s in (256, 1024, 4096)]
    assert _strictly_increasing([m.activations_bytes for m in ms])
    assert _strictly_increasing([m.peak_allocated_bytes for m in ms])


def test_zero_stages_reduce_states_per_gpu(l8b):
    ms = [mem(l8b, zero=z, gpus=8) for z in (0, 1, 2, 3)]
    states = [_states(m) for m in ms]
    assert states[1] < states[0]                # ZeRO-1 partitions optimizer states (vs DDP replicas)
    assert _strictly_decreasing(states[1:])     # 1 > 2 > 3
    assert ms[2].gradients_bytes < ms[1].gradients_bytes   # stage 2 partitions gradients
    assert ms[3].weights_bytes < ms[2].weights_bytes       # stage 3 partitions weights
    assert ms[1].optimizer_states_bytes < ms[0].optimizer_states_bytes


def test_zero3_more_gpus_fewer_bytes_per_gpu(l8b):
    states = [_states(mem(l8b, zero=3, gpus=g)) for g in (2, 4, 8)]
    assert _strictly_decreasing(states)


def test_gradient_checkpointing_saves_activations(l8b):
    for method in ("full", "lora", "qlora"):
        plain = mem(l8b, method=method, batch=2, seq=2048)
        ckpt = mem(l8b, method=method, batch=2, seq=2048, grad_ckpt=True)
        assert ckpt.activations_bytes < plain.activations_bytes, method
        assert ckpt.peak_allocated_bytes <= plain.peak_allocated_bytes, method


def test_flash_and_sdpa_below_eager_at_long_sequence(l8b):
    eager = mem(l8b, method="lora", attn="eager", seq=4096).activations_bytes
    sdpa = mem(l8b, method="lora", attn="sdpa", seq=4096).activations_bytes
    flash = mem(l8b, method="lora", attn="flash", seq=4096).activations_bytes
    assert sdpa < eager and flash < eager
    # eager keeps B x heads x T x T scores: the gap grows faster than linearly in T
    gap_2k = mem(l8b, method="lora", attn="eager", seq=2048).activations_bytes - \
        mem(l8b, method="lora", attn="sdpa", seq=2048).activations_bytes
    assert eager - sdpa > 3 * gap_2k


def test_lora_trains_fewer_params_than_full(l8b):
    full, lora = mem(l8b), mem(l8b, method="lora")
    assert lora.gradients_bytes < full.gradients_bytes
    assert lora.optimizer_states_bytes < full.optimizer_states_bytes
    e_full = estimate(Workload(model=l8b).validate(), "h100-80gb", "none").to_dict()
    e_lora = estimate(Workload(model=l8b, method="lora").validate(), "h100-80gb", "none").to_dict()
    assert 0 < e_lora["model"]["params_trainable"] < e_full["model"]["params_trainable"]
    assert e_full["model"]["params_trainable"] == e_full["model"]["params_total"]


def test_more_lora_targets_and_rank_more_adapters(l8b):
    base = mem(l8b, method="lora").gradients_bytes
    assert mem(l8b, method="lora", lora_rank=64).gradients_bytes == 4 * base  # linear in r
    more = mem(l8b, method="lora", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")).gradients_bytes
    assert more > base


@pytest.mark.parametrize("method", ["lora", "qlora"])
@pytest.mark.parametrize("order", [(16, 64, 256), (256, 64, 16)])
def test_higher_lora_rank_more_activations(l8b, method, order):
    """Each lora_B saves lora_A's rank-wide output for its backward, so saved activations grow
    with the rank, and by the same bytes per rank step whichever rank the process saw first
    (an activation cache keyed without the rank once answered from the first rank it saw)."""
    kw = dict(method=method, batch=4, seq=1024, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    acts = {r: mem(l8b, lora_rank=r, **kw).activations_bytes for r in order}
    assert acts[16] < acts[64] < acts[256]
    # linear in the rank: the 64 -> 256 step is 4 times the 16 -> 64 step
    assert acts[256] - acts[64] == 4 * (acts[64] - acts[16])
    ckpt = {r: mem(l8b, lora_rank=r, grad_ckpt=True, **kw).activations_bytes for r in order}
    assert ckpt[16] < ckpt[256]   # the layer the backward recomputes holds the adapters' outputs too


def test_qlora_weights_below_lora_weights(l8b):
    lora = mem(l8b, method="lora")
    qlora = mem(l8b, method="qlora", quant="nf4")
    int8 = mem(l8b, method="lora", quant="int8")
    assert qlora.weights_bytes < int8.weights_bytes < lora.weights_bytes
    assert qlora.peak_allocated_bytes < lora.peak_allocated_bytes
    # double quantization saves (4/64 - 1/64 - 4/16384) B per quantized param
    assert mem(l8b, method="qlora", quant="nf4", double_quant=False).weights_bytes > qlora.weights_bytes


def l8b_params(spec):
    # Llama-3.1-8B has 8,030,261,248 parameters (transformers 5.23 count, shared/param_counts.csv)
    assert spec.vocab_size == 128256 and spec.num_layers == 32
    return 8_030_261_248


def test_optimizer_offload_moves_states_to_host(l8b):
    on_gpu = mem(l8b, zero=2, gpus=8)
    off = mem(l8b, zero=2, gpus=8, offload="optimizer")
    assert on_gpu.host_bytes == 0
    assert off.host_bytes > 0
    assert off.optimizer_states_bytes == 0 and off.master_weights_bytes == 0
    assert _states(off) < _states(on_gpu)
    # bytes are moved, not lost: what left the GPU is on the host, plus DeepSpeed's host staging
    # buffers (stage_1_and_2.py): a bf16 copy of the partition (2 B x 8,030,261,248 / 8 ranks) and
    # a bf16 buffer of the largest parameter (the 128256 x 4096 embedding, 2 B each)
    staging = 2 * 8_030_261_248 / 8 + 2 * 128256 * 4096
    assert off.host_bytes - (_states(on_gpu) - _states(off)) == pytest.approx(staging, abs=8)
    assert off.peak_allocated_bytes < on_gpu.peak_allocated_bytes


def test_param_offload_moves_weights_too(l8b):
    opt_only = mem(l8b, zero=3, gpus=8, offload="optimizer")
    params = mem(l8b, zero=3, gpus=8, offload="optimizer+params")
    assert params.weights_bytes == 0 < opt_only.weights_bytes
    assert params.host_bytes == pytest.approx(opt_only.host_bytes + opt_only.weights_bytes, abs=8)


def test_inference_kv_cache_grows_with_new_tokens(l8b):
    ms = [mem(l8b, method="inference", batch=4, seq=1024, new_tokens=n) for n in (0, 128, 1024, 4096)]
    assert _strictly_increasing([m.kv_cache_bytes for m in ms])
    # the peak never shrinks; a few new tokens stay under the prefill's working set (which sits beside
    # the prompt's cache only), many set the peak in the decode
    peaks = [m.peak_allocated_bytes for m in ms]
    assert all(a <= b for a, b in zip(peaks, peaks[1:])) and peaks[1] < peaks[2] < peaks[3]
    assert ms[0].peak_phase == "prefill" and ms[3].peak_phase == "decode"
    # the cache is linear in cached tokens: 1024+4096 tokens vs 1024+0
    assert ms[3].kv_cache_bytes == 5 * ms[0].kv_cache_bytes


def test_inference_batch_grows_kv(l8b):
    kv = [mem(l8b, method="inference", batch=b, seq=512, new_tokens=256).kv_cache_bytes for b in (1, 2, 8)]
    assert kv[1] == 2 * kv[0] and kv[2] == 8 * kv[0]


def _tps(spec, n, **kw):
    w = Workload(model=spec, zero=3, gpus=min(n, 8), nodes=max(1, n // 8), **kw).validate()
    return estimate(w, "h100-80gb", "none").time.tokens_per_s


def test_zero3_more_gpus_more_global_throughput(l8b):
    # compute-dominated step (4 x 4096 tokens per GPU): global tokens/s grows with every doubling
    tps = [_tps(l8b, n, batch=4, seq=4096, grad_ckpt=True) for n in (1, 2, 4, 8, 16, 32, 64)]
    assert _strictly_increasing(tps)


def test_zero3_more_gpus_within_a_node_and_across_nodes(l8b):
    # small micro-batch: still grows inside one NVLink node and inside the multi-node regime
    inside = [_tps(l8b, n) for n in (1, 2, 4, 8)]
    across = [_tps(l8b, n) for n in (16, 32, 64)]
    assert _strictly_increasing(inside)
    assert _strictly_increasing(across)


def test_mixed_precision_amp_costs_more_than_pure_bf16(l8b):
    assert _states(mem(l8b, precision="amp-bf16")) == 2 * _states(mem(l8b, precision="bf16"))


def test_moe_weights_count_all_experts():
    mixtral = load_spec("mixtral-8x7b")
    m = mem(mixtral, method="inference")
    e = estimate(Workload(model=mixtral, method="inference").validate(), "h100-80gb", "none").to_dict()
    # memory holds every expert (total params), compute uses the active ones
    assert m.weights_bytes == 2 * e["model"]["params_total"]
    assert e["model"]["params_active"] < 0.4 * e["model"]["params_total"]
