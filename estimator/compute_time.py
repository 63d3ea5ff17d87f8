"""Seconds of the kernels of one micro-batch on one GPU (docs/design.md section 4), split by what bounds
them. Each part is a roofline term: FLOPs over achieved peak, or bytes over achieved bandwidth.

- gemm: the matmuls of the decoder layers and lm_head. Each GEMM class is charged the longer of
  its FLOPs over peak x HFU and the bytes it streams (a x (MK + KN + MN)) over achieved bandwidth,
  so a GEMM whose arithmetic intensity 2MNK / (a (MK + KN + MN)) falls below the GPU's ops:byte
  ratio runs at a lower fraction of peak (NVIDIA Deep Learning Performance, "Matrix Multiplication Background User's Guide":
  math-limited when intensity > ops:byte ratio, memory-limited below). Small hidden sizes, small
  micro-batches and MoE experts (M = tokens x top_k / experts) fall toward the memory limit.
- attention: causal kernels (SDPA, FlashAttention) skip the masked half of the score FLOPs and run at
  their own published fraction of peak (SDPA handed a 4D mask, by a padded batch or a sliding window
  the keys reach, computes every block: `fused_keys`); eager attention multiplies the full score matrix and streams
  it (b x heads x s x s elements) through scale, mask, fp32 softmax and cast.
- fp8 (`--precision fp8`, torchao float8 training): the converted decoder linears' GEMMs at the
  GPU's dense fp8 peak (operands 1 byte), the rest at bf16; their eager casts are elementwise bytes.
- elementwise: norms, rotary, activation, residual adds and the fp32 loss, bytes over bandwidth
  (tensor contractions are 99.8 % of BERT's FLOPs but 61 % of its PyTorch runtime; normalisation and
  elementwise ops take the rest: Ivanov et al., "Data Movement Is All You Need", MLSys 2021, Table 2).
- adapters: peft's LoRA path per targeted module (cast to the adapter dtype, two thin matmuls,
  scaling, add, cast back) is memory-bound: bytes over bandwidth, its backward counted formula by
  formula (not as twice the forward: `_adapter_sides`); DoRA adds its weight norm per
  forward pass (the identity through the adapters, the d_out x d_in sums) and its token-wide
  arithmetic (estimator.dora).
- dequant: bitsandbytes dequantizes each quantized weight to the compute dtype every time it is used
  (MatMul4Bit.forward and again in .backward, bitsandbytes/autograd/_functions.py), so a QLoRA
  micro-batch rereads and rewrites the whole base 2 (+1 with recomputation) times.

Passes: forward 1, backward 2 (input and weight gradients; a frozen GEMM only its input gradient),
recomputation +1 forward of the decoder layers. `off` names mechanisms to leave out (the bench's
ablation): "gemm_size", "causal_attention", "elementwise", "adapters", "dequant".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from estimator import dora, fp8, tables
from estimator.activations import eager_softcap, sdpa_mask_layers
from estimator.defaults import time_constant
from estimator.flops import attention_flops_per_token, matmul_params
from estimator.lora_targets import matched
from estimator.model import ModelSpec
from estimator.params import count_params
from estimator.regimes import liger_fuses_loss, regime
from estimator.states import int4_linear_bytes
from estimator.workload import BNB_QUANTS, INT4_QUANTS, Workload

# FlashAttention-3 (Shah et al. 2024, abstract): FlashAttention-2 reaches only 35 % of peak on H100
HOPPER_PREFIXES = ("h100", "h200", "h20", "gh200")


@dataclass(frozen=True)
class ComputeParts:
    """Seconds of one micro-batch (training) or one prefill on one GPU, by bound."""

    gemm_s: float
    attention_s: float
    elementwise_s: float
    adapter_s: float = 0.0
    dequant_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.elementwise_s + self.adapter_s + self.dequant_s

    def to_dict(self) -> dict:
        # floats only: a shallow dict (dataclasses.asdict deep-copies, a fifth of an estimate's time)
        return {"gemm_s": self.gemm_s, "attention_s": self.attention_s, "elementwise_s": self.elementwise_s,
                "adapter_s": self.adapter_s, "dequant_s": self.dequant_s}


def bandwidth(gpu: tables.GpuSpec) -> float:
    """Achieved bytes/s of streaming kernels."""
    return gpu.memory_bandwidth_bytes_per_s * time_constant("elementwise_bandwidth_fraction")


def gemm_slowdown(m: float, k: float, n: float, a: float, peak: float, hfu: float, bw: float) -> float:
    """Time of an M x K x N GEMM over its compute-bound time: max(1, ridge / intensity), with
    intensity = 2MKN / (a (MK + KN + MN)) FLOPs per byte and ridge = achieved FLOP/s / achieved B/s.
    The roofline's max, not a sum: attainable FLOP/s = min(peak, intensity x bandwidth) (Williams,
    Waterman and Patterson, "Roofline", CACM 2009): a GEMM's operand traffic overlaps its math, so
    it takes the longer of the two; and the GEMM level `hfu` was measured on large matmuls whose
    traffic is already inside their time (estimator/data/mfu.csv), so adding it again counted it twice."""
    if m <= 0:
        return 1.0
    intensity = 2.0 * m * k * n / (a * (m * k + k * n + m * n))
    return max(1.0, (peak * hfu / bw) / intensity)


def attention_fraction(gpu: tables.GpuSpec) -> float:
    name = "attention_fraction_hopper" if gpu.slug.startswith(HOPPER_PREFIXES) else "attention_fraction"
    return time_constant(name)


def mem_efficient_fraction(gpu: tables.GpuSpec) -> float:
    """Fraction of dense peak of SDPA's memory-efficient kernel (the one a masked call gets):
    `attention_fraction_mem_efficient` (A100 measurements), scaled on Hopper by what the sm80
    FlashAttention-2 code loses there, its best on each (`attention_fraction_hopper` /
    `attention_fraction_ampere_best`: like for like, both the kernel's best fraction)."""
    ampere = time_constant("attention_fraction_mem_efficient")
    if not gpu.slug.startswith(HOPPER_PREFIXES):
        return ampere
    return ampere * time_constant("attention_fraction_hopper") / time_constant("attention_fraction_ampere_best")


def flash_head_dim(d: float) -> float:
    """Head dim a FlashAttention-2 kernel computes with: rounded up to a multiple of 32, to 256 past
    192 (flash_api.cpp mha_fwd `head_size_rounded`; kernels exist for 32, 64, ..., 256)."""
    return float(-(-int(d) // 32) * 32 if d <= 192 else 256)


def mem_efficient_head_dim(d: float) -> float:
    """Head dim the memory-efficient kernel computes with: its tiles hold 64 or 128 (kMaxK of the
    cutlassF/cutlassB kernels; the gmem kernel iterates past 128). Paddle pull 49910's A100 forward
    times are flat for head dims 16, 32 and 64 (0.91-1.04 ms at 64 x 512 x 16 heads); NVIDIA/cutlass
    pull 992's backward at dim 80 runs 54 TFLOP/s to 72-85 at 128, the rate 80 / 128 predicts."""
    if d <= 64:
        return 64.0
    return float(-(-int(d) // 128) * 128)


def _kernel_flops_per_key(spec: ModelSpec, pad) -> float:
    """FLOPs per query token and computed key of one layer, with the kernel's padded head dims."""
    h = spec.num_heads
    return 2.0 * h * (pad(spec.q_dim / h) + pad(spec.o_dim / h))


def _ffn_width(spec: ModelSpec) -> float:
    if spec.num_experts:
        return spec.experts_per_token * spec.moe_intermediate_size + spec.shared_expert_intermediate_size
    return spec.intermediate_size


def layer_elementwise_bytes(spec: ModelSpec, a: int, liger: bool) -> float:
    """Forward bytes per token and decoder layer of the unfused ops, counted from transformers'
    Llama-family code (modeling_llama.py): RMSNorm (to fp32, pow, mean, x rsqrt, to input dtype,
    x weight: 28 + 4a bytes per element; LayerNorm is one fused kernel: 2a), 2 residual adds (3a),
    rotary on q and k (apply_rotary_pos_emb: x cos, rotate_half's neg and cat, x sin, add: 10a),
    the gated activation (act(gate) 2a, x up 3a) and the attention output transpose (2a). Liger's
    fused RMSNorm (2a), RoPE (2a) and SwiGLU (3a) replace theirs."""
    d, f = spec.hidden_size, _ffn_width(spec)
    qk = spec.q_dim + spec.kv_dim
    if liger:
        norm, rope, mlp = 2 * a, 2 * a, 3 * a
    else:
        norm = (28 + 4 * a) if spec.norm == "rms" else 2 * a
        rope, mlp = 10 * a, (5 * a if spec.mlp_gated else 2 * a)
    return spec.norms_per_layer * norm * d + 2 * 3 * a * d + rope * qk + mlp * f + 2 * a * spec.o_dim


def loss_bytes_per_token(spec: ModelSpec, a: int, liger: bool) -> float:
    """transformers' ForCausalLMLoss upcasts the logits to fp32 (a + 4), log_softmax reads and writes
    fp32 (8), its backward reads and writes fp32 (8) and the gradient is cast back (4 + a). Liger's
    fused linear cross-entropy never materializes the logits."""
    return 0.0 if liger else spec.vocab_size * (2 * a + 24)


def gemm_passes(w: Workload) -> tuple[float, float]:
    """(passes of a trained op, passes of a frozen op) over the layers: fwd + bwd (+ recompute)."""
    re = 1.0 if w.grad_ckpt else 0.0
    return 3.0 + re, 2.0 + re


def _gemm_s(w: Workload, gpu: tables.GpuSpec, hfu: float, tokens: float, training: bool, off: frozenset) -> float:
    spec, p = w.model, count_params(w.model)
    a, peak, bw = w.activation_dtype_bytes, gpu.peak_flops(w.compute_dtype), bandwidth(gpu)
    layers, head = matmul_params(spec, p)
    active_experts = p.expert_weights * p.active_expert_fraction
    dense = layers - active_experts
    slow = (lambda m, k, n: 1.0) if "gemm_size" in off else (
        lambda m, k, n: gemm_slowdown(m, k, n, a, peak, hfu, bw))
    d = spec.hidden_size
    head_tokens = tokens if training else w.batch       # generate takes logits of the last position
    expert_tokens = tokens * spec.experts_per_token / spec.num_experts if spec.num_experts else 0.0
    fp8_work = 0.0
    if w.fp8:   # Float8Linear / te.Linear: the converted linears' three GEMMs at the fp8 peak (estimator.fp8)
        converted = fp8.converted_weights(spec, p)
        dense -= converted
        peak8 = gpu.peak_flops("fp8")
        slow8 = 1.0 if "gemm_size" in off else gemm_slowdown(tokens, d, d, 1, peak8, hfu, bw)
        fp8_work = 2.0 * converted * tokens * slow8 * peak / peak8   # in bf16-peak FLOPs (hfu_terms)
    work = (2.0 * dense * tokens * slow(tokens, d, d) + fp8_work
            + 2.0 * active_experts * tokens * slow(expert_tokens, d, spec.moe_intermediate_size or d))
    head_work = 2.0 * head * head_tokens * slow(head_tokens, spec.embed_dim, spec.vocab_size)
    if w.te_fp8 and fp8.te_head_converted(spec):   # Transformer Engine converts the lm_head too
        head_work *= peak / gpu.peak_flops("fp8")
    if training:
        trained, frozen = gemm_passes(w)
        layer_passes = trained if w.method == "full" else frozen
        work = work * layer_passes + head_work * (3.0 if w.method == "full" else 2.0)
    else:
        work += head_work
    return work / (peak * hfu) / (w.tp * w.pp)


def fused_keys(w: Workload) -> float:
    """Keys per query token, summed over the layers, that a fused (SDPA / FlashAttention) kernel
    computes. Under the causal mask it skips the masked half of the blocks: half of the keys, the
    window on sliding layers (FlashAttention takes the window as an argument). SDPA skips nothing
    on a layer transformers hands a 4D mask (estimator.activations.sdpa_mask_layers: a padded batch,
    keys reaching a sliding window, a model that always builds one), because PyTorch's flash backend
    takes no attn_mask (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp `check_for_attn_mask`:
    'Flash Attention does not support non-null attn_mask') and the memory-efficient kernel runs
    every query x key block: all keys of those layers (the window is in the mask, not the kernel)."""
    spec = w.model
    masked = sum(sdpa_mask_layers(spec, w.padding_mask, w.seq)) if w.attn == "sdpa" else 0
    if not masked:
        return 0.5 * spec.attended_tokens(w.seq)
    # the layers without a mask are causal over fewer keys than the window (else they would have one)
    return masked * w.seq + 0.5 * (sum(spec.window_layers) - masked) * w.seq


def fused_passes(w: Workload, training: bool) -> float:
    """Passes of a fused attention kernel's forward FLOPs in one micro-batch: forward 1, backward 2.5
    (it recomputes the scores and probabilities from Q and K, then makes dV, dP, dQ and dK: five
    matmuls to the forward's two; the convention of FlashAttention's own benchmark,
    Dao-AILab/flash-attention benchmarks/benchmark_flash_attention.py `flops`: bwd 2.5 f, fwd+bwd
    3.5 f, in which FlashAttention-2's 50-73 % of peak, the `attention_fraction` source, is stated),
    recomputation +1."""
    if not training:
        return 1.0
    return 3.5 + (1.0 if w.grad_ckpt else 0.0)


def sdpa_mask_bytes(w: Workload, tokens: float, training: bool) -> float:
    """Bytes the 4-D mask of SDPA's masked layers (estimator.activations.sdpa_mask_layers) moves in
    one micro-batch, beyond the kernel's FLOPs: transformers 5 builds a boolean mask, which PyTorch
    converts to the compute dtype on every call (aten/src/ATen/native/transformers/attention.cpp
    `convert_boolean_attn_mask`: `at::where(mask, 0, -inf)`, 1 byte read and `a` written per element
    of the batch x query x key mask, forward and recomputation), then expands over the heads with a
    zero stride (`preprocess_mask`); the memory-efficient kernel loads the bias tile of every
    query-block x key-block pair it computes, for every head (mem_eff_attention kernel_forward.h and
    kernel_backward.h), so the mask is read heads times per forward, recomputation and backward: one
    head's mask (batch x seq x seq x a: 134 MB at 2 x 8192 in bf16) is past the L2 of every GPU."""
    if w.attn != "sdpa":
        return 0.0
    spec = w.model
    layers = sum(sdpa_mask_layers(spec, w.padding_mask, w.seq))
    if not layers:
        return 0.0
    a = w.activation_dtype_bytes
    forwards = 1.0 + (1.0 if (training and w.grad_ckpt) else 0.0)
    kernel_reads = forwards + (1.0 if training else 0.0)
    per_layer_token = (a * spec.num_heads * kernel_reads + (1 + a) * forwards) * w.seq
    return per_layer_token * layers * tokens


def eager_keys(w: Workload) -> float:
    """Keys per query token, summed over the layers, that eager attention computes: the whole
    seq x seq score matrix on every attention layer (the causal half and a sliding window are
    applied by adding the mask, not skipped)."""
    return float(sum(w.model.window_layers) * w.seq)


def _attention_s(w: Workload, gpu: tables.GpuSpec, hfu: float, tokens: float, training: bool,
                 off: frozenset) -> float:
    spec = w.model
    a, peak = w.activation_dtype_bytes, gpu.peak_flops(w.compute_dtype)
    passes = gemm_passes(w)[0] if training else 1.0
    if "causal_attention" in off:
        fwd = attention_flops_per_token(spec, w.seq) * tokens
        return fwd * passes / (peak * hfu) / (w.tp * w.pp)
    per_key = 2.0 * (spec.q_dim + spec.o_dim)   # FLOPs per computed key (flops.attention_flops_per_token)
    if w.attn != "eager":
        # the masked layers' keys go to the memory-efficient kernel, the others to FlashAttention-2
        # (each with the head dims its kernels compute with)
        masked_keys = sum(sdpa_mask_layers(spec, w.padding_mask, w.seq)) * w.seq if w.attn == "sdpa" else 0.0
        flash = (_kernel_flops_per_key(spec, flash_head_dim) * (fused_keys(w) - masked_keys)
                 / attention_fraction(gpu))
        efficient = _kernel_flops_per_key(spec, mem_efficient_head_dim) * masked_keys / mem_efficient_fraction(gpu)
        return ((flash + efficient) * tokens * fused_passes(w, training) / peak
                + sdpa_mask_bytes(w, tokens, training) / bandwidth(gpu)) / (w.tp * w.pp)
    # eager: full score matrix at the GEMM rate, plus its bytes: matmul out (a), x scaling (2a),
    # + mask (3a), fp32 softmax (a + 4), cast (4 + a), read by the PV matmul (a) = 9a + 8 per element;
    # Gemma-2's soft-capping divides, takes tanh and multiplies first (+6a: modeling_gemma2.py
    # eager_attention_forward)
    keys = eager_keys(w)
    per_element = 9 * a + 8 + (6 * a if eager_softcap(spec) else 0)
    scores = w.batch * spec.num_heads * w.seq * keys
    return (per_key * keys * tokens * passes / (peak * hfu)
            + scores * per_element * passes / bandwidth(gpu)) / (w.tp * w.pp)


def fp8_cast_bytes(w: Workload, tokens: float) -> float:
    """Bytes the fp8 casts of one training micro-batch move (torchao float8: amax, scale, clamp,
    cast; estimator.fp8.cast_bytes per element cast, eager or fused by torch.compile)."""
    if not (w.fp8 and w.training):
        return 0.0
    if w.te_fp8:   # Transformer Engine: fused cast-transposes (estimator.fp8)
        return fp8.TE_CAST_TRAFFIC_BYTES * fp8.te_cast_elements(w.model, tokens)
    weight_casts = None
    if w.fsdp != "none":   # float8 all-gather: each rank casts its shard once per gather
        weight_casts = (1.0 if w.fsdp == "grad-op" else 2.0) / regime(w).fsdp_shard
    return fp8.cast_bytes(w.compiled)[1] * fp8.cast_elements(w.model, tokens, w.grad_ckpt, weight_casts)


def _elementwise_s(w: Workload, gpu: tables.GpuSpec, tokens: float, training: bool) -> float:
    spec, a, liger = w.model, w.activation_dtype_bytes, regime(w).liger
    layer = layer_elementwise_bytes(spec, a, liger) * spec.num_layers * tokens
    if not training:
        return layer / bandwidth(gpu) / (w.tp * w.pp)
    fused = liger and liger_fuses_loss(spec.model_type)    # Granite: Liger's loss on the logits
    total = layer * gemm_passes(w)[0] + loss_bytes_per_token(spec, a, fused) * tokens + fp8_cast_bytes(w, tokens)
    return total / bandwidth(gpu) / (w.tp * w.pp)


def _adapter_sides(w: Workload, backward: bool) -> float:
    """Bytes per token of peft's LoRA path over the targeted modules, forward or backward.

    Forward (tuners/lora/layer.py Linear.forward): x cast to the adapter dtype c, dropped out when
    lora_dropout > 0 (read x, write the copy and a 1-byte mask), lora_A reads it; lora_B writes
    c x d_out, x scaling, added to the base output and cast back.
    Backward, each autograd formula once (no pass multiplier: these are memory-bound, and their
    backward moves about what the forward did): the cast back and the scaling's grad (c in, c out),
    lora_B's input-gradient and weight-gradient GEMMs each read the output gradient; lora_A's
    input-gradient GEMM writes c x d_in and its weight-gradient GEMM reads its saved input; the
    dropout's grad (grad and mask in, grad out), the cast to the model dtype, and autograd adding
    the adapter's input gradient to the base layer's (read two, write one)."""
    a, c = w.activation_dtype_bytes, regime(w).adapter_compute_bytes
    cast = (a + c) if c != a else 0
    dropout = (2 * c + 1) if w.lora_dropout else 0     # read x, write the copy and a 1-byte mask
    total = 0.0
    for site in matched(w.model, w.lora_targets):
        embedding = site.kind == "embedding"   # rank-wide rows of lora_embedding_A: no vocabulary-wide input
        if backward:
            side_in = 0 if embedding else (2 * c + dropout + cast + 3 * a) * site.d_in
            side_out = (cast + 2 * c + 2 * c) * site.d_out
        else:
            side_in = 0 if embedding else (c + cast + dropout) * site.d_in
            side_out = (c + 2 * c + a + c + max(a, c) + cast) * site.d_out
        total += side_in + side_out
    return total


def adapter_bytes_per_token(w: Workload) -> float:
    """Forward bytes per token of peft's LoRA path, summed over the targeted modules
    (`_adapter_sides`)."""
    return _adapter_sides(w, backward=False)


def adapter_backward_bytes_per_token(w: Workload) -> float:
    """Backward bytes per token of peft's LoRA path, summed over the targeted modules
    (`_adapter_sides`)."""
    return _adapter_sides(w, backward=True)


def dora_bytes(w: Workload, tokens: float) -> float:
    """Bytes DoRA adds to one training micro-batch (estimator.dora; memory-bound): the weight norm
    rebuilt in every forward pass (the recomputation too) and the token-wide arithmetic of every
    adapted linear in the forward, backward (about twice) and recomputation."""
    if not (w.dora and w.method in ("lora", "qlora")):
        return 0.0
    from estimator.activations import activation_key, dora_dtypes

    dt = dora_dtypes(activation_key(w))
    forwards = 2.0 if w.grad_ckpt else 1.0
    norm = dora.forward_bytes(w.model, w.lora_targets, w.lora_rank, dt)
    arithmetic = dora.token_bytes_per_out(dt) * dora.outs_all(w.model, w.lora_targets) * tokens
    return forwards * norm + gemm_passes(w)[0] * arithmetic


def _adapter_s(w: Workload, gpu: tables.GpuSpec, tokens: float) -> float:
    if w.method not in ("lora", "qlora"):
        return 0.0
    forwards = 2.0 if w.grad_ckpt else 1.0      # the recomputation runs the forward again
    per_token = adapter_bytes_per_token(w) * forwards + adapter_backward_bytes_per_token(w)
    return (per_token * tokens + dora_bytes(w, tokens)) / bandwidth(gpu) / (w.tp * w.pp)


def dequant_bytes_per_use(w: Workload) -> float:
    """Bytes one dequantization of the quantized linears moves: the packed weights and their absmax
    (GPTQ: scales, zeros and group index, estimator.states `int4_linear_bytes`) read, the
    compute-dtype copy written (the GEMM's own read of it is in the GEMM term)."""
    p = count_params(w.model)
    quantized = p.linear_weights - p.expert_weights     # bnb replaces nn.Linear only
    if w.quant in INT4_QUANTS:
        packed = sum(lin.count * int4_linear_bytes(w.quant, lin.d_in, lin.d_out) for lin in p.dense_linears)
        return (packed + quantized * gptq_torch_dequant_bytes_per_element(w.activation_dtype_bytes)) / (w.tp * w.pp)
    packed = 0.5 + 1.0 / 64 if w.quant in ("nf4", "fp4") else 1.0
    return quantized * (packed + w.activation_dtype_bytes) / (w.tp * w.pp)


def gptq_torch_dequant_bytes_per_element(half: int) -> int:
    """Bytes gptqmodel's TorchLinear moves per weight element when it dequantizes in training mode
    (estimator.memory `gptq_training_dequant_scratch_bytes` names the tensors), besides reading the packed
    weights: the shift writes int32 (4); the int8 cast reads it and writes (4 + 1); the mask reads and
    writes int8 (1 + 1); the zeros' gather writes int8 (1); the difference reads two int8 and writes
    one (3); the scales' gather writes half (`half`); the product reads half and int8 and writes half
    (2 x half + 1)."""
    return 4 + (4 + 1) + (1 + 1) + 1 + 3 + half + (2 * half + 1)


def dequant_uses(w: Workload, training: bool) -> float:
    """bitsandbytes: the forward, the recomputed forward and the backward's input gradient each
    dequantize again. GPTQ's trainable kernels: the forward and the recomputed forward; the backward
    reads the copy the forward saved (estimator.activations `int4_dequantized_bytes_per_layer`)."""
    if not training:
        return 1.0
    recompute = 1.0 if w.grad_ckpt else 0.0
    return 1.0 + recompute + (0.0 if w.quant in INT4_QUANTS else 1.0)


def _dequant_s(w: Workload, gpu: tables.GpuSpec, training: bool) -> float:
    # MXFP4's matmul_ogs reads the packed experts in its GEMM, and so do the int4 inference kernels
    # (Marlin, ExLlamaV2); LoRA on GPTQ dequantizes the whole weight in every forward
    if w.quant not in BNB_QUANTS and not (w.quant in INT4_QUANTS and training):
        return 0.0
    return dequant_bytes_per_use(w) * dequant_uses(w, training) / bandwidth(gpu)


@lru_cache(maxsize=4096)
def compute_parts(w: Workload, gpu: tables.GpuSpec, hfu: float, off: frozenset = frozenset()) -> ComputeParts:
    """One training micro-batch (or, for inference, the prefill) on one GPU (memoised on every
    argument it reads: the frozen Workload and GpuSpec, the fraction and `off`; the constants are
    the shipped tables)."""
    training = w.training
    tokens = float(w.batch * w.seq)
    gemm = _gemm_s(w, gpu, hfu, tokens, training, off)
    attention = _attention_s(w, gpu, hfu, tokens, training, off)
    elementwise = 0.0 if "elementwise" in off else _elementwise_s(w, gpu, tokens, training)
    adapters = 0.0 if ("adapters" in off or not training) else _adapter_s(w, gpu, tokens)
    dequant = 0.0 if "dequant" in off else _dequant_s(w, gpu, training)
    return ComputeParts(gemm, attention, elementwise, adapters, dequant)


def hfu_terms(w: Workload, gpu: tables.GpuSpec) -> tuple[float, float]:
    """(work, fixed_s) with compute_parts(w, gpu, h).total_s = work / (peak x h) + fixed_s: every
    part is either FLOPs over peak x h or independent of h (a memory-bound GEMM class: its bytes over
    bandwidth), so two evaluations give both. Exact while no GEMM class crosses its ridge between
    h = 0.5 and 1 (`gemm_slowdown`): with thousands of tokens a layer GEMM's intensity is about
    2KN / (a (K + N)) FLOP/B (bf16: 448 at hidden 896, 2048 at 4096), above the ridges (200-420
    FLOP/B on the A100 and H100). The fitting inverts it: h = work / (peak x (measured - fixed_s))."""
    t1 = compute_parts(w, gpu, 1.0).total_s
    t_half = compute_parts(w, gpu, 0.5).total_s
    return (t_half - t1) * gpu.peak_flops(w.compute_dtype), 2.0 * t1 - t_half
