"""The step-time mechanisms of issue 11, each against values worked out by hand from the
constants in estimator/data (time_constants.csv, mfu.csv, gpus.csv, interconnects.csv)."""

import pytest

from estimator.api import estimate
from estimator.configs import load_spec
from estimator.errors import InputError
from estimator.params import count_params
from estimator.workload import Workload

A100_BW = 2039e9          # gpus.csv a100-80gb, bytes/s
H100_BW = 3350e9
HOST_PER_LAYER = 0.0006   # time_constants.csv decode_host_s_per_layer_eager
ATTENTION_FRACTION = 0.063  # time_constants.csv decode_attention_bandwidth_fraction_eager
LLAMA8B_PARAMS = 8_030_261_248
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2   # K and V x layers x kv heads x head dim x bf16 = 128 KiB


@pytest.fixture(scope="module")
def llama():
    return load_spec("llama-3.1-8b")


def _decode(w, gpu="a100-80gb"):
    return estimate(w, gpu, "none").time


def test_eager_decode_floor_is_layers_times_host_time(llama):
    t = _decode(Workload(llama, method="inference", seq=512, new_tokens=256))
    assert t.decode_floor_s_per_token == pytest.approx(32 * HOST_PER_LAYER)          # 19.2 ms
    small = load_spec("qwen3-0.6b")   # 28 layers: a smaller model has a lower floor, by its layers
    ts = _decode(Workload(small, method="inference", seq=512, new_tokens=256))
    assert ts.decode_floor_s_per_token == pytest.approx(28 * HOST_PER_LAYER)
    assert ts.decode_s_per_token >= 28 * HOST_PER_LAYER


def test_compiled_decode_is_bandwidth_bound_and_faster_than_eager(llama):
    eager = _decode(Workload(llama, method="inference", seq=512, new_tokens=256))
    compiled = _decode(Workload(llama, method="inference", seq=512, new_tokens=256, compiled=True))
    moved = LLAMA8B_PARAMS * 2 + KV_PER_TOKEN * (512 + 128)     # weights + mean cache
    assert compiled.decode_s_per_token == pytest.approx(moved / (A100_BW * 0.7), rel=1e-3)  # 11.3 ms
    assert compiled.decode_floor_s_per_token == 0.0
    # eager: the GPU's work (the same streaming plus the attention over 640 cached tokens, ~0.5 ms)
    # runs while the host issues the step: the 32-layer host floor (19.2 ms) sets the step
    attention = 2 * 32 * 4096 * 2 * 640 / (A100_BW * ATTENTION_FRACTION)
    assert compiled.decode_s_per_token + attention < 32 * HOST_PER_LAYER
    assert eager.decode_s_per_token == pytest.approx(32 * HOST_PER_LAYER)


def test_eager_long_context_decode_grows_faster_than_kv_bytes(llama):
    short = _decode(Workload(llama, method="inference", seq=8192, new_tokens=2))
    long = _decode(Workload(llama, method="inference", seq=131072, new_tokens=2))
    # K and V expanded to the 32 query heads, over ~6 % of bandwidth (time_constants.csv)
    extra = 2 * 32 * 4096 * 2 * (131073 - 8193) / (A100_BW * ATTENTION_FRACTION)
    kv_only = KV_PER_TOKEN * (131073 - 8193) / (A100_BW * 0.7)
    growth = long.decode_s_per_token - short.decode_s_per_token
    assert growth == pytest.approx(kv_only + extra, rel=0.05)
    assert growth > 5 * kv_only
    # past the floor the step is the GPU's: streaming plus attention, the host floor hidden under them
    streaming = (LLAMA8B_PARAMS * 2 + KV_PER_TOKEN * 8193) / (A100_BW * 0.7)
    attention = 2 * 32 * 4096 * 2 * 8193 / (A100_BW * ATTENTION_FRACTION)
    assert short.decode_s_per_token == pytest.approx(streaming + attention, rel=0.01)


def test_bitsandbytes_4bit_and_int8_decode_slower_than_bf16_at_batch_1(llama):
    base = _decode(Workload(llama, method="inference", seq=512, new_tokens=64)).decode_s_per_token
    nf4 = _decode(Workload(llama, method="inference", seq=512, new_tokens=64, quant="nf4")).decode_s_per_token
    int8 = _decode(Workload(llama, method="inference", seq=512, new_tokens=64, quant="int8")).decode_s_per_token
    assert nf4 == pytest.approx(1.33 * base)     # bitsandbytes issue 611
    assert int8 == pytest.approx(5.0 * base)     # bitsandbytes issue 490


def test_tensor_parallel_decode_adds_two_allreduces_per_layer(llama):
    one = _decode(Workload(llama, method="inference", seq=5, new_tokens=200, compiled=True))
    eight = _decode(Workload(llama, method="inference", seq=5, new_tokens=200, compiled=True, gpus=8, tp=8))
    streamed = one.decode_s_per_token / 8        # bandwidth-bound: an eighth of the bytes each
    assert eight.decode_s_per_token == pytest.approx(streamed + 2 * 32 * 25e-6, rel=0.02)


def test_inference_throughput_includes_the_prefill(llama):
    t = _decode(Workload(llama, method="inference", batch=2, seq=4096, new_tokens=100, compiled=True))
    assert t.tokens_per_s == pytest.approx(200 / (t.prefill_s + 100 * t.decode_s_per_token))
    assert t.decode_tokens_per_s == pytest.approx(2 / t.decode_s_per_token)
    assert t.tokens_per_s < t.decode_tokens_per_s


def test_recompute_is_charged_once(llama):
    plain = estimate(Workload(llama, batch=2, seq=2048), "h100-80gb", "none")
    ckpt = estimate(Workload(llama, batch=2, seq=2048, grad_ckpt=True), "h100-80gb", "none")
    peak, hfu, tokens = 989.4e12, 0.803, 2 * 2048   # mfu.csv gemm,h100-80gb: MAMF 794.5 / 989
    ridge = peak * hfu / (H100_BW * 0.7)              # 339 FLOP/B
    assert 4096 / 3 > ridge     # GEMM 4096 x 4096 x 4096: intensity 4096/3, math-bound (no penalty)
    slow = 1.0
    layers = LLAMA8B_PARAMS - 2 * 128256 * 4096 - 65 * 4096   # embedding, lm_head and the 65 norms out
    head = 128256 * 4096
    # hand: 3 passes (forward, input and weight gradients) of the layers, plus a recomputed forward
    gemm_plain = 6 * layers * tokens * slow / (peak * hfu)
    # the lm_head's 4096 x 4096 x 128256 GEMM is math-bound too
    assert 2 * 4096 * 4096 * 128256 / (2 * (4096 * 4096 + 4096 * 128256 + 4096 * 128256)) > ridge
    assert plain.time.compute_parts["gemm_s"] == pytest.approx(gemm_plain + 6 * head * tokens / (peak * hfu),
                                                               rel=1e-6)
    assert (ckpt.time.compute_parts["gemm_s"] - plain.time.compute_parts["gemm_s"]
            == pytest.approx(gemm_plain / 3, rel=1e-6))
    # the reported MFU is on model FLOPs: the same FLOPs, a longer step
    assert ckpt.time.model_flops_per_step == plain.time.model_flops_per_step
    assert ckpt.time.mfu < plain.time.mfu


def test_small_gemms_reach_a_lower_fraction_of_peak():
    from estimator.compute_time import gemm_slowdown
    ridge = 989.4e12 * 0.4 / (H100_BW * 0.7)                  # 168.8 FLOP/B on H100 at these fractions
    # a large GEMM is math-bound: intensity 4096 / 3 = 1365 FLOP/B > ridge, no penalty
    assert gemm_slowdown(4096, 4096, 4096, 2, 989.4e12, 0.4, H100_BW * 0.7) == 1.0
    # 512 tokens through a 1024-wide layer: intensity 2*512*1024*1024 / (2*(512*1024*2 + 1024*1024)) = 256
    assert gemm_slowdown(512, 1024, 1024, 2, 989.4e12, 0.4, H100_BW * 0.7) == 1.0
    # 64 tokens through a 4096-wide layer: 2*64*4096**2 / (2*(2*64*4096 + 4096**2)) = 62.06 FLOP/B:
    # memory-bound, the weight's read takes ridge / intensity times its math time
    small = gemm_slowdown(64, 4096, 4096, 2, 989.4e12, 0.4, H100_BW * 0.7)
    assert small == pytest.approx(ridge / (64 * 4096 ** 2 / (2 * 64 * 4096 + 4096 ** 2)))
    assert 2.7 < small < 2.75


def test_causal_attention_runs_half_the_scores_at_the_flash_fraction(llama):
    # inference prefill: one forward pass; training: FlashAttention's convention, bwd 2.5 x fwd
    # (benchmark_flash_attention.py `flops`), the one its 50-73 % of peak is stated in
    fwd = 2 * (4096 + 4096) * 8192 * 32 * 8192               # non-causal count of flops.py
    t = estimate(Workload(llama, batch=1, seq=8192), "a100-80gb", "none").time
    assert t.compute_parts["attention_s"] == pytest.approx(0.5 * fwd * 3.5 / (312e12 * 0.5))   # FA2 paper: 0.5
    h = estimate(Workload(llama, batch=1, seq=8192), "h100-80gb", "none").time
    assert h.compute_parts["attention_s"] == pytest.approx(0.5 * fwd * 3.5 / (989.4e12 * 0.35))  # FA3 paper: 0.35
    ckpt = estimate(Workload(llama, batch=1, seq=8192, grad_ckpt=True), "a100-80gb", "none").time
    assert ckpt.compute_parts["attention_s"] == pytest.approx(0.5 * fwd * 4.5 / (312e12 * 0.5))
    prefill = estimate(Workload(llama, method="inference", batch=1, seq=8192), "a100-80gb", "none").time
    assert prefill.compute_parts["attention_s"] == pytest.approx(0.5 * fwd / (312e12 * 0.5))
    # eager: the backward is two matmuls per forward matmul (the probabilities are saved)
    eager = estimate(Workload(llama, batch=1, seq=8192, attn="eager"), "a100-80gb", "none").time
    scores = 32 * 8192 * 8192 * 32                           # heads x s x s x layers
    assert eager.compute_parts["attention_s"] == pytest.approx(
        fwd * 3 / (312e12 * 0.869) + scores * 26 * 3 / (A100_BW * 0.7))   # gemm,a100-80gb


def test_padding_mask_sends_sdpa_to_the_memory_efficient_kernel(llama):
    # a padded batch with its attention mask: SDPA gets a 4D mask, the memory-efficient kernel runs
    # every query x key block (no causal half) at its own fraction (0.26 on A100, time_constants.csv),
    # and reads the bf16 mask for each of the 32 heads in the forward and the backward, after
    # converting the boolean mask (1 byte read, 2 written) in the forward
    t = estimate(Workload(llama, method="full", batch=1, seq=8192, padding_mask=True), "a100-80gb", "none").time
    fwd = 2 * (4096 + 4096) * 8192 * 32 * 8192               # every key of every layer, 1 x 8192 queries
    mask = 32 * 8192 * 8192 * (2 * 32 * 2 + 3)               # layers x s x s x (reads x heads x a + convert)
    assert t.compute_parts["attention_s"] == pytest.approx(fwd * 3.5 / (312e12 * 0.26) + mask / (A100_BW * 0.7))
    # the GEMMs and everything else do not move
    plain = estimate(Workload(llama, method="full", batch=1, seq=8192), "a100-80gb", "none").time
    assert t.compute_parts["gemm_s"] == plain.compute_parts["gemm_s"]
    # on Hopper the sm80 kernel loses what FlashAttention-2's sm80 code loses, best against best:
    # 0.26 x 0.35 (FA3 paper: FA2 on H100) / 0.73 (FA2 paper: its best on A100)
    h = estimate(Workload(llama, method="full", batch=1, seq=8192, padding_mask=True), "h100-80gb", "none").time
    assert h.compute_parts["attention_s"] == pytest.approx(
        fwd * 3.5 / (989.4e12 * 0.26 * 0.35 / 0.73) + mask / (H100_BW * 0.7))
    # checkpointing: one more forward (kernel read and conversion)
    c = estimate(Workload(llama, method="full", batch=1, seq=8192, padding_mask=True, grad_ckpt=True),
                 "a100-80gb", "none").time
    mask_ckpt = 32 * 8192 * 8192 * (3 * 32 * 2 + 2 * 3)
    assert c.compute_parts["attention_s"] == pytest.approx(fwd * 4.5 / (312e12 * 0.26) + mask_ckpt / (A100_BW * 0.7))


def test_padding_mask_fills_the_sliding_window():
    # phi-3-mini: 32 layers, all with a 2047-token window; 32 heads of 96 (q_dim = o_dim = 3072). With
    # the mask the window is in the mask only: every layer computes all 4096 keys of a 4096-token
    # sample, in the memory-efficient kernel's 128-wide tiles (kMaxK 128: 96 computed as 128)
    phi = load_spec("phi-3-mini")
    t = estimate(Workload(phi, method="full", batch=1, seq=4096, padding_mask=True), "a100-80gb", "none").time
    fwd = 2 * 32 * (128 + 128) * 32 * 4096 * 4096
    mask = 32 * 4096 * 4096 * (2 * 32 * 2 + 3)
    assert t.compute_parts["attention_s"] == pytest.approx(fwd * 3.5 / (312e12 * 0.26) + mask / (A100_BW * 0.7))


def test_sdpa_on_sliding_layers_past_the_window_computes_every_key():
    # keys reaching the window: transformers hands SDPA the 4D sliding mask, so the memory-efficient
    # kernel computes all keys (no window, no causal half); FlashAttention takes the window itself
    # (phi-3's head dim 96 is a FlashAttention-2 size; the memory-efficient kernel computes 128)
    phi = load_spec("phi-3-mini")   # 32 sliding layers, window 2047, q_dim = o_dim = 3072
    sdpa = estimate(Workload(phi, method="full", batch=1, seq=4096), "a100-80gb", "none").time
    mask = 32 * 4096 * 4096 * (2 * 32 * 2 + 3)
    assert sdpa.compute_parts["attention_s"] == pytest.approx(
        2 * 32 * 256 * (32 * 4096) * 4096 * 3.5 / (312e12 * 0.26) + mask / (A100_BW * 0.7))
    flash = estimate(Workload(phi, method="full", batch=1, seq=4096, attn="flash"), "a100-80gb", "none").time
    assert flash.compute_parts["attention_s"] == pytest.approx(
        2 * 6144 * (0.5 * 32 * 2047) * 4096 * 3.5 / (312e12 * 0.5))
    # below the window the mask is skipped (is_causal): half of the keys, FlashAttention-2
    short = estimate(Workload(phi, method="full", batch=1, seq=1024), "a100-80gb", "none").time
    assert short.compute_parts["attention_s"] == pytest.approx(
        2 * 6144 * (0.5 * 32 * 1024) * 1024 * 3.5 / (312e12 * 0.5))
    # gemma-3-1b: 4 global layers (causal half, FlashAttention-2) and 22 sliding ones (window 512,
    # masked: memory-efficient, every key) at 8192 tokens; 4 heads x 256 (Gemma-2 has no SDPA)
    gemma = load_spec("gemma-3-1b")
    g = estimate(Workload(gemma, method="lora", batch=1, seq=8192), "a100-80gb", "none").time
    mask = 22 * 8192 * 8192 * (2 * 4 * 2 + 3)
    assert g.compute_parts["attention_s"] == pytest.approx(
        2 * 2048 * 8192 * 3.5 * (0.5 * 4 * 8192 / (312e12 * 0.5) + 22 * 8192 / (312e12 * 0.26))
        + mask / (A100_BW * 0.7))


def test_fused_kernels_compute_with_their_padded_head_dims():
    from estimator.compute_time import flash_head_dim, mem_efficient_head_dim
    # FlashAttention-2: multiples of 32 up to 192, then 256 (flash_api.cpp head_size_rounded)
    assert [flash_head_dim(d) for d in (64, 80, 96, 128, 200, 256)] == [64, 96, 96, 128, 256, 256]
    # memory-efficient: 64- or 128-wide tiles (kMaxK), iterating past 128
    assert [mem_efficient_head_dim(d) for d in (16, 64, 80, 96, 128, 256)] == [64, 64, 128, 128, 128, 256]


def test_eager_attention_computes_the_whole_matrix_on_sliding_layers_and_soft_caps_gemma2():
    # gemma-2-9b: 42 layers (21 sliding, window 4096), 16 heads x 256 (q_dim = o_dim = 4096); eager
    # multiplies the whole 8192 x 8192 matrix on every layer and soft-caps it (/ cap, tanh, x cap:
    # +6a bytes per element on the 9a + 8 of the plain chain)
    g2 = load_spec("gemma-2-9b")
    t = estimate(Workload(g2, method="full", batch=1, seq=8192, attn="eager"), "a100-80gb", "none").time
    fwd = 2 * (4096 + 4096) * 42 * 8192 * 8192
    scores = 16 * 8192 * 8192 * 42
    assert t.compute_parts["attention_s"] == pytest.approx(
        fwd * 3 / (312e12 * 0.869) + scores * (26 + 12) * 3 / (A100_BW * 0.7))


@pytest.mark.parametrize("kw", [dict(method="inference"), dict(method="full", attn="flash")])
def test_padding_mask_refused_where_it_does_not_apply(llama, kw):
    with pytest.raises(InputError):
        Workload(llama, padding_mask=True, **kw).validate()


def test_elementwise_bytes_counted_from_the_decoder_layer(llama):
    from estimator.compute_time import layer_elementwise_bytes, loss_bytes_per_token
    # 2 RMSNorms x 36 B + 2 residual adds x 6 B per hidden element, rotary 20 B per q/k element,
    # SwiGLU 10 B per intermediate element, attention output transpose 4 B per q element
    hand = 2 * 36 * 4096 + 12 * 4096 + 20 * (4096 + 1024) + 10 * 14336 + 4 * 4096
    assert layer_elementwise_bytes(llama, 2, False) == hand == 606208
    assert layer_elementwise_bytes(llama, 2, True) == 2 * 4 * 4096 + 12 * 4096 + 4 * 5120 + 6 * 14336 + 4 * 4096
    assert loss_bytes_per_token(llama, 2, False) == 128256 * 28 and loss_bytes_per_token(llama, 2, True) == 0
    t = estimate(Workload(llama, batch=1, seq=1024), "a100-80gb", "none").time
    assert t.compute_parts["elementwise_s"] == pytest.approx(
        (hand * 32 * 3 + 128256 * 28) * 1024 / (A100_BW * 0.7))


def test_lora_adapters_stream_their_activations(llama):
    from estimator.compute_time import adapter_backward_bytes_per_token, adapter_bytes_per_token
    w = Workload(llama, method="lora", lora_rank=16, lora_targets=("q_proj", "v_proj"), batch=1, seq=1024)
    # fp32 adapters on a bf16 model: cast in 6 B + read 4 B per input element; out: write 4, scale 8,
    # add 2 + 4 + 4, cast back 6 = 28 B per output element; q 4096 -> 4096, v 4096 -> 1024; 32 layers
    per_layer = (10 * 4096 + 28 * 4096) + (10 * 4096 + 28 * 1024)
    assert adapter_bytes_per_token(w) == 32 * per_layer
    # backward, formula by formula: per input element lora_A's input gradient written (4) and its
    # saved input read by the weight gradient (4), the cast back to bf16 (6), the sum with the base
    # layer's input gradient (2 + 2 read, 2 written); per output element the cast to fp32 (6), the
    # scaling's gradient (4 + 4) and lora_B's two gradient GEMMs reading it (4 + 4)
    back_layer = (20 * 4096 + 22 * 4096) + (20 * 4096 + 22 * 1024)
    assert adapter_backward_bytes_per_token(w) == 32 * back_layer
    t = estimate(w, "a100-80gb", "none").time
    assert t.compute_parts["adapter_s"] == pytest.approx(32 * (per_layer + back_layer) * 1024 / (A100_BW * 0.7))
    ckpt = estimate(Workload(llama, method="lora", lora_rank=16, lora_targets=("q_proj", "v_proj"), batch=1,
                             seq=1024, grad_ckpt=True), "a100-80gb", "none").time
    assert ckpt.compute_parts["adapter_s"] == pytest.approx(32 * (2 * per_layer + back_layer) * 1024
                                                            / (A100_BW * 0.7))


def test_qlora_dequantizes_on_every_use(llama):
    from estimator.compute_time import dequant_uses
    w = Workload(llama, method="qlora", quant="nf4", batch=1, seq=512, grad_ckpt=True)
    p = count_params(llama)
    per_use = p.linear_weights * (0.5 + 1 / 64 + 2)           # packed + absmax read, bf16 copy written
    t = estimate(w, "a100-80gb", "none").time
    assert dequant_uses(w, True) == 3                          # forward, recompute, backward
    assert t.compute_parts["dequant_s"] == pytest.approx(3 * per_use / (A100_BW * 0.7))
    lora = estimate(w.with_(method="lora", quant="none"), "a100-80gb", "none").time
    # QLoRA's kernels take longer than LoRA's; at 1 x 512 both steps wait on the host's dispatch
    # (the launch floor: QLoRA dispatches what LoRA does, estimator.ops), at 1 x 4096 on the kernels
    assert sum(t.compute_parts.values()) > sum(lora.compute_parts.values())
    assert t.launch_bound and lora.launch_bound and t.compute_s == lora.compute_s
    long_q = estimate(w.with_(seq=4096), "a100-80gb", "none").time
    long_l = estimate(w.with_(method="lora", quant="none", seq=4096), "a100-80gb", "none").time
    assert not long_q.launch_bound and long_q.compute_s > long_l.compute_s


def test_cpu_offload_pays_pcie_and_host_adam(llama):
    w = Workload(llama, gpus=2, zero=2, offload="optimizer", batch=1, seq=1024)
    local = count_params(llama).total / 2
    # gradients down and bf16 weights up over the H100 SXM5's PCIe Gen5 x16 (64 GB/s per direction,
    # its datasheet), Adam at 32 B/param over 50 GB/s
    hand = 2 * local / 64e9 + local * 32 / 50e9 + 2 * local / 64e9
    assert estimate(w, "h100-80gb", "none").time.optimizer_s == pytest.approx(hand)


def test_parameter_offload_on_one_gpu_copies_the_weights_in_per_gather(llama):
    # ZeRO-3 with parameters on the host, one GPU: no collective, but every gather (forward and
    # backward, each micro-batch) copies the whole bf16 model over the H100 SXM5's PCIe Gen5 x16
    # (64 GB/s per direction)
    w = Workload(llama, zero=3, offload="optimizer+params", batch=1, seq=1024, grad_accum=2)
    t = estimate(w, "h100-80gb", "none").time
    hand = 2 * 2 * (2 * count_params(llama).total) / 64e9
    assert t.comm_s == pytest.approx(hand, rel=1e-6)
    assert t.exposed_comm_s + 1e-9 >= t.comm_s - t.compute_s > 0      # longer than the compute it hides behind
    assert estimate(w.with_(offload="optimizer"), "h100-80gb", "none").time.comm_s == 0.0


def test_hybrid_shard_keeps_gathers_inside_the_node(llama):
    full = Workload(llama, fsdp="full", gpus=8, nodes=2, batch=1, seq=2048)
    hybrid = full.with_(fsdp="hybrid")
    tf = estimate(full, "h100-80gb", "none").time
    th = estimate(hybrid, "h100-80gb", "none").time
    assert th.comm_s < tf.comm_s / 5
    # hand: gathers (2 x 7/8 x bf16 weights) and one reduce-scatter of the gradients on NVLink 450 GB/s,
    # plus the gradient shard's all-reduce between the 2 replicas over ib-hdr (25 GB/s)
    p = count_params(llama).total
    grad = 2 * p
    hand = (2 * 7 / 8 * 2 * p + 7 / 8 * grad) / 450e9 + 3 * 2 * 7 * 2e-6 + 2 * 0.5 * grad / 8 / 25e9 + 2 * 5e-6
    assert th.comm_s == pytest.approx(hand, rel=0.02)


def test_optimizer_step_streams_the_states(llama):
    t = estimate(Workload(llama, batch=1, seq=512), "h100-80gb", "none").time
    p = count_params(llama).total
    # pure bf16 AdamW: weights 2 B (read + write), gradients 2 B (read), two bf16 moments 4 B (read + write)
    assert t.optimizer_s == pytest.approx((2 * 2 * p + 2 * p + 2 * 4 * p) / (H100_BW * 0.7), rel=1e-6)
    assert t.overhead_s == pytest.approx(0.02)
    # the HF Trainer's clipping (max_grad_norm 1.0): the norm reads the bf16 gradients, the scaling
    # reads and writes them, at the optimizer step's bandwidth
    assert t.clip_s == pytest.approx(3 * 2 * p / (H100_BW * 0.7), rel=1e-6)
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_comm_s + t.optimizer_s + t.clip_s + t.overhead_s)
    off = estimate(Workload(llama, batch=1, seq=512, zero=2, offload="optimizer"), "h100-80gb", "none").time
    assert off.clip_s == 0.0     # offloaded: clipped on the host with the optimizer step


def test_exposed_comm_is_hidden_when_compute_covers_it(llama):
    t = estimate(Workload(llama, method="lora", gpus=8, zero=3, batch=4, seq=2048), "h100-80gb", "none").time
    assert 0 < t.exposed_comm_s < t.comm_s
    assert t.exposed_comm_s == pytest.approx(t.comm_s * 2 / 32)   # only the first and last layers' traffic
    assert not t.comm_bound


def test_seventy_b_zero3_on_two_nodes_is_communication_bound():
    w = Workload(load_spec("llama-3.1-70b"), zero=3, gpus=8, nodes=2, batch=1, seq=4096, grad_ckpt=True)
    t = estimate(w, "h200-141gb", "none").time
    p = count_params(w.model).total
    ring = 15 / 16
    hand = (2 * ring * 2 * p + ring * 2 * p) / 25e9     # gathers twice + reduce-scatter, ib-hdr 25 GB/s
    assert t.comm_s == pytest.approx(hand, rel=1e-3)                 # the 15.9 s of the issue
    assert t.comm_bound and t.exposed_comm_s == pytest.approx(t.comm_s - t.compute_s, rel=1e-9)
    assert t.step_s < t.comm_s + t.compute_s                          # not both in full
    ndr = estimate(w, "h200-141gb", "none", inter_node="ib-ndr").time
    assert ndr.comm_s == pytest.approx(t.comm_s / 2, rel=1e-3)       # 50 GB/s: the inter-node link sets it
    one_node = estimate(w.with_(gpus=16, nodes=1), "h200-141gb", "none").time
    assert one_node.comm_s == pytest.approx(t.comm_s * 25e9 / 450e9, rel=1e-3)   # NVLink 450 GB/s


def test_zero3_gathers_every_micro_batch_and_ddp_reduces_once(llama):
    z3 = Workload(llama, method="lora", gpus=4, zero=3, batch=2, seq=1024)
    one = estimate(z3, "h100-80gb", "none").time.comm_s
    assert estimate(z3.with_(grad_accum=4), "h100-80gb", "none").time.comm_s == pytest.approx(4 * one)
    ddp = Workload(llama, method="lora", gpus=4, batch=2, seq=1024)
    d1 = estimate(ddp, "h100-80gb", "none").time.comm_s
    assert estimate(ddp.with_(grad_accum=4), "h100-80gb", "none").time.comm_s == pytest.approx(d1)
    # LoRA under ZeRO-3 gathers the frozen bf16 base: at least 2 x 3/4 x 16 GB over NVLink per micro-batch
    assert one >= 2 * 0.75 * 2 * LLAMA8B_PARAMS / 450e9
    assert one > 100 * d1


def test_compiled_applies_to_inference_only(llama):
    with pytest.raises(InputError, match="inference only"):
        Workload(llama, method="lora", compiled=True).validate()


def test_the_time_development_set_scores_every_row_with_a_gpu_row():
    """scripts/bench_time.py leaves out only rows marked skip: the Qwen3 H20 rows are scored now that
    gpus.csv has the H20 (README's time table)."""
    import csv
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_time", root / "scripts" / "bench_time.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with bench.DEV_SET.open(newline="") as f:
        rows = list(csv.DictReader(f))
    scored, skipped = bench.score(rows)
    assert all(why.startswith("skip:") for why in skipped), skipped
    assert len(scored) + sum(skipped.values()) == len(rows)
    qwen = [r for r in scored if r["source"] == "qwen3-speed-benchmark"]
    assert len(qwen) == 24 and {r["gpu"] for r in qwen} == {"h20-96gb"}


def test_bench_implied_hfu_gives_back_the_table_level_on_the_estimators_own_time(llama):
    """bench_time --rows: a row measuring exactly the estimate's time needs the HFU the estimate used
    (mfu.csv gemm rows: H100 0.803, A100 80GB 0.869 for prefill); a row faster than the non-GEMM parts
    alone needs more than any GEMM can give (inf)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_time", root / "scripts" / "bench_time.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    w = Workload(llama, method="full", batch=1, seq=4096, grad_accum=2, grad_ckpt=True).validate()
    est = estimate(w, "h100-80gb", "none")
    row = {"metric": "step_s", "value": str(est.time.step_s), "gpu_slug": "h100-80gb"}
    assert bench.implied_hfu(row, w, est) == pytest.approx(0.803)
    row["value"] = str(est.time.optimizer_s + est.time.overhead_s)     # no time left for any kernel
    assert bench.implied_hfu(row, w, est) == float("inf")
    p = Workload(llama, method="inference", seq=2048, new_tokens=1).validate()
    pest = estimate(p, "a100-80gb", "none")
    prow = {"metric": "prefill_s", "value": str(pest.time.prefill_s), "gpu_slug": "a100-80gb"}
    assert bench.implied_hfu(prow, p, pest) == pytest.approx(0.869)


def test_ddp_reduction_hides_only_in_the_last_backward(llama):
    # DDP under accumulation all-reduces once, in the last micro-batch's backward (no_sync before it):
    # the 8 micro-batches' compute does not hide it, only that backward (2/3 of a micro-batch: input
    # and weight gradients of the 3 GEMM passes). bf16 gradients of 8.03B parameters between 2 RTX
    # 4090s over PCIe 4.0 x16 (32 GB/s): 2 x 1/2 x 16.06 GB / 32e9 = 0.502 s plus one 5 us hop.
    w = Workload(llama, gpus=2, batch=1, seq=512, grad_accum=8)
    t = estimate(w, "rtx4090-24gb", "none").time
    total = 2 * 0.5 * 2 * LLAMA8B_PARAMS / 32e9 + 2 * 1 * 5e-6
    assert t.comm_s == pytest.approx(total, rel=1e-9)
    tail = total * 2 / 32                                  # comm_tail_layers of 32 layers
    micro_batch = t.compute_s / 8
    hand = max(0.0, (total - tail) - 2 / 3 * micro_batch) + tail
    assert t.exposed_comm_s == pytest.approx(hand, rel=1e-9)
    assert t.exposed_comm_s > tail          # the whole step's compute would have hidden all but the tail
    # checkpointing: the recomputed forward runs inside the backward, a wider window (3/4)
    c = estimate(w.with_(grad_ckpt=True), "rtx4090-24gb", "none").time
    assert c.exposed_comm_s == pytest.approx(max(0.0, (total - tail) - 3 / 4 * c.compute_s / 8) + tail, rel=1e-9)


def test_gathers_hide_behind_the_whole_step_and_reductions_behind_their_backward(llama):
    from estimator.timing import Comm
    comm = Comm(overlappable_s=3.0, tail_s=0.1, after_s=0.2, reduce_s=1.0, reduces=1)
    assert comm.exposed_s(compute_s=10.0, backward_s=0.4) == pytest.approx(0.6 + 0.1 + 0.2)
    assert comm.exposed_s(compute_s=2.0, backward_s=1.5) == pytest.approx(1.0 + 0.1 + 0.2)  # link-bound
    assert comm.exposed_s(compute_s=10.0) == pytest.approx(0.3)        # no window given: the whole compute
    four = Comm(overlappable_s=4.0, tail_s=0.0, after_s=0.0, reduce_s=1.0, reduces=4)    # DeepSpeed: each micro-batch
    assert four.exposed_s(compute_s=20.0, backward_s=0.75) == pytest.approx(4 * 0.25)


def test_activation_offloading_copies_show_where_compute_cannot_hide_them(monkeypatch):
    """TRL's offloading copies every offloaded save to the host in the forward and back in the
    backward (all but the loss's output, still in the forward stash) on a side stream: each direction
    hides behind its own pass's compute. Over a very fast host link nothing shows; over a very slow
    one the step grows by the copies less the compute; without offloading, by nothing."""
    from estimator import memory, tables, timing

    w = Workload(load_spec("llama-3.2-1b"), method="full", batch=2, seq=1024, activation_offload=True).validate()
    out, back = memory.activation_offload_copy_bytes(w)
    host = memory.estimate_memory(w, 0.0, 0).host_bytes
    assert out == pytest.approx(host, rel=1e-9) and 0 < back < out
    assert memory.activation_offload_copy_bytes(w.with_(activation_offload=False)) == (0.0, 0.0)
    plain = estimate(w.with_(activation_offload=False), "h100-80gb", "none").time
    assert plain.activation_offload_s == 0.0

    def link(bandwidth):
        return tables.Interconnect("test", bandwidth, 5e-6, "intra-node", "test", "2026-11-28")

    monkeypatch.setattr(timing, "host_link", lambda gpu: link(10**15))
    fast = estimate(w, "h100-80gb", "none").time
    assert fast.activation_offload_s == 0.0
    monkeypatch.setattr(timing, "host_link", lambda gpu: link(10**8))
    slow = estimate(w, "h100-80gb", "none").time
    assert slow.activation_offload_s == pytest.approx((out + back) / 1e8 - slow.microbatch_s, rel=1e-9)
    assert slow.step_s == pytest.approx(fast.step_s + slow.activation_offload_s, rel=1e-9)
