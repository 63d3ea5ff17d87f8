"""Exact byte counts of the memory model on tiny configs, every expected value worked out by hand
from the config numbers (never taken from the estimator).

Tiny Llama (tests/data/tiny-llama.json): vocab V=1000, hidden H=64, intermediate I=176, L=2 layers,
4 heads, 2 kv heads -> head_dim 16, q width 64, k/v width 32, untied lm_head.

    per layer  q 64x64=4096  k 64x32=2048  v 64x32=2048  o 64x64=4096      attention 12,288
               gate/up 64x176=11,264 each, down 176x64=11,264              MLP       33,792
               input + post-attention RMSNorm 2x64                         norms        128
    decoder linears 2 x (12,288 + 33,792) = 92,160;  norms 2 x 128 + final 64 = 320
    embedding 1000x64 = 64,000;  lm_head 64,000 (untied)
    N = 92,160 + 320 + 128,000 = 220,480  (transformers 5.23 on meta device gives 220,480)
    output rows of the decoder linears: per layer 64+32+32+64+176+176+64 = 608 -> 1,216
    largest single tensor: embedding / lm_head, 64,000 elements

Tiny GPT-2 (tests/data/tiny-gpt2.json): V=1000, n_embd 64, 2 layers, 4 heads, 128 positions, tied.
    wte 64,000; wpe 128x64 = 8,192
    per layer ln_1 128, c_attn 64x192+192 = 12,480, attn c_proj 64x64+64 = 4,160, ln_2 128,
              c_fc 64x256+256 = 16,640, mlp c_proj 256x64+64 = 16,448      -> 49,984
    ln_f 128;  N = 64,000 + 8,192 + 2 x 49,984 + 128 = 172,288  (transformers gives 172,288)
    linear weights 2 x (12,288 + 4,096 + 16,384 + 16,384) = 98,304; output rows 2 x 576 = 1,152
"""

from __future__ import annotations

import csv
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest

from estimator.errors import InputError

from estimator.memory import estimate_memory
from estimator.model import spec_from_config
from estimator.params import count_params
from estimator.workload import Workload

DATA = Path(__file__).with_name("data")
MiB = 2**20
GRANULE = 2 * MiB

# ---- tiny Llama, by hand -------------------------------------------------------------------
V, H, I, L = 1000, 64, 176, 2
Q_DIM, KV_DIM = 4 * 16, 2 * 16
ATTN_PER_LAYER = H * Q_DIM + 2 * H * KV_DIM + Q_DIM * H          # 12,288
MLP_PER_LAYER = 3 * H * I                                        # 33,792
LINEARS = L * (ATTN_PER_LAYER + MLP_PER_LAYER)                   # 92,160
NORMS = L * 2 * H + H                                            # 320
EMBED = V * H                                                    # 64,000
LM_HEAD = V * H                                                  # 64,000
N = LINEARS + NORMS + EMBED + LM_HEAD                            # 220,480
NON_LINEAR = N - LINEARS                                         # 128,320 (not quantized)
ROWS = L * (Q_DIM + KV_DIM + KV_DIM + H + I + I + H)             # 1,216 output rows
LARGEST = EMBED                                                  # 64,000 elements
# LoRA r=16 on q_proj, v_proj (peft default): r*(d_in+d_out) each
LORA_QV = L * (16 * (H + Q_DIM) + 16 * (H + KV_DIM))             # 2*(2048+1536) = 7,168


def test_hand_numbers_are_what_they_claim():
    # Guards the arithmetic above against a typo (the literals are the hand results).
    assert (ATTN_PER_LAYER, MLP_PER_LAYER, LINEARS, N, ROWS, LORA_QV) == (
        12288, 33792, 92160, 220480, 1216, 7168)


def _cfg(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.fixture(scope="module")
def llama():
    return spec_from_config(_cfg("tiny-llama.json"), "tiny")


@pytest.fixture(scope="module")
def gpt2():
    return spec_from_config(_cfg("tiny-gpt2.json"), "tiny-gpt2")


def mem(spec, **kw):
    return estimate_memory(Workload(model=spec, **kw).validate(), reserve_fraction=0.0, context_bytes=0)


def _overhead_csv(name: str) -> str:
    with (Path(__file__).resolve().parents[1] / "estimator" / "data" / "overheads.csv").open() as f:
        return {row["name"]: row["value"] for row in csv.DictReader(f)}[name]


# ---- parameter counts ----------------------------------------------------------------------

def test_tiny_llama_param_count(llama):
    p = count_params(llama)
    assert p.total == 220_480
    assert p.embedding == 64_000 and p.lm_head == 64_000
    assert p.linear_weights == 92_160
    assert p.norms == 320
    assert p.largest_layer == 64_000


def test_tiny_gpt2_param_count(gpt2):
    p = count_params(gpt2)
    assert p.total == 172_288
    assert p.lm_head == 0  # tied: counted once
    assert p.positions == 8_192
    assert p.linear_weights == 98_304
    assert p.linear_biases == 2 * (192 + 64 + 256 + 64)
    assert p.norms == 2 * 2 * 128 + 128


# ---- weights -------------------------------------------------------------------------------

@pytest.mark.parametrize("precision, nbytes", [("fp32", 4), ("bf16", 2), ("fp16", 2), ("amp-bf16", 4)])
def test_weights_bytes_by_dtype(llama, precision, nbytes):
    assert mem(llama, precision=precision).weights_bytes == nbytes * N


def test_inference_weights_bf16_and_gpt2_fp32(llama, gpt2):
    assert mem(llama, method="inference").weights_bytes == 2 * 220_480
    assert mem(gpt2, method="inference", precision="fp32").weights_bytes == 4 * 172_288


# ---- full fine-tune regimes (torch AdamW, no ZeRO) -----------------------------------------

def test_full_pure_bf16_fused_adamw(llama):
    m = mem(llama)  # defaults: full, bf16, adamw fused
    assert m.weights_bytes == 2 * N
    assert m.gradients_bytes == 2 * N
    assert m.optimizer_states_bytes == 4 * N      # exp_avg + exp_avg_sq in bf16
    assert m.master_weights_bytes == 0
    assert m.optimizer_temporaries_bytes == 0     # fused=True: no temporaries


def test_full_amp_bf16_16_bytes_per_param(llama):
    m = mem(llama, precision="amp-bf16")
    assert (m.weights_bytes, m.gradients_bytes, m.optimizer_states_bytes) == (4 * N, 4 * N, 8 * N)
    assert m.master_weights_bytes == 0
    # autocast caches a bf16 cast of every weight fed to a matmul (decoder linears and the
    # lm_head; the embedding is a lookup, norms are not cast): 2 B x (92,160 + 64,000)
    assert m.autocast_weight_cache_bytes == 2 * (LINEARS + LM_HEAD) == 312_320


def test_full_fp32(llama):
    m = mem(llama, precision="fp32", attn="sdpa")
    assert (m.weights_bytes, m.gradients_bytes, m.optimizer_states_bytes) == (4 * N, 4 * N, 8 * N)
    assert m.autocast_weight_cache_bytes == 0


def test_adamw_foreach_adds_one_copy_in_state_dtype(llama):
    assert mem(llama, adamw_impl="foreach").optimizer_temporaries_bytes == 2 * N
    assert mem(llama, adamw_impl="foreach", precision="fp32").optimizer_temporaries_bytes == 4 * N


def test_adamw_single_tensor_two_temporaries_of_largest_param(llama, gpt2):
    # 2 x 64,000 elements x 2 B (bf16 states)
    assert mem(llama, adamw_impl="single").optimizer_temporaries_bytes == 2 * LARGEST * 2 == 256_000
    # GPT-2: the tied wte (64,000) is the largest tensor; fp32 states
    assert mem(gpt2, adamw_impl="single", precision="fp32").optimizer_temporaries_bytes == 2 * 64_000 * 4


def test_sgd_momentum_state(llama):
    assert mem(llama, optimizer="sgd", precision="fp32").optimizer_states_bytes == 4 * N
    assert mem(llama, optimizer="sgd").optimizer_states_bytes == 2 * N
    assert mem(llama, optimizer="sgd").optimizer_temporaries_bytes == 0


def test_adamw_8bit_matches_bitsandbytes_state_layout(llama):
    """bitsandbytes 0.50.2 (the pinned version), optim/optimizer.py Optimizer2State.init_state:
    a parameter with fewer than min_8bit_size=4096 elements keeps two fp32 states (8 B/elem);
    a larger one keeps two uint8 states (2 B/elem) plus two fp32 absmax per block of
    `blocksize = 256` elements (8 B per started block).

    tiny Llama tensors:  q, o 4,096 -> 2*4096 + 8*16 = 8,320 each;  k, v 2,048 (< 4096) -> 16,384 each;
    gate/up/down 11,264 -> 22,528 + 8*44 = 22,880 each;  norms 64 -> 512 each (2 per layer)
    per layer 2*8,320 + 2*16,384 + 3*22,880 + 2*512 = 119,072;  x2 layers = 238,144
    embedding, lm_head 64,000 -> 128,000 + 8*250 = 130,000 each;  final norm 512
    total 238,144 + 260,000 + 512 = 498,656 B.
    """
    def bnb_bytes(n):
        return 8 * n if n < 4096 else 2 * n + 8 * math.ceil(n / 256)

    per_layer = [4096, 2048, 2048, 4096, 11264, 11264, 11264, 64, 64]
    tensors = per_layer * L + [EMBED, LM_HEAD, H]
    expected = sum(bnb_bytes(n) for n in tensors)
    assert expected == 498_656
    assert mem(llama, optimizer="adamw-8bit").optimizer_states_bytes == expected


# ---- LoRA ----------------------------------------------------------------------------------

def test_lora_default_targets_fp32_adapters(llama):
    m = mem(llama, method="lora")
    # frozen bf16 base (2 B x N) + fp32 adapters (4 B x 7,168)
    assert m.weights_bytes == 2 * N + 4 * LORA_QV == 469_632
    assert m.gradients_bytes == 4 * LORA_QV
    assert m.optimizer_states_bytes == 8 * LORA_QV
    assert m.master_weights_bytes == 0


def test_lora_all_linear_rank8(llama):
    # rank 8 on all seven projections: per layer 8*(128+96+96+128+3*240) = 8*1,168 = 9,344; x2
    adapters = L * 8 * ((H + Q_DIM) + 2 * (H + KV_DIM) + (Q_DIM + H) + 3 * (H + I))
    assert adapters == 18_688
    m = mem(llama, method="lora", lora_rank=8,
            lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    assert m.gradients_bytes == 4 * adapters
    assert m.optimizer_states_bytes == 8 * adapters


def test_lora_foreach_temporaries(llama):
    assert mem(llama, method="lora", adamw_impl="foreach").optimizer_temporaries_bytes == 4 * LORA_QV


def test_lora_single_tensor_temporaries_use_largest_trainable_adapter(llama):
    """The single-tensor AdamW loop makes two temporaries the size of the parameter it updates;
    only adapters are parameters of the optimizer. Targets q_proj, v_proj with r=16:
    q lora_A 16x64, lora_B 64x16; v lora_A 16x64, lora_B 32x16 -> largest 1,024 elements, fp32:
    2 x 1,024 x 4 = 8,192 B. (gate/up/down are not targeted, so their 16x176 shapes must not count.)"""
    assert mem(llama, method="lora", adamw_impl="single").optimizer_temporaries_bytes == 2 * 1024 * 4


# ---- quantized bases -------------------------------------------------------------------------

def _nf4(n, double_quant):
    # docs/design.md section 3 / QLoRA paper: 0.5 B per value + absmax per block of 64;
    # double quant: 8-bit absmax (1/64 B) + fp32 second-level absmax per 256 blocks.
    if double_quant:
        return Fraction(n, 2) + Fraction(n, 64) + Fraction(4 * n, 64 * 256)
    return Fraction(n, 2) + Fraction(4 * n, 64)


def test_qlora_nf4_double_quant_bf16(llama):
    # 92,160 x (1/2 + 1/64 + 4/16384) = 46,080 + 1,440 + 22.5; adapters fp32; the rest fp32 too:
    # peft's prepare_model_for_kbit_training casts every non-Params4bit fp16/bf16 parameter to
    # fp32 whatever the precision (the profiler's QLoRA recipe; traced by profiler.trace).
    # (Was 2 x NON_LINEAR: the bf16 load dtype, which the kbit preparation does not keep.)
    expected = _nf4(LINEARS, True) + 4 * NON_LINEAR + 4 * LORA_QV
    assert expected == Fraction(1_178_989, 2)  # 589,494.5
    got = mem(llama, method="qlora", quant="nf4").weights_bytes
    assert abs(got - expected) <= 1  # the breakdown holds whole bytes


def test_qlora_nf4_without_double_quant(llama):
    expected = _nf4(LINEARS, False) + 4 * NON_LINEAR + 4 * LORA_QV   # fp32 rest, as above
    assert expected == 593_792
    assert mem(llama, method="qlora", quant="nf4", double_quant=False).weights_bytes == expected


def test_qlora_amp_bf16_upcasts_non_quantized_to_fp32(llama):
    # peft prepare_model_for_kbit_training casts every non-Params4bit fp16/bf16 param to fp32
    expected = _nf4(LINEARS, True) + 4 * NON_LINEAR + 4 * LORA_QV
    got = mem(llama, method="qlora", quant="nf4", precision="amp-bf16").weights_bytes
    assert abs(got - expected) <= 1


def test_qlora_fp4_same_storage_as_nf4(llama):
    nf4 = mem(llama, method="qlora", quant="nf4").weights_bytes
    assert mem(llama, method="qlora", quant="fp4").weights_bytes == nf4


def test_int8_inference_one_byte_plus_row_scale(llama, gpt2):
    # LLM.int8: int8 weight (1 B) + one fp32 SCB per output row; the rest in bf16
    assert mem(llama, method="inference", quant="int8").weights_bytes == LINEARS + 4 * ROWS + 2 * NON_LINEAR
    assert LINEARS + 4 * ROWS + 2 * NON_LINEAR == 353_664
    # GPT-2 Conv1D layers are converted too: 98,304 + 4 x 1,152 + 2 x (172,288 - 98,304)
    assert mem(gpt2, method="inference", quant="int8").weights_bytes == 98_304 + 4 * 1_152 + 2 * 73_984


def test_int8_lora_bf16(llama):
    # kbit preparation runs for 8-bit too: the non-quantized rest is fp32 (was 2 x NON_LINEAR)
    m = mem(llama, method="lora", quant="int8")
    assert m.weights_bytes == LINEARS + 4 * ROWS + 4 * NON_LINEAR + 4 * LORA_QV == 638_976
    assert m.gradients_bytes == 4 * LORA_QV


def test_int8_lora_amp_keeps_non_quantized_params_fp32(llama):
    """Under amp-bf16 the model is loaded in fp32 (that is what AMP means here), bitsandbytes
    replaces only the nn.Linear layers, and peft's prepare_model_for_kbit_training (which also
    runs for 8-bit: `loaded_in_kbit = is_loaded_in_8bit or is_loaded_in_4bit`) casts any remaining
    fp16/bf16 parameter to fp32. Either way embeddings, norms and lm_head are 4 B, as for QLoRA:
    92,160 + 4 x 1,216 + 4 x 128,320 + 4 x 7,168 = 638,976 B."""
    expected = LINEARS + 4 * ROWS + 4 * NON_LINEAR + 4 * LORA_QV
    assert expected == 638_976
    assert mem(llama, method="lora", quant="int8", precision="amp-bf16").weights_bytes == expected


def test_qlora_moe_experts_stay_unquantized():
    """transformers 5.23 stores MoE experts as fused 3-D nn.Parameters (MixtralExperts.gate_up_proj
    / down_proj) and integrations/bitsandbytes.replace_with_bnb_linear converts only
    `type(module) is nn.Linear` (or Conv1D). Checked on a meta-device tiny Mixtral: only
    q/k/v/o_proj become Linear4bit; the experts stay in the load dtype (bf16).

    tiny Mixtral: V 1000, H 64, expert width 128, 2 layers, 4 experts (top 2), 4/2 heads, untied.
    attention linears 2 x 12,288 = 24,576 (NF4); experts 2 x 4 x 3 x 64 x 128 = 196,608 (bf16);
    routers 2 x 4 x 64 = 512; norms 2 x 128 + 64 = 320; embedding + lm_head 128,000.
    N = 350,016 (transformers gives 350,016). Non-quantized = 350,016 - 24,576 = 325,440. The kbit
    preparation would upcast them to fp32 (experts included: bf16 parameters, not Params4bit), and
    grouped_mm then refuses the fp32 experts: that combination is refused (issue 16 item 9). With
    --kbit-prep off they stay bf16:
    weights = 24,576 x (1/2 + 1/64 + 4/16384) + 2 x 325,440 + 4 x 7,168 (fp32 q,v adapters) = 692,230 B."""
    cfg = {"model_type": "mixtral", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False}
    spec = spec_from_config(cfg, "tiny-moe")
    assert count_params(spec).total == 350_016
    attn = 2 * ATTN_PER_LAYER
    expected = _nf4(attn, True) + 2 * (350_016 - attn) + 4 * LORA_QV
    assert expected == 692_230
    got = mem(spec, method="qlora", quant="nf4", kbit_prep="off").weights_bytes
    assert abs(got - expected) <= 1
    with pytest.raises(InputError, match="grouped_mm"):
        mem(spec, method="qlora", quant="nf4")             # kbit preparation on: fp32 experts


# ---- ZeRO, logits, KV cache --------------------------------------------------------------------

def test_zero3_partitions_weights(llama):
    # 8 GPUs, pure bf16: 2 B x 220,480 / 8 = 55,120 per GPU
    assert mem(llama, zero=3, gpus=8).weights_bytes == 55_120


def test_zero_partitions_optimizer_and_master(llama):
    m = mem(llama, zero=1, gpus=8)
    assert m.optimizer_states_bytes == 8 * N // 8   # fp32 Adam m and v, partitioned
    assert m.master_weights_bytes == 4 * N // 8     # fp32 master, partitioned
    assert m.weights_bytes == 2 * N                 # stage 1 keeps bf16 weights whole


def test_logits_and_loss(llama):
    # bf16 logits (2V) + fp32 upcast (4V) + log_softmax output (4V) = 10V in forward; backward
    # holds saved output, incoming and outgoing gradients in fp32 = 12V: the peak is 12 B x V per token
    m = mem(llama, batch=2, seq=32)
    assert m.logits_and_loss_bytes == 12 * V * 2 * 32 == 768_000


def _lora_saved_per_layer_token(rank: int) -> int:
    """What one tiny-Llama layer saves per token for LoRA on q_proj, v_proj in pure bf16 (sdpa):
    two RMSNorms save their fp32 input and rsqrt (4H + 4 each; the frozen norm weight needs no
    normalized tensor); the q and v adapters each cast the normed input to fp32 for lora_A
    (2 x 4H); SDPA saves q, k, v (2 x (64 + 32 + 32)), its output (2 x 64) and an fp32
    log-sum-exp per head (4 x 4), o_proj is frozen and needs no input; the SwiGLU MLP saves the
    gate output (silu's input), silu's output and up (3 x 2I; the frozen down_proj needs no
    product); each lora_B saves lora_A's rank-wide fp32 output (2 adapters x 4 x rank)."""
    norms = 2 * (4 * H + 4)
    adapter_inputs = 2 * 4 * H
    attention = 2 * (Q_DIM + 2 * KV_DIM) + 2 * Q_DIM + 4 * 4
    mlp = 3 * 2 * I
    adapter_outputs = 2 * 4 * rank
    return norms + adapter_inputs + attention + mlp + adapter_outputs


def test_lora_activations_grow_with_rank_by_hand(llama):
    # tokens 2 x 64; the final norm's input (4H + 4) is saved, the first layer's input norm is not
    # (a frozen embedding: its input needs no gradient), so the two cancel outside the layers
    tokens = 2 * 64
    expected = {r: L * _lora_saved_per_layer_token(r) * tokens for r in (16, 64)}
    assert expected == {16: 669_696, 64: 768_000}
    # both orders in one process: the answer must not depend on which rank was estimated first
    for rank in (16, 64, 16, 64):
        m = mem(llama, method="lora", lora_rank=rank, batch=2, seq=64)
        assert m.activations_bytes == expected[rank], rank


def test_kv_cache_tiny(llama):
    # 2 (K,V) x layers 2 x batch 2 x tokens (10+6) x kv width 32 x 2 B
    assert mem(llama, method="inference", batch=2, seq=10, new_tokens=6).kv_cache_bytes == 2 * 2 * 2 * 16 * 32 * 2
    assert mem(llama, method="inference", precision="fp32", batch=2, seq=10,
               new_tokens=6).kv_cache_bytes == 2 * 2 * 2 * 16 * 32 * 4


# ---- peaks, reserve, device used -----------------------------------------------------------

def test_peak_allocated_is_persistent_plus_larger_phase(llama):
    for kw in (dict(), dict(adamw_impl="foreach"), dict(precision="amp-bf16", batch=4, seq=128)):
        m = mem(llama, **kw)
        persistent = m.weights_bytes + m.optimizer_states_bytes + m.master_weights_bytes + m.zero_buffers_bytes
        fwd_bwd = (m.activations_bytes + m.logits_and_loss_bytes + m.autocast_weight_cache_bytes
                   + m.quant_workspace_bytes)
        step = m.gradients_bytes + m.optimizer_temporaries_bytes
        # each component is truncated to whole bytes separately: allow a few bytes
        assert abs(m.peak_allocated_bytes - (persistent + max(fwd_bwd, step))) <= 8, kw


def test_reserve_rounding_and_device_used(llama):
    w = Workload(model=llama, batch=2, seq=64).validate()
    allocated = estimate_memory(w, 0.0, 0).peak_allocated_bytes
    m = estimate_memory(w, reserve_fraction=0.25, context_bytes=300 * MiB)
    assert m.peak_allocated_bytes == allocated
    reserved = math.ceil(Fraction(allocated) * Fraction(5, 4) / GRANULE) * GRANULE
    assert m.peak_reserved_bytes == reserved
    assert m.peak_reserved_bytes % GRANULE == 0
    assert m.allocator_reserve_bytes == reserved - allocated
    assert m.cuda_context_bytes == 300 * MiB
    assert m.nccl_buffers_bytes == 0
    assert m.device_used_bytes == reserved + 300 * MiB


def test_zero_reserve_fraction_still_rounds_to_2mib(llama):
    m = mem(llama, batch=1, seq=8)
    assert 0 < m.peak_allocated_bytes <= m.peak_reserved_bytes < m.peak_allocated_bytes + GRANULE
    assert m.peak_reserved_bytes % GRANULE == 0


def test_multi_gpu_adds_nccl(llama):
    nccl = int(_overhead_csv("nccl_buffers_bytes"))
    assert nccl > 0
    m = estimate_memory(Workload(model=llama, gpus=2).validate(), 0.1, 100 * MiB)
    assert m.nccl_buffers_bytes == nccl
    assert m.device_used_bytes == m.peak_reserved_bytes + 100 * MiB + nccl


def test_paged_optimizer_lives_outside_the_allocator(llama):
    plain = mem(llama)
    m = estimate_memory(Workload(model=llama, optimizer="paged-adamw").validate(), 0.0, 64 * MiB)
    assert m.optimizer_states_bytes == 0
    assert m.paged_optimizer_bytes == 4 * N  # bf16 m and v
    assert m.peak_allocated_bytes == plain.peak_allocated_bytes - 4 * N
    assert m.device_used_bytes == m.peak_reserved_bytes + 64 * MiB + 4 * N


def test_adamw_8bit_about_two_bytes_per_param_at_scale():
    # Llama-2-7B (6,738,415,616 params): two 8-bit states = 2 B/param plus a small absmax overhead
    # (docs/design.md section 3: "8-bit Adam: 2 B per param"), each state with one fp32 absmax
    # per block of 256 values (overheads.csv bnb_blocksize_8bit_optimizer, from bitsandbytes
    # 0.50.2): 2 x 4/256 B per param, a 1.6 % share, under the 2.5 % allowed.
    from estimator.configs import load_spec
    n = 6_738_415_616
    m = mem(load_spec("llama-2-7b"), optimizer="adamw-8bit", batch=1, seq=16)
    assert 2.0 * n < m.optimizer_states_bytes <= 2.05 * n


def test_padding_mask_saves_the_converted_mask_row_and_repeated_kv_per_layer():
    # tiny Llama, bf16: a padded batch gives SDPA a 4D mask in every layer, so the memory-efficient
    # kernel saves the mask converted to bf16 (one row of S keys per query: 2 x S bytes) and
    # transformers repeats k and v to the 4 query heads (2 x 2 B x (q 64 - kv 32) per token)
    from estimator.activations import activation_key, score_bytes_per_token

    spec = spec_from_config(json.loads((Path(__file__).parent / "data" / "tiny-llama.json").read_text()), "tiny")
    w = Workload(spec, method="full", batch=2, seq=64, padding_mask=True).validate()
    assert score_bytes_per_token(activation_key(w), 64) == 2 * 64 + 2 * 2 * (64 - 32) == 256
    assert score_bytes_per_token(activation_key(w.with_(padding_mask=False)), 64) == 0
    # saved activations: 256 B per token and layer more (2 layers x 128 tokens, no checkpointing)
    padded, plain = estimate_memory(w, 0.0, 0), estimate_memory(w.with_(padding_mask=False), 0.0, 0)
    assert padded.activations_bytes - plain.activations_bytes == 256 * 2 * 128
