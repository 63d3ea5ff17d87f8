"""Bytes that autograd keeps alive between forward and backward, per token, derived per architecture.

Counted from what each op of the transformers 5 implementation saves for backward (PyTorch saves
an operand only when the gradient of another operand needs it, so a frozen linear does not keep
its input) and checked against fake-tensor traces of the real step (profiler.trace, the oracle;
tests/test_estimator_vs_trace.py). Three dtypes matter (`Dtypes`): the compute dtype, the
residual stream (fp32 under AMP and in QLoRA, whose kbit preparation upcasts the embedding), and
the output of the model's linears (bitsandbytes 4-bit layers return their input dtype).

Every function reads an `ActivationKey`, never a Workload: the key holds exactly the Workload
fields these formulas may read (`activation_key` builds it), so the per-token bytes can be
memoised on the key (estimator.memory) without a field the cache does not know about.

- RMSNorm upcasts to fp32: the fp32 input is saved (4 B) with an fp32 rsqrt per token, and the
  normalized tensor (residual dtype) when the norm weight trains. Gemma norms multiply in fp32
  (4 B). LayerNorm saves its input and fp32 mean and rstd (8 B per token).
- A tensor read by several linears is saved once when they save it as it is; under autocast
  each linear saves its own half-precision cast; peft's LoRA adapters cast their input to fp32
  (the adapter dtype) each, then autocast casts that to half precision.
- SDPA (flash/efficient kernels, GQA without repeating k and v) saves q, k, v, the output and an
  fp32 log-sum-exp per head; the output is laid out like q, so the o_proj input is a view of it
  unless q is contiguous per head (partial rotary through `cat`: Phi, GPT-NeoX), then a copy.
  Eager attention saves the fp32 softmax and its half cast (B x heads x T x T, plus a bool
  dropout mask and the dropped-out probabilities when attention dropout is on, and Gemma-2's
  tanh soft-capping output), repeats k and v to all heads and copies its output for o_proj.
- Gated MLP (SwiGLU/GeGLU) saves gate, activation and up, and the product for a training down
  projection; `gelu_new` is a Python composition saving its input, 0.5 x, tanh and 1 + tanh
  (under autocast pow runs in fp32: an fp32 copy of the input too, and tanh in fp32).
- MoE (transformers 5 grouped experts): the routed copy of the input per chosen expert (when the
  experts train), the fused gate/up output, activation, product, each expert's output (the routing
  weights multiply it), the router's fp32 softmax and int64 routing indices; Qwen-MoE's shared
  expert and its sigmoid gate.
- Dropout in training saves a 1-byte mask (CUDA's fused dropout).
- The loss: the HF loss upcasts logits to fp32; log_softmax saves its fp32 output (4 B x vocab).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from estimator import dora
from estimator.fp8 import TE_SAVED_INPUT_BYTES, te_head_converted
from estimator.lora_targets import expert_targets, trained_roles
from estimator.model import ModelSpec
from estimator.params import count_params
from estimator.regimes import liger_fuses_loss, regime
from estimator.tables import dtype_bytes
from estimator.workload import CHUNKED_LOSS_CHUNKS, Workload

# q made contiguous per head by torch.cat (partial rotary: Phi, GPT-NeoX, StableLM, GLM-4, GLM-4.5)
# rotary through `cat` (q and k come out contiguous per head, and so does SDPA's output): Phi-3's
# apply_rotary_pos_emb has the partial form even with the whole head rotated (transformers 5.23)
_PARTIAL_ROTARY = ("phi", "gpt_neox", "stablelm", "glm", "glm4", "glm4_moe", "phi3")
_PLAIN_SOFTMAX = ("gpt2", "gpt_oss")      # eager softmax without dtype=float32
_SOFTMAX_HIDDEN_DTYPE = ("falcon",)         # eager softmax in the hidden states' dtype
# model types whose q/k RMSNorms Liger patches (liger-kernel 0.8.5 monkey_patch.py: Qwen3's and
# Gemma-3's and EXAONE-4's instance patches include self_attn.q_norm and k_norm; OLMo-2's do not)
_LIGER_QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text", "exaone4")
# a 4-D mask on every layer, padded or not (transformers 5.23 FalconModel: create_causal_mask with
# allow_is_causal_skip=False), so SDPA never gets is_causal alone
_ALWAYS_4D_MASK = ("falcon",)
_ATTN_SOFTCAP = ("gemma2",)                # tanh soft-capping of attention scores (eager)
_FUSED_QKV = ("gpt2", "gpt_bigcode", "bloom", "falcon", "gpt_neox", "phi3")  # one qkv linear
# the values a view of the fused qkv output while the rotary makes new queries and keys: what
# attention saves of the values keeps the whole qkv output (transformers 5.23 Phi3Attention slices
# it, GPTNeoXAttention chunks it; Falcon's multi-query split copies its keys and values)
_QKV_VIEW_VALUES = ("gpt_neox", "phi3")
# rotary embeddings computed in fp32 (OLMo: fp32 cos/sin tables; Cohere, Cohere2: q.float(), k.float()),
# with the number of q-sized fp32 tensors alive at once in the prefill
_FP32_ROTARY = {"olmo": 3, "cohere": 4, "cohere2": 4}
_FP32_QK_EAGER = ("gptj",)                 # eager attention scores from fp32 casts of q and k
_FLOAT_QK_ROTARY = ("cohere", "cohere2")   # k.float() made before q's rotary products
# prefill: the decoder layer keeps its attention locals (the normed input and the attention output)
# through the MLP (StableLmDecoderLayer without use_parallel_residual, transformers 5.23)
_KEEPS_ATTENTION_LOCALS = ("stablelm",)
# norms applied to each sublayer's output (Olmo2DecoderLayer: post_attention_layernorm,
# post_feedforward_layernorm; no input norm)
_POST_NORM = ("olmo2",)
# the shared expert runs before the routed ones and its output waits beside them
# (Qwen2MoeSparseMoeBlock, Qwen3NextSparseMoeBlock, Ernie4_5_MoeSparseMoeBlock, transformers 5.23)
_SHARED_FIRST = ("qwen2_moe", "qwen3_next", "ernie4_5_moe")

_PER_HEAD_LAYERNORM = ("stablelm",)        # q/k LayerNorms, one nn.LayerNorm per head
_FUSED_GATE_UP = ("phi3", "glm", "glm4")   # one gate_up_proj linear
_DROPOUT = {"gpt2": ("attn", "resid", "embed"), "gpt_bigcode": ("attn", "resid", "embed"),
            "opt": ("resid", "embed"), "phi": ("resid",)}
_FP32_NORM_WEIGHT = ("olmo2", "gpt_oss", "qwen3_next")   # RMSNorm: (weight * x) in fp32, then cast (as Gemma; Qwen3-Next: x * (1 + weight))
_INDEX_BYTES = 8                           # int64 routing indices
# routers computing in fp32: F.linear(hidden.float(), weight.float()) (DeepseekV2/V3TopkRouter,
# Glm4MoeTopkRouter, Ernie4_5_MoeTopKRouter, transformers 5.23); ERNIE keeps the weight in fp32
_FP32_ROUTER = ("deepseek_v2", "deepseek_v3", "glm4_moe", "ernie4_5_moe")
_FP32_ROUTER_WEIGHT = ("ernie4_5_moe",)
# sigmoid scores, top-k weights renormalised in place (norm_topk_prob, default True): DeepSeek-V3, GLM-4.5
_SIGMOID_ROUTER = ("deepseek_v3", "glm4_moe")
# every expert runs every token, scaled by its router score (Llama4TextMoe: torch.bmm over all experts)
_DENSE_EXPERTS = ("llama4_text",)
# Liger's fused MoE replaces these experts (liger-kernel 0.8.5 monkey_patch.py: LigerExperts over the
# fused expert parameters of Mixtral, Qwen3-MoE, DeepSeek-V2/V3 and Qwen3-Next; ops/fused_moe.py
# LigerFusedMoEFunction)
_LIGER_FUSED_MOE = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3", "qwen3_next")


class ActivationKey(NamedTuple):
    """The Workload fields the activation formulas read, and nothing else (hashable: a cache key).
    `training` and `amp` are the Workload's own derivations, carried so no rule is restated here."""

    model: ModelSpec
    method: str
    precision: str
    attn: str
    lora_targets: tuple[str, ...]
    lora_rank: int
    quant: str
    grad_ckpt: bool
    seq: int
    training: bool
    amp: bool
    kbit_prep: bool = False    # peft's kbit preparation ran (fp32 residual stream), estimator.regimes
    adapter_bytes: int = 4     # dtype LoRA adapters compute in (peft: fp32; FSDP/DeepSpeed: half)
    liger: bool = False        # Liger Kernel's fused linear cross-entropy (no logits)
    lora_adapters: int = 0     # LoRA adapters per decoder layer (estimator.lora_targets)
    loss: str = "hf"           # how the loss is computed (Workload.loss)
    dora: tuple = ()           # DoRA: (output features of the adapted linears per layer, o_proj's share)
    # fused expert parameters peft targets (ParamWrapper: "gate_up_proj", "down_proj"), estimator.lora_targets
    expert_adapters: tuple = ()
    padding_mask: bool = False  # a padded batch's attention mask reaches the model (Workload.padding_mask)
    lora_dropout: bool = False  # peft's lora_dropout > 0: each adapter drops out its own copy of its input
    te: bool = False            # fp8 through Transformer Engine: each te.Linear saves its own fp8 input (estimator.fp8)


def activation_key(w: Workload) -> ActivationKey:
    """The `ActivationKey` of `w` (the one place a Workload becomes one). The precision is the one
    the stack computes in after its casts (estimator.regimes: FSDP mixed precision and DeepSpeed's
    half module compute in half with no autocast casts)."""
    rg = regime(w)
    precision = rg.activation_precision
    roles, adapters, dora_outs, experts = ((), 0, (), ())
    if w.method in ("lora", "qlora"):
        roles, adapters = trained_roles(w.model, w.lora_targets)   # the roles peft's matching gives adapters
        experts = expert_targets(w.model, w.lora_targets)
        if w.dora:
            dora_outs = dora.per_layer_outs(w.model, w.lora_targets)
    return ActivationKey(w.model, w.method, precision, w.attn, roles, w.lora_rank, w.quant,
                         w.grad_ckpt, w.seq, w.training, precision.startswith("amp-"),
                         rg.activation_kbit, rg.adapter_compute_bytes, rg.liger, adapters, w.loss, dora_outs,
                         experts, w.padding_mask, w.lora_dropout and w.method in ("lora", "qlora"), w.te_fp8)


def dora_dtypes(key: ActivationKey) -> dora.DoraDtypes:
    """The dtypes of DoRA's tensors (estimator.dora) under `key`'s precision and stack."""
    dt = dtypes(key)
    return dora.dtypes_of(dt.autocast, key.quant != "none", key.adapter_bytes, dt.compute, dt.linear_out, key.amp)


def _dora_bytes(key: ActivationKey) -> float:
    """DoRA, per token and layer: each adapted linear keeps its base and adapter outputs (estimator.dora)."""
    if not key.dora:
        return 0.0
    total, o_proj = key.dora
    dt = dora_dtypes(key)
    return (total - o_proj) * dora.saved_bytes_per_out(dt, "") + o_proj * dora.saved_bytes_per_out(dt, "o_proj")


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element: `compute` (matmuls), `residual` (the residual stream), `linear_out` (the
    output of the model's linears); `autocast` when autocast runs."""

    compute: int
    residual: int
    linear_out: int
    autocast: bool


def dtypes(key: ActivationKey) -> Dtypes:
    """The three activation dtypes (bytes per element) and whether autocast runs."""
    return _dtypes(key.precision, key.training and key.kbit_prep)


@lru_cache(maxsize=64)
def _dtypes(precision: str, kbit: bool) -> Dtypes:
    """`kbit`: peft's kbit preparation ran (fp32 embedding and norms, under autocast)."""
    compute = int(dtype_bytes(precision.removeprefix("amp-")))
    amp = precision.startswith("amp-")
    residual = 4 if (amp or kbit or compute == 4) else compute
    return Dtypes(compute, residual, 4 if kbit else compute, amp or kbit)


def _trains(key: ActivationKey, role: str) -> bool:
    """Whether `role`'s weight (full) or an adapter on it (LoRA/QLoRA) trains."""
    if key.method == "full":
        return True
    return key.method in ("lora", "qlora") and role in key.lora_targets


def _input_bytes(key: ActivationKey, dt: Dtypes, roles, x_bytes: int, saved: bool = False) -> int:
    """Bytes per element saved for the linears in `roles` reading one tensor of `x_bytes`;
    `saved` when that tensor is already saved by something else."""
    readers = _readers(key, roles)
    if readers == 0:
        return 0
    if key.method == "full":
        if key.te and (roles != ("lm_head",) or te_head_converted(key.model)):
            return readers * TE_SAVED_INPUT_BYTES   # each te.Linear's column-wise fp8 copy (estimator.fp8)
        if dt.autocast and x_bytes != dt.compute:
            return readers * dt.compute       # each linear saves its own autocast cast
        return 0 if saved else x_bytes       # the tensor itself, once
    if key.lora_dropout:
        # peft: lora_A(dropout(x)) per adapter: lora_A saves the dropped-out copy (under autocast its
        # half cast of it), native_dropout a 1-byte bool mask; x itself is no adapter's any more
        return readers * ((dt.compute if dt.autocast else key.adapter_bytes) + 1)
    if dt.autocast:
        return readers * dt.compute           # adapter casts to fp32, autocast back to half
    if x_bytes == key.adapter_bytes:
        return 0 if saved else x_bytes        # adapters in the input's dtype: the tensor itself
    return readers * key.adapter_bytes        # each adapter's cast to its dtype (peft: fp32)


def _readers(key: ActivationKey, roles) -> int:
    """How many trained linears (or adapters) among `roles` read their shared input: q, k and v are
    one linear in a fused-QKV model, gate and up in a fused gate/up one."""
    readers = sum(_trains(key, role) for role in roles)
    if key.model.model_type in _FUSED_QKV and set(roles) >= {"q_proj", "k_proj", "v_proj"}:
        readers -= sum(_trains(key, role) for role in ("k_proj", "v_proj"))   # q, k, v are one linear
    if key.model.model_type in _FUSED_GATE_UP and set(roles) >= {"gate_proj", "up_proj"}:
        readers -= _trains(key, "up_proj")                                   # gate and up are one linear
    return readers


def _dropout(spec: ModelSpec, where: str) -> bool:
    return where in _DROPOUT.get(spec.model_type, ())


def norm_bytes(key: ActivationKey, trains: bool) -> int:
    """Saved by one norm over the hidden width, per token (its output excluded)."""
    spec, dt = key.model, dtypes(key)
    hidden = spec.hidden_size
    if spec.norm == "layer":
        return dt.residual * hidden + 8
    if spec.norm == "layer_nobias":    # CohereLayerNorm in fp32 ops: x - mean twice (pow, mul), rsqrt; normalized x for the weight
        return 8 * hidden + 4 + (4 * hidden if trains else 0)
    if spec.norm == "layer_noparam":   # OlmoLayerNorm: F.layer_norm(x.float()) saves the fp32 input, mean, rstd
        return 4 * hidden + 8
    if key.liger:    # Liger's RMSNorm saves its input as it comes and an fp32 rstd (ops/rms_norm.py)
        return dt.residual * hidden + 4
    if spec.model_type.startswith("gemma") or spec.model_type in _FP32_NORM_WEIGHT:
        return 4 * hidden + 4 + (4 * hidden if trains else 0)
    return 4 * hidden + 4 + (dt.residual * hidden if trains else 0)


def _inner_norm(key: ActivationKey, dt: Dtypes, width: int) -> int:
    """An RMSNorm inside attention (MLA's q_a/kv_a norms) over a linear's output: its fp32 input,
    an fp32 rsqrt, and the normalized tensor when the weight trains (full fine-tune). Liger's
    RMSNorm (DeepSeek's q_a/kv_a norms are patched too) saves its input as it comes and the rsqrt."""
    if key.liger:
        return dt.linear_out * width + 4
    return 4 * width + 4 + (dt.linear_out * width if key.method == "full" else 0)


def _mla_attention(key: ActivationKey, dt: Dtypes) -> int:
    """DeepSeek's latent attention per token (transformers 5.23 DeepseekV2/V3Attention): the q_a and
    kv_a norms and the inputs of q_b_proj and kv_b_proj, the query built by `cat` and the keys by
    `new_empty` + copies (both heads x (nope + rope)), then per kernel:
    - SDPA: the values are a view of kv_b_proj's output (k_nope and v, all kept); with narrower value
      heads CUDA runs the memory-efficient kernel (flash refuses unequal head dims), whose output
      is laid out (batch, token, head) so o_proj reads a view of it; with equal head dims the
      flash kernel's output follows the query (contiguous per head) and o_proj reads a copy;
    - flash_attention_2 (integrations/flash_attention.py): the values padded to the query's head
      dim (a new tensor), the padded output, cropped and copied for o_proj;
    - eager: q, k, the values' storage (kv_b_proj's output), the output copied for o_proj.
    SDPA and flash keep an fp32 log-sum-exp per head."""
    spec, c = key.model, dt.compute
    norm_out = 4 if dt.autocast and dt.residual == 4 else dt.linear_out
    total = 0
    if spec.q_lora_rank:
        total += _inner_norm(key, dt, spec.q_lora_rank)
        total += _input_bytes(key, dt, ("q_b_proj",), norm_out) * spec.q_lora_rank
    total += _inner_norm(key, dt, spec.kv_lora_rank)
    total += _input_bytes(key, dt, ("kv_b_proj",), norm_out) * spec.kv_lora_rank
    expanded = spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim)
    total += c * 2 * spec.q_dim                                       # query, keys
    if key.attn == "flash":
        total += c * 2 * spec.q_dim + 4 * spec.num_heads              # padded values, padded output, lse
        copy = True
    elif key.attn == "eager":
        total += c * expanded                                         # values: a view of kv_b_proj's output
        copy = True
    else:
        total += c * (expanded + spec.o_dim) + 4 * spec.num_heads     # values' storage, output, lse
        copy = spec.qk_nope_head_dim + spec.qk_rope_head_dim == spec.v_head_dim
    total += _input_bytes(key, dt, ("o_proj",), c, saved=not copy) * spec.o_dim
    if spec.qk_norm:
        raise AssertionError("MLA has no q/k norms")
    return total


def _attention_input_roles(spec: ModelSpec) -> tuple[str, ...]:
    """The linears reading the attention's normed input."""
    if spec.is_mla:
        return ("q_a_proj" if spec.q_lora_rank else "q_proj", "kv_a_proj_with_mqa")
    return ("q_proj", "k_proj", "v_proj")


def _attention(key: ActivationKey, dt: Dtypes) -> int:
    """Saved by attention per token besides its input norm (scores excluded: `score_bytes_...`)."""
    spec = key.model
    if spec.is_mla:
        return _mla_attention(key, dt)
    compute, q_dim, kv_dim = dt.compute, spec.q_dim, spec.kv_dim
    if key.attn == "eager":
        k_saved = q_dim if spec.num_kv_heads != spec.num_heads else kv_dim   # repeat_kv copies
        core = compute * (q_dim + 2 * k_saved)
        copy = True
    else:
        core = compute * (q_dim + 2 * kv_dim) + compute * q_dim + 4 * spec.num_heads   # q, k, v, output, lse
        copy = key.attn == "sdpa" and spec.model_type in _PARTIAL_ROTARY
    if spec.attn_output_gate:
        # Qwen3-Next: the output (copied contiguous) times sigmoid(gate): both saved; o_proj reads the product
        total = core + 2 * compute * q_dim + _input_bytes(key, dt, ("o_proj",), compute) * q_dim
    else:
        total = core + _input_bytes(key, dt, ("o_proj",), compute, saved=not copy) * q_dim
    if spec.model_type in _QKV_VIEW_VALUES:
        total += dt.linear_out * (q_dim + kv_dim)     # the qkv output's query and key parts
    if spec.qkv_clip:
        # OlmoAttention clamps q, k and v in place (clamp_): autograd keeps a copy of each as it was
        total += dt.linear_out * (q_dim + 2 * kv_dim)
    if spec.model_type in _FP32_QK_EAGER and key.attn == "eager" and not dt.autocast:
        # GPTJAttention._attn: query.to(float32), key.to(float32) before the score matmul, which saves
        # them (the sin/cos tables its rotary saves, 4 x rotary_dim per token, are not counted); under
        # autocast (AMP, kbit preparation) the matmul casts them back and saves those half casts
        total += (4 - compute) * (q_dim + kv_dim)
    if spec.qk_norm and spec.model_type in _PER_HEAD_LAYERNORM:
        # StableLmLayerNormPerHead: nn.LayerNorm per head over split views of q/k_proj's output (kept
        # whole) with an fp32 mean and rstd per head; the normalized heads are a new tensor (cat)
        total += dt.linear_out * (q_dim + kv_dim) + 8 * (spec.num_heads + spec.num_kv_heads)
    elif spec.qk_norm and spec.norm == "layer_nobias":
        # Cohere's q/k norms are CohereLayerNorm over each head (norm_bytes: x - mean computed twice
        # in fp32, an fp32 rsqrt per head row, the fp32 normalized heads when the weight trains)
        total += 8 * (q_dim + kv_dim) + 4 * (spec.num_heads + spec.num_kv_heads) \
            + (4 * (q_dim + kv_dim) if key.method == "full" else 0)
    elif spec.qk_norm and key.liger and spec.model_type in _LIGER_QK_NORM:
        # Liger patches the q/k RMSNorms too (liger-kernel 0.8.5 monkey_patch.py, Qwen3, Gemma-3): each
        # saves its input as it comes and an fp32 rstd per row
        heads = 1 + 1 if spec.qk_norm_full else spec.num_heads + spec.num_kv_heads
        total += dt.linear_out * (q_dim + kv_dim) + 4 * heads
    elif spec.qk_norm:
        heads = 1 + 1 if spec.qk_norm_full else spec.num_heads + spec.num_kv_heads  # rsqrt rows
        normed = 4 if spec.model_type in _FP32_NORM_WEIGHT else dt.residual
        total += 4 * (q_dim + kv_dim) + 4 * heads + (normed * (q_dim + kv_dim) if key.method == "full" else 0)
    if spec.qk_l2_norm_layers:
        # Llama4TextL2Norm on the rotary layers: x.float() saved (pow, mul) and an fp32 rsqrt per head
        # row; averaged over the layers
        per_layer = 4 * (q_dim + kv_dim) + 4 * (spec.num_heads + spec.num_kv_heads)
        total += round(per_layer * spec.qk_l2_norm_layers / spec.num_layers)
    if _dropout(spec, "resid"):
        total += spec.hidden_size
    return total


_DELTA_CHUNK = 64   # torch_chunk_gated_delta_rule's chunk_size (transformers 5.23 Qwen3-Next)


def _linear_attention(key: ActivationKey, dt: Dtypes) -> float:
    """Saved per token by one Qwen3-Next gated delta-net layer besides its input (transformers 5.23
    Qwen3NextGatedDeltaNet with the torch fallbacks `causal_conv1d_fn` and
    `torch_chunk_gated_delta_rule`, which run wherever flash-linear-attention is not installed),
    counted from the autograd graph of one layer (tensor by tensor; sequences padded to a multiple
    of the 64-token chunk, `Tp`), with nv value heads of dk/dv dims:
    - the depthwise conv: its input and its padded output (silu's input), compute dtype;
    - fp32 per padded token: five chunk x chunk tensors per head (decay products, the triangular
      system, the intra-chunk attention), six key-wide (k, k_beta, decayed keys, chunk views) and
      three value-wide ones (v_beta, the solved values, the per-chunk corrections); four per-head
      scalars (beta, decay, their cumulative forms);
    - fp32 per token: q and k before their L2 norm, the gated RMSNorm's input, gate and silu (three
      value-wide), five per-head scalars (softplus input, beta, ...); compute dtype: the norm's two
      products (one only when its weight trains), beta's sigmoid; the recurrent state before each
      chunk (fp32, heads x dk x dv per 64 tokens);
    - out_proj's input when it trains (or its adapter's cast), the softplus output when A_log trains."""
    spec, c = key.model, dt.compute
    seq = max(key.seq, 1)
    padded = -(-seq // _DELTA_CHUNK) * _DELTA_CHUNK / seq
    nv, dk, dv = spec.linear_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
    full = key.method == "full"
    total = c * spec.linear_conv_dim * (1 + (seq + spec.linear_conv_kernel - 1) / seq)
    total += padded * 4 * nv * (5 * _DELTA_CHUNK + 6 * dk + 3 * dv + 4)
    total += 4 * nv * (2 * dk + 3 * dv + 5) + c * nv * (dv * (2 if full else 1) + 1) + (4 * nv if full else 0)
    total += padded * 4 * nv * dk * dv / _DELTA_CHUNK
    total += _input_bytes(key, dt, ("out_proj",), c) * spec.linear_value_dim
    return total


def _softmax_bytes(spec: ModelSpec, dt: Dtypes) -> int:
    """Bytes per score of the eager softmax output: fp32 unless the model calls a plain softmax
    outside autocast, or asks for the hidden states' dtype (Falcon: `F.softmax(..., dtype=
    hidden_states.dtype)`, which autocast leaves alone: the residual stream's dtype)."""
    if spec.model_type in _SOFTMAX_HIDDEN_DTYPE:
        return dt.residual
    return dt.compute if (spec.model_type in _PLAIN_SOFTMAX and not dt.autocast) else 4


def score_bytes_per_token(key: ActivationKey, kv_tokens: int) -> int:
    """Eager attention's saved scores per query token: softmax output (fp32 unless the model calls
    a plain softmax outside autocast), the half cast the value matmul reads, dropout mask and
    output when attention dropout is on, Gemma-2's soft-capping tanh."""
    if key.attn == "sdpa":
        return _sliding_mask_bytes(key, kv_tokens)
    if key.attn != "eager":
        return 0
    spec, dt = key.model, dtypes(key)
    softmax = _softmax_bytes(spec, dt)
    per_key = softmax
    if _dropout(spec, "attn"):
        per_key += 1 + dt.compute
    elif softmax != dt.compute:
        per_key += dt.compute
    if eager_softcap(spec):
        per_key += dt.compute
    return per_key * spec.num_heads * kv_tokens


def _sliding_mask_bytes(key: ActivationKey, kv_tokens: int) -> int:
    """SDPA on a sliding layer once the keys reach the window (masking_utils skips the mask only below
    it), or on every attention layer of a padded batch (`padding_mask`: a zero in attention_mask): the
    4-D mask goes to the kernel, CUDA's memory-efficient kernel saves it converted to the compute dtype
    (one row of kv_tokens per query, made per layer), and transformers repeats k and v to every head
    (`use_gqa_in_sdpa` needs no mask; a copy unless there is one kv head). Averaged over the layers,
    as the layer formulas."""
    spec = key.model
    per_layer, layers = _sdpa_mask_layer_bytes(key, kv_tokens)
    return round(per_layer * layers / spec.num_layers)


def sdpa_mask_layers(spec: ModelSpec, padding_mask: bool, kv_tokens: int) -> tuple[int, int]:
    """(full-attention layers, sliding layers) whose SDPA call gets a 4-D mask instead of is_causal
    alone: every attention layer of a padded batch (a zero in attention_mask; transformers 5.x
    masking_utils `_ignore_causal_mask_sdpa`, and 4.x `_update_causal_mask`) or of a model that always
    builds one (`_ALWAYS_4D_MASK`), else the sliding layers once the keys reach the window
    (`kv_length >= local_attention_size`). The one owner of this rule: the memory (the converted
    mask, the repeated keys and values) and the time (estimator.compute_time: every key computed,
    the mask read) both call it."""
    full, sliding = spec.window_layers
    if padding_mask or spec.model_type in _ALWAYS_4D_MASK:
        return full, sliding
    if sliding and kv_tokens >= spec.sliding_window:
        return 0, sliding
    return 0, 0


def eager_softcap(spec: ModelSpec) -> bool:
    """Eager attention soft-caps the scores (Gemma-2: divide, tanh, multiply before the mask)."""
    return spec.model_type in _ATTN_SOFTCAP


def _sdpa_mask_layer_bytes(key: ActivationKey, kv_tokens: int) -> tuple[int, int]:
    """(bytes per query token on one layer whose SDPA call gets a 4-D mask: the mask row converted
    to the compute dtype and k and v repeated to every head, the number of such layers)
    (`_sliding_mask_bytes`)."""
    spec = key.model
    layers = sum(sdpa_mask_layers(spec, key.padding_mask, kv_tokens))
    if not layers:
        return 0, 0
    compute = dtypes(key).compute
    # repeat_kv expands then reshapes: with one kv head the reshape is a view of the keys and values
    repeated = 0 if spec.num_kv_heads == 1 else 2 * compute * (spec.q_dim - spec.kv_dim)
    return compute * kv_tokens + repeated, layers


def _activation_saves(spec: ModelSpec, dt: Dtypes) -> tuple[int, int, bool]:
    """(bytes per intermediate element the activation function saves, bytes of its output,
    whether that output is among what it saves)."""
    out = dt.linear_out
    if spec.activation == "gelu_new":
        if dt.autocast:       # 0.5 x; pow saves its fp32 (cast) input; tanh, 1 + tanh in fp32
            return out + 4 + 4 + 4, 4, False
        return 4 * out, out, False                   # input, 0.5 x, tanh, 1 + tanh
    if spec.activation == "relu":
        return out, out, True                        # relu saves its output only
    if spec.activation == "gpt_oss_swiglu":
        # gate and up are strided views of one gate_up output (2 x width, saved by both clamps);
        # the clamped gate, its sigmoid, the gated product and up + 1: 4 more per width
        return 4 * out, out, False
    return out, out, False                           # input only (silu, gelu, gelu_pytorch_tanh)


def _mlp(key: ActivationKey, dt: Dtypes, width: int) -> int:
    """Saved by one feed-forward block per token (its input excluded). Liger's fused SwiGLU/GeGLU
    (dense MLPs) saves gate and up only and recomputes the activation in its backward."""
    saves, out, out_saved = _activation_saves(key.model, dt)
    if key.model.mlp_gated:
        if key.liger:   # dense MLPs and shared experts (liger_kernel ops/swiglu.py: save_for_backward(a, b))
            saves = 0
        saved = (saves + 2 * dt.linear_out) * width   # gate (+ activation internals), act, up
        return saved + _input_bytes(key, dt, ("down_proj",), dt.linear_out) * width
    return saves * width + _input_bytes(key, dt, ("down_proj",), out, saved=out_saved) * width


def _moe(key: ActivationKey, dt: Dtypes) -> int:
    """Saved by one MoE block per token (its input excluded)."""
    spec = key.model
    if spec.model_type in _DENSE_EXPERTS:
        return _dense_experts(key, dt)
    compute, hidden, chosen, width = dt.compute, spec.hidden_size, spec.experts_per_token, spec.moe_intermediate_size
    if _liger_moe(key):
        # LigerFusedMoEFunction saves its input (the block input, beside the router's), the fused
        # gate/up output (recomputing the activation), the flat routing weights and three int32
        # permutations per routed row (liger-kernel 0.8.5 ops/fused_moe.py save_for_backward)
        itself = _input_bytes(key, dt, ("gate_proj", "up_proj"), dt.residual) == dt.residual and not dt.autocast
        block_input = 0 if itself else dt.residual * hidden
        weights = 4 if _fp32_routing_weights(spec.model_type) else compute
        return block_input + chosen * (2 * compute * width + weights + 3 * 4) + _router(key, dt) + _shared_expert(key, dt)
    saves = _activation_saves(spec, dt)[0]
    # per chosen expert (grouped_mm): gate/up output, activation, product; a grouped_mm saves its input
    # when its weight requires grad: the full fine-tune's, or a LoRA on the fused parameter (peft's
    # ParamWrapper adds the delta weight to it, so the parameter's gradient flows)
    experts = chosen * (saves + 2 * dt.linear_out) * width
    if key.method == "full" or "down_proj" in key.expert_adapters:
        experts += chosen * dt.linear_out * width                          # the product, down_proj's input
    if key.method == "full" or "gate_up_proj" in key.expert_adapters:
        experts += chosen * compute * hidden                               # the routed input
    experts += chosen * compute * hidden                                  # expert outputs x routing weights
    return experts + _router(key, dt) + _shared_expert(key, dt)


def _shared_expert(key: ActivationKey, dt: Dtypes) -> int:
    """Saved by a MoE block's shared expert per token (0 without one): a gated MLP, and with a gate
    its output times the sigmoid of the gate."""
    spec = key.model
    if not spec.shared_expert_intermediate_size:
        return 0
    shared = _mlp(key, dt, spec.shared_expert_intermediate_size)
    if spec.shared_expert_gate:
        shared += dt.compute * spec.hidden_size + dt.compute        # shared output x sigmoid(gate)
    return shared


def _fp32_routing_weights(model_type: str) -> bool:
    """The routing weights stay fp32 (an fp32 router that does not cast them back)."""
    return model_type in _FP32_ROUTER and model_type not in _FP32_ROUTER_WEIGHT


def _liger_moe(key: ActivationKey) -> bool:
    """Liger's fused MoE runs this model's experts (training with Liger on a `_LIGER_FUSED_MOE` type)."""
    return key.liger and key.training and key.model.is_moe and key.model.model_type in _LIGER_FUSED_MOE


def expert_adapter_gradient_bytes(key: ActivationKey) -> int:
    """A LoRA on fused expert parameters (peft's ParamWrapper: the grouped_mm reads W + delta): the
    grouped_mm's backward makes the gradient of that weight, a whole expert parameter in its dtype,
    which the delta's backward reads before it is freed: down_proj's, the first the backward
    reaches with the whole layer's saved tensors alive (gate_up_proj's when only it is adapted).
    Liger's fused MoE makes both at once (`liger_moe_weight_gradient_bytes`)."""
    if (not key.expert_adapters or not key.training or _liger_moe(key)
            or key.model.model_type in _DENSE_EXPERTS):
        return 0
    spec = key.model
    width = spec.moe_intermediate_size * (1 if "down_proj" in key.expert_adapters else 2)
    return dtypes(key).compute * spec.num_experts * spec.hidden_size * width


def dense_experts_weight_gradient_bytes(key: ActivationKey) -> int:
    """Llama-4's MoE block trained (full fine-tune), at its experts' down_proj bmm backward: the
    shared expert's weight gradients (its branch's backward ran first) and the experts' down_proj
    gradient the bmm makes, in the parameter dtype. 0 otherwise."""
    if key.method != "full" or not key.training or not dense_experts(key.model):
        return 0
    spec = key.model
    weight = 4 if _fp32_weights(key) else dtypes(key).compute
    shared = 3 * spec.hidden_size * spec.shared_expert_intermediate_size
    return weight * (spec.num_experts * spec.hidden_size * spec.moe_intermediate_size + shared)


def dense_experts_routed_bytes_per_token(key: ActivationKey) -> int:
    """Llama-4's MoE forward, while the shared expert runs (transformers 5.23 Llama4TextMoe.forward):
    the routed output (one hidden row per expert) and, where the experts' weights do not train, the
    scaled input, which only their weight gradient would have saved. 0 for other architectures."""
    if not key.training or not dense_experts(key.model):
        return 0
    spec, dt = key.model, dtypes(key)
    scaled = 0 if key.method == "full" else dt.residual * spec.hidden_size
    return spec.num_experts * (dt.compute * spec.hidden_size + scaled)


def liger_moe_weight_gradient_bytes(key: ActivationKey) -> int:
    """Liger's fused MoE backward makes both expert weight gradients (`zeros_like(down_proj)`,
    `zeros_like(gate_up_proj)`, liger-kernel 0.8.5 ops/fused_moe.py) whether the experts train or
    not: frozen experts (LoRA, QLoRA) pay a whole layer's expert weights, in their dtype (fp32
    after kbit preparation or under AMP), at each MoE layer's backward. 0 otherwise (a full
    fine-tune's are its gradients). A LoRA on the fused expert parameters (peft's ParamWrapper)
    receives them too: its backward reads them before they are freed."""
    if not _liger_moe(key) or key.method == "full":
        return 0
    spec = key.model
    weight = 4 if (_fp32_weights(key) or key.kbit_prep) else dtypes(key).compute
    return weight * spec.num_experts * spec.hidden_size * 3 * spec.moe_intermediate_size


def dense_experts(spec: ModelSpec) -> bool:
    """Every expert runs every token through torch.bmm on its parameters (Llama-4)."""
    return spec.is_moe and spec.model_type in _DENSE_EXPERTS


def _dense_experts(key: ActivationKey, dt: Dtypes) -> int:
    """Llama-4's MoE block per token (transformers 5.23 Llama4TextMoe): every expert runs every
    token, pre-scaled by its router score (zero off the top-k): the input repeated once per expert
    times the scores' column (both saved by the product), the scaled input (for gate_up_proj's
    gradient, full fine-tune), then per expert a gated MLP by torch.bmm: the gate/up output (kept
    by the activation and the product), the activation and the product (down_proj's gradient, full
    fine-tune). Llama4Router: an nn.Linear whose top-k values are scattered into a -inf row, then an
    fp32 sigmoid (saved output) cast back; topk and scatter keep their int64 indices. The shared
    expert is a plain gated MLP."""
    spec = key.model
    c, hidden, experts, width = dt.compute, spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    full = key.method == "full"
    # the experts' bmm outputs the compute dtype under autocast (a kbit-prepared model's linears fp32)
    saves = _activation_saves(spec, replace(dt, linear_out=c))[0]
    routed = experts * ((saves + 2 * c) * width + (c * width if full else 0))
    # the repeated input has the hidden states' dtype (fp32 under AMP or kbit preparation)
    routed += experts * (dt.residual * hidden + c) + (experts * c * hidden if full else 0)
    router = 4 * experts + 2 * _INDEX_BYTES * spec.experts_per_token
    return routed + router + _mlp(key, dt, spec.shared_expert_intermediate_size)


def _router(key: ActivationKey, dt: Dtypes) -> int:
    """The router's saved tensors per token: fp32 scores (softmax or sigmoid output), int64 top-k
    and sorting indices (4 per choice), the routing weight per choice. fp32 routers save their
    fp32 input cast when the router weight trains, keep fp32 routing weights (ERNIE casts them
    back) and, renormalising in place (sigmoid routers), a clone of the weights and the sum."""
    spec, chosen = key.model, key.model.experts_per_token
    mt = spec.model_type
    if _liger_moe(key):
        # Liger's fused MoE takes the top-k indices and weights as they come (its own int32 routing):
        # the scores and the int64 top-k indices only; its flat weights are counted with it (`_moe`)
        total = 4 * spec.num_experts + _INDEX_BYTES * chosen
        if mt in _FP32_ROUTER and _trains(key, "router"):
            total += 4 * spec.hidden_size
        if mt in _SIGMOID_ROUTER:
            total += 4 * chosen + 4
        return total
    if mt not in _FP32_ROUTER:
        return 4 * spec.num_experts + (4 * _INDEX_BYTES + dt.compute) * chosen
    total = 4 * spec.num_experts + 4 * _INDEX_BYTES * chosen
    total += (dt.compute if mt in _FP32_ROUTER_WEIGHT else 4) * chosen
    if _trains(key, "router"):
        total += 4 * spec.hidden_size
    if mt in _SIGMOID_ROUTER:
        total += 4 * chosen + 4
    return total


def layer_fixed_bytes(key: ActivationKey) -> int:
    """Bytes one decoder layer saves whatever the token count: an fp32 router's fp32 cast of its
    half-precision weight (experts x hidden), saved for the input gradient (training); DoRA's three
    vectors per adapted linear (the weight norm, mag_norm_scale and mag_norm_scale - 1); a LoRA on
    fused expert parameters: the parametrized weight W + delta (peft 0.21.2 ParamWrapper through
    torch.nn.utils.parametrize, in the parameter's dtype), which the grouped_mm saves, and the
    half-precision casts of fp32 adapters the delta's matmul saves."""
    fixed = round(3 * key.adapter_bytes * key.dora[0]) if key.dora else 0
    return fixed + _router_weight_cast(key) + _expert_delta_weights(key) + int4_dequantized_bytes_per_layer(key)


def int4_dequantized_bytes_per_layer(key: ActivationKey) -> int:
    """LoRA on a GPTQ base: the dequantized copies of the quantized linears' weights saved for the
    backward, mean bytes per decoder layer. Training runs gptqmodel's trainable kernels (GPTQConfig
    backend "auto_trainable": TritonV2Linear, whose training forward is TorchLinear's, or TorchLinear;
    ModelCloud/GPTQModel f4c327a1 gptqmodel/nn_modules/qlinear/torch.py `_forward_eager`): every forward
    dequantizes the whole weight to the input's half dtype, [in, out], and `torch.matmul(x, weights)`
    saves it for the input's gradient (the weight needs none, so the input is not saved). The backward
    does not dequantize again. A linear whose input needs no gradient saves nothing: without
    checkpointing, the first layer's linears before its first adapter, which read the frozen
    embedding's output (`_first_layer_gradless_inputs`)."""
    if key.quant != "gptq" or not key.training:
        return 0
    spec = key.model
    linears = count_params(spec).dense_linears
    total = sum(lin.weight_params for lin in linears)
    first = 0 if key.grad_ckpt else sum(lin.d_in * lin.d_out for lin in linears
                                        if lin.role in _first_layer_gradless_inputs(key))
    return dtypes(key).compute * (total - first) // spec.num_layers


def _first_layer_gradless_inputs(key: ActivationKey) -> set[str]:
    """The first layer's linears whose input needs no gradient under LoRA with a frozen embedding:
    the attention's inputs; its output projection unless an adapter reads the attention's input; the
    MLP's inputs unless an attention adapter trains before them (a parallel block's always: they read
    the layer's normed input); down_proj unless something before it trains."""
    spec = key.model
    attention_in = set(_attention_input_roles(spec))
    attention_trains = any(_trains(key, r) for r in attention_in)
    roles = set(attention_in) | (set() if attention_trains else {"o_proj"})
    mlp_in = {"gate_proj", "up_proj"}
    if spec.parallel_block or not (attention_trains or _trains(key, "o_proj")):
        roles |= mlp_in
        if not any(_trains(key, r) for r in mlp_in):
            roles.add("down_proj")
    return roles


def _expert_delta_weights(key: ActivationKey) -> int:
    spec = key.model
    if not key.expert_adapters or not key.training:
        return 0
    shapes = {"gate_up_proj": 2 * spec.moe_intermediate_size, "down_proj": spec.moe_intermediate_size}
    per_layer = sum(shapes[p] for p in key.expert_adapters) * spec.hidden_size * spec.num_experts
    if key.adapter_bytes != dtypes(key).compute:
        # peft's fp32 lora_A and lora_B cast to the weight's dtype for the delta, which its matmul
        # saves: experts x rank x (in + out) each (gate_up_proj's rank doubled)
        ranks = {"gate_up_proj": 2 * key.lora_rank, "down_proj": key.lora_rank}
        per_layer += sum(ranks[p] * (spec.hidden_size + shapes[p]) for p in key.expert_adapters) * spec.num_experts
    return dtypes(key).compute * per_layer * spec.num_moe_layers // spec.num_layers   # mean per layer


def _router_weight_cast(key: ActivationKey) -> int:
    spec = key.model
    if not key.training or not spec.is_moe or spec.model_type not in _FP32_ROUTER \
            or spec.model_type in _FP32_ROUTER_WEIGHT or _fp32_weights(key):
        return 0
    return 4 * spec.num_experts * spec.hidden_size * spec.num_moe_layers // spec.num_layers   # mean per layer


def _fp32_weights(key: ActivationKey) -> bool:
    """Whether the weights already are fp32 (fp32 or AMP: `.float()` is a no-op)."""
    return dtypes(key).compute == 4 or key.amp


def layer_bytes_per_token(key: ActivationKey) -> int:
    """Bytes saved for backward by one decoder layer per token (no checkpointing, no scores)."""
    spec = key.model
    dt, hidden = dtypes(key), spec.hidden_size
    trains = key.method == "full"
    total = spec.norms_per_layer * norm_bytes(key, trains)
    if spec.parallel_block and spec.norms_per_layer > 1 and spec.norm == "layer":
        # two LayerNorms over the same input (GPT-NeoX's parallel residual): one saved input
        total -= (spec.norms_per_layer - 1) * dt.residual * hidden
    attn_roles, mlp_roles = _attention_input_roles(spec), ("gate_proj", "up_proj")
    if spec.parallel_block and spec.norms_per_layer == 1:     # one norm feeds attention and MLP
        total += _input_bytes(key, dt, attn_roles + mlp_roles, dt.residual) * hidden
    else:
        total += _input_bytes(key, dt, mlp_roles if spec.mlp_gated or spec.is_moe else ("up_proj",),
                              dt.residual) * hidden
        if spec.num_linear_layers:   # Qwen3-Next: gated delta-net and full-attention layers, averaged
            linear = _input_bytes(key, dt, ("in_proj_qkvz", "in_proj_ba"), dt.residual) * hidden \
                + _linear_attention(key, dt)
            softmax = _input_bytes(key, dt, attn_roles, dt.residual) * hidden + _attention(key, dt)
            total += round((spec.num_linear_layers * linear + spec.num_attention_layers * softmax) / spec.num_layers)
            return total + _feed_forward(key, dt) + _adapter_bytes(key, dt) + round(_dora_bytes(key))
        total += _input_bytes(key, dt, attn_roles, dt.residual) * hidden
    total += _attention(key, dt) + _feed_forward(key, dt)
    if _dropout(spec, "resid"):
        total += hidden                                       # the MLP output's dropout mask
    return total + _adapter_bytes(key, dt) + round(_dora_bytes(key))


def _shared_input_bytes(key: ActivationKey, dt: Dtypes, roles, x_bytes: int) -> int:
    """Bytes per element of the one tensor that two or more of the linears in `roles` save (the
    same storage saved more than once), 0 when each saves its own (autocast or adapter casts) or
    one linear reads it (`_input_bytes`' readers)."""
    readers = _readers(key, roles)
    if readers < 2 or dt.autocast or (key.method != "full" and key.lora_dropout):
        return 0
    if key.method == "full" or x_bytes == key.adapter_bytes:
        return x_bytes
    return 0


def offload_kept_bytes_per_token(key: ActivationKey) -> int:
    """Bytes per token of one decoder layer that TRL's activation offloading keeps on the device
    (profiler/offload.py: it offloads a storage at its first save and keeps a later save of it there
    while the first is still in its forward stash, a few saves on): an RMSNorm's fp32 input, which
    its pow and its mul both save (the q/k norms' too), and the normed hidden state when two or more
    linears save it (separate q/k/v or gate/up projections of a full fine-tune, adapters in the
    input's dtype)."""
    spec = key.model
    dt, hidden = dtypes(key), spec.hidden_size
    kept = 0
    if spec.norm not in ("layer", "layer_nobias", "layer_noparam"):
        if not key.liger:
            kept += spec.norms_per_layer * 4 * hidden
        if spec.qk_norm and spec.model_type not in _PER_HEAD_LAYERNORM \
                and not (key.liger and spec.model_type in _LIGER_QK_NORM):
            # the per-head (or whole-width) RMSNorm of q and k: its fp32 input too (Qwen3: the
            # H100's activation-offloaded full fine-tune measured these 12 KiB per token per layer)
            kept += 4 * (spec.q_dim + spec.kv_dim)
    attn_roles = _attention_input_roles(spec)
    mlp_roles = ("gate_proj", "up_proj") if (spec.mlp_gated or spec.is_moe) else ("up_proj",)
    if spec.parallel_block and spec.norms_per_layer == 1:
        return kept + _shared_input_bytes(key, dt, attn_roles + mlp_roles, dt.residual) * hidden
    return (kept + _shared_input_bytes(key, dt, attn_roles, dt.residual) * hidden
            + _shared_input_bytes(key, dt, mlp_roles, dt.residual) * hidden)


def mlp_bytes_per_token(key: ActivationKey) -> int:
    """The part of `layer_bytes_per_token` saved by the feed-forward block (dense or MoE) and its
    output dropout: the backward frees it before it reaches the attention."""
    spec, dt = key.model, dtypes(key)
    return _feed_forward(key, dt) + (spec.hidden_size if _dropout(spec, "resid") else 0)


def _feed_forward(key: ActivationKey, dt: Dtypes) -> int:
    """Saved by the feed-forward block per token, averaged over the layers: MoE layers and the
    dense ones (DeepSeek's `first_k_dense_replace`, Qwen-MoE's `mlp_only_layers`, ERNIE's interval)."""
    spec = key.model
    if not spec.is_moe:
        return _mlp(key, dt, spec.intermediate_size)
    moe_layers = spec.num_moe_layers
    if moe_layers == spec.num_layers:
        return _moe(key, dt)
    dense = _mlp(key, dt, spec.intermediate_size)
    if moe_layers == 0:
        return dense
    return round((moe_layers * _moe(key, dt) + (spec.num_layers - moe_layers) * dense) / spec.num_layers)


def attention_backward_bytes_per_token(key: ActivationKey, kv_tokens: int) -> int:
    """Extra bytes per query token at the peak of one layer's attention backward, beyond what the
    layer saved: eager softmax's backward holds the incoming gradient and its output in the
    softmax dtype (B x heads x T x T each) after the value matmul released the probabilities;
    the SDPA kernels write q, k and v gradients."""
    spec, dt = key.model, dtypes(key)
    if key.attn != "eager":
        return dt.compute * (spec.q_dim + spec.kv_dim + spec.v_dim)
    softmax = _softmax_bytes(spec, dt)
    probs = dt.compute if not _dropout(spec, "attn") else 1 + dt.compute
    return (2 * softmax - probs) * spec.num_heads * kv_tokens


def moe_backward_bytes_per_token(key: ActivationKey) -> int:
    """Extra bytes per token at the peak of one MoE block's backward, beyond what the layer saved:
    the grouped experts (transformers 5.23 integrations/moe.py `grouped_mm_experts_forward`) weight
    each routed row, reorder the rows and sum them; the backward of those steps holds four
    (tokens x chosen, hidden) gradients at once, in the routing weights' dtype (fp32 for an fp32
    router: the product is promoted), while two such tensors the block saved in the compute dtype
    are already released (the fake-tensor trace of DeepSeek-V3's block, full and LoRA)."""
    spec = key.model
    if not spec.is_moe or not spec.num_moe_layers:
        return 0
    if _liger_moe(key):
        # Liger's backward (ops/fused_moe.py): the gate/up gradient, the weighted activation, the
        # routing weights' gradient, the routed rows' input gradient and the summed input gradient
        # (the weight gradients: `liger_moe_weight_gradient_bytes`)
        compute, chosen = dtypes(key).compute, spec.experts_per_token
        return compute * (chosen * (3 * spec.moe_intermediate_size + spec.hidden_size + 1) + spec.hidden_size)
    compute = dtypes(key).compute
    if dense_experts(spec):
        # Llama4TextExperts (transformers 5.23), per expert row: the down_proj bmm's backward holds the
        # routed output's gradient (materialised from the sum's expanded gradient) and makes the
        # product's gradient; with frozen experts `up * act(gate)`'s backward then makes the
        # gradients of up and of act(gate) while the product's is alive and the routed output's is
        # gone: whichever is larger (the second wherever the expert width exceeds the hidden size;
        # the fake-tensor trace of Llama-4 Maverick's block, LoRA), plus the layer's incoming
        # residual gradient. Trained experts peak later, at gate_up_proj's weight gradient
        # (`dense_experts_weight_gradient_bytes` and the gradients the states count).
        hidden, width = spec.hidden_size, spec.moe_intermediate_size
        per_expert = hidden + width if key.method == "full" else max(hidden + width, 3 * width)
        return compute * (spec.num_experts * per_expert + hidden)
    return (4 * (4 if _fp32_routing_weights(spec.model_type) else compute) - 2 * compute) * spec.experts_per_token * spec.hidden_size


def top_layer_backward_bytes_per_token(key: ActivationKey, kv_tokens: int) -> int:
    """One layer at the peak of its backward, per token: its saved tensors and the MoE backward's
    gradients, or (later) the attention backward once the feed-forward block's tensors are freed."""
    layer = layer_bytes_per_token(key) + score_bytes_per_token(key, kv_tokens)
    attention = layer - mlp_bytes_per_token(key) + attention_backward_bytes_per_token(key, kv_tokens)
    return max(attention, layer + moe_backward_bytes_per_token(key), layer + _liger_mlp_backward_bytes(key))


def _liger_mlp_backward_bytes(key: ActivationKey) -> int:
    """Liger's SwiGLU/GeGLU backward, beyond the layer's saved tensors, per token: the incoming
    residual gradient and the down projection's input gradient (its kernels write the gate and up
    gradients into the saved inputs in place: liger-kernel 0.8.5 ops/swiglu.py, ops/geglu.py).
    0 without Liger, for MoE and ungated MLPs (the loss or the attention set that peak)."""
    spec = key.model
    if not key.liger or spec.is_moe or not spec.mlp_gated:
        return 0
    dt = dtypes(key)
    return dt.residual * spec.hidden_size + dt.compute * spec.intermediate_size


def _adapter_bytes(key: ActivationKey, dt: Dtypes) -> int:
    """LoRA: each adapter's lora_B saves lora_A's rank-wide output (half under autocast)."""
    if key.method not in ("lora", "qlora"):
        return 0
    return key.lora_adapters * key.lora_rank * (dt.compute if dt.autocast else key.adapter_bytes)


def mlp_width(spec: ModelSpec) -> tuple[int, float]:
    """Width of the per-token feed-forward work and how many such blocks a token runs."""
    if spec.is_moe:
        shared = spec.shared_expert_intermediate_size
        return spec.moe_intermediate_size, spec.experts_per_token + (shared / spec.moe_intermediate_size)
    return spec.intermediate_size, 1.0


def checkpoint_bytes_per_token(key: ActivationKey) -> int:
    """Per layer with gradient checkpointing: the saved layer input (residual dtype)."""
    return dtypes(key).residual * key.model.hidden_size


def outside_layers_bytes_per_token(key: ActivationKey) -> int:
    """Final norm, lm_head input and embedding dropout mask (logits counted apart)."""
    spec = key.model
    dt, hidden = dtypes(key), spec.hidden_size
    trains = key.method == "full"
    total = norm_bytes(key, trains) if spec.final_norm else 0
    total += lm_head_input_bytes_per_token(key)
    if spec.embed_norm:
        total += norm_bytes(key, trains)
    if _dropout(spec, "embed"):
        total += hidden
    return total - _first_layer_discount(key)


def lm_head_input_bytes_per_token(key: ActivationKey) -> int:
    """The lm_head's saved input (part of `outside_layers_bytes_per_token`): when it trains, or an
    adapter on it does."""
    dt = dtypes(key)
    return _input_bytes(key, dt, ("lm_head",), dt.residual) * key.model.hidden_size


def _first_layer_discount(key: ActivationKey) -> int:
    """With a frozen embedding (LoRA, QLoRA) the first layer's input needs no gradient: its first
    norm saves nothing, nor (parallel block) its whole MLP branch and the MLP's own norm. Checkpointing keeps the
    layers' inputs instead, so nothing changes there."""
    if key.method not in ("lora", "qlora") or key.grad_ckpt:
        return 0
    spec = key.model
    discount = norm_bytes(key, trains=False)
    if key.lora_dropout:
        # the first layer's normed input needs no gradient: the dropouts of the adapters reading it
        # keep no mask (native_dropout saves it for an input that requires grad); a parallel block's
        # MLP branch reads an input without one too
        first = ("in_proj_qkvz", "in_proj_ba") if spec.layer_types and spec.layer_types[0] == "linear" \
            else _attention_input_roles(spec)
        if spec.parallel_block:
            first += ("gate_proj", "up_proj") if spec.mlp_gated else ("up_proj",)
        discount += _readers(key, first) * spec.hidden_size
    if spec.parallel_block and not any(_trains(key, r) for r in ("gate_proj", "up_proj")):
        # nothing before the MLP's output needs a gradient but a down_proj adapter, which keeps its input (cast)
        discount += mlp_bytes_per_token(key)
        dt = dtypes(key)
        if _trains(key, "down_proj") and not spec.is_moe:
            _, out, _ = _activation_saves(spec, dt)
            discount -= _input_bytes(key, dt, ("down_proj",), dt.linear_out if spec.mlp_gated else out) * spec.intermediate_size
        if spec.norms_per_layer > 1:   # the MLP's own norm over the same input (GPT-NeoX) saves nothing either
            shared = dt.residual * spec.hidden_size if spec.norm == "layer" else 0
            discount += (spec.norms_per_layer - 1) * (norm_bytes(key, trains=False) - shared)
    if spec.layer_types and spec.layer_types[0] == "linear":
        discount += round(_first_linear_attention_discount(key))
    return discount


def _first_linear_attention_discount(key: ActivationKey) -> float:
    """A gated delta-net first layer under LoRA (frozen embedding, frozen in_proj_ba, A_log, dt_bias):
    beta and the decay need no gradient, so two chunk x chunk fp32 tensors per head, one key-wide
    one net, the softplus input and beta's sigmoid are not saved (autograd graph of the layer with an
    adapter on in_proj_qkvz); with no adapter on in_proj_qkvz nor in_proj_ba nothing before out_proj
    needs a gradient and the layer saves only out_proj's adapter input."""
    spec, dt = key.model, dtypes(key)
    if _trains(key, "in_proj_ba"):
        return 0.0          # beta and the decay need a gradient through in_proj_ba's adapter
    if not _trains(key, "in_proj_qkvz"):
        return _linear_attention(key, dt) - _input_bytes(key, dt, ("out_proj",), dt.compute) * spec.linear_value_dim
    seq = max(key.seq, 1)
    padded = -(-seq // _DELTA_CHUNK) * _DELTA_CHUNK / seq
    nv = spec.linear_value_heads
    return padded * 4 * nv * (2 * _DELTA_CHUNK + spec.linear_key_head_dim) + 6 * nv


def _logit_bytes(key: ActivationKey) -> int:
    """Bytes per element of the lm_head output (the compute dtype; fp32 model: fp32)."""
    return dtypes(key).compute


def logits_saved_per_token(key: ActivationKey) -> int:
    """Kept for the backward: log_softmax's fp32 output (and Gemma-2's soft-capping tanh). Liger's
    fused linear cross-entropy computes the gradients in the forward, chunk by chunk, and keeps only
    the gradient of its input (hidden width, in the dtype of its input: the final norm's output, the
    residual stream's dtype with Liger's RMSNorm; liger-kernel 0.8.5
    ops/fused_linear_cross_entropy.py `grad_input = zeros_like(_input)`). Liger's unfused
    cross_entropy (Granite) saves the fp32 logits it wrote the gradient into: as log_softmax's output."""
    if liger_fused_loss(key):
        return dtypes(key).residual * key.model.hidden_size
    vocab, logit = key.model.vocab_size, _logit_bytes(key)
    softcap = softcap_saved_per_token(key)
    if key.loss == "model-dtype":   # log_softmax's output (fp32 under autocast)
        return (4 if dtypes(key).autocast else logit) * vocab + softcap
    return 4 * vocab + softcap


def liger_fused_loss(key: ActivationKey) -> bool:
    """Liger's fused linear cross-entropy computes the loss (no logits materialised): Liger on a
    model whose patch fuses it (not Granite: estimator.regimes.LIGER_UNFUSED_LOSS)."""
    return key.liger and liger_fuses_loss(key.model.model_type)


def softcap_saved_per_token(key: ActivationKey) -> int:
    """Gemma-2's final soft-capping saves its tanh output (the logits' dtype) for the backward; 0
    without soft-capping or with Liger's fused loss."""
    return 0 if liger_fused_loss(key) or not key.model.logit_softcap else _logit_bytes(key) * key.model.vocab_size


def logits_forward_per_token(key: ActivationKey) -> int:
    """Peak of the loss in the forward: the logits, their fp32 upcast (none for fp32 logits) and
    log_softmax's output; with soft-capping the tanh output and the capped logits. Liger: its
    input's gradient, the fp32 per-token loss, the mask of labelled tokens and the padded and
    shifted int64 labels (liger-kernel 0.8.5 transformers/model/loss_utils.py `LigerForCausalLMLoss`;
    the logits chunk is a fixed size: memory.py). Liger's unfused cross_entropy (Granite): the
    logits, their fp32 upcast (its gradient, written in place) and the per-token loss."""
    if liger_fused_loss(key):
        return dtypes(key).residual * key.model.hidden_size + 4 + 1 + 2 * 8
    vocab, logit = key.model.vocab_size, _logit_bytes(key)
    if key.liger:
        return (logit + 4 if logit != 4 else 4) * vocab + 4 + softcap_saved_per_token(key)
    if key.loss == "hf-legacy":     # the fp32 logits (the half ones freed by the upcast), their shifted
        # contiguous copy and log_softmax's output
        return 12 * vocab + softcap_saved_per_token(key)
    if key.loss == "chunked":       # at the last chunk: every chunk's logits and log_softmax output, and
        # that chunk's fp32 copy (none for fp32 logits: .float() returns them)
        return (logit + 4) * vocab + (0 if logit == 4 else 4 * vocab / CHUNKED_LOSS_CHUNKS)
    if key.loss == "model-dtype":   # logits, the shifted copy cross_entropy reads, log_softmax's output;
        # autocast runs log_softmax in fp32 (CUDA's fp32 list): an fp32 cast of the copy and an fp32 output
        extra = 8 if dtypes(key).autocast else logit
        return (2 * logit + extra) * vocab + softcap_saved_per_token(key)
    base = (logit + 8) * vocab if logit != 4 else 8 * vocab
    return base + softcap_saved_per_token(key)


def logits_backward_per_token(key: ActivationKey) -> int:
    """Peak of the loss in the backward: log_softmax's saved output, the incoming gradient and the
    outgoing gradient, all fp32 (12 B x vocab), plus the soft-capping tanh output. Liger: the saved
    input gradient is the outgoing gradient (scaled in place). Liger's unfused cross_entropy
    (Granite): its saved fp32 logits are the gradient, cast back to the logits' dtype (no cast for
    fp32 logits: Granite's scaling's backward makes the next copy)."""
    if liger_fused_loss(key):
        return logits_saved_per_token(key)
    vocab, logit = key.model.vocab_size, _logit_bytes(key)
    if key.liger:
        return (4 + logit) * vocab + softcap_saved_per_token(key)
    if key.loss == "hf-legacy":     # beside those, the fp32 logits the kept output holds
        return 12 * vocab + logits_kept_per_token(key) + softcap_saved_per_token(key)
    if key.loss == "chunked":       # the first chunk's backward: every chunk's saved log_softmax output
        # and that chunk's incoming and outgoing fp32 gradients; later chunks free more than they add
        return 4 * vocab + 2 * 4 * vocab / CHUNKED_LOSS_CHUNKS
    if key.loss == "model-dtype":   # log_softmax's output, its incoming and outgoing gradient (fp32
        # under autocast); the logits were freed with the output after the forward
        return (12 if dtypes(key).autocast else 3 * logit) * vocab + softcap_saved_per_token(key)
    return 12 * vocab + softcap_saved_per_token(key)


def logits_kept_per_token(key: ActivationKey) -> int:
    """The logits a loop keeps through the whole backward, per token: `--loss hf-legacy`'s fp32
    logits, which the model returned and the loop's `output` holds until the next step; 0 otherwise
    (the HF Trainer keeps only the loss)."""
    return 4 * key.model.vocab_size if key.loss == "hf-legacy" and not liger_fused_loss(key) else 0


def inference_attention_bytes_per_token(key: ActivationKey, kv_tokens: int) -> int:
    """Prefill (no autograd) attention transient per query token: q, k, v (eager repeats k and v
    to all heads for GQA) and the output; eager adds its 4-D mask row and the scores while softmax
    runs: the masked scores, the fp32 copy softmax(dtype=float32) makes and its fp32 output (a
    plain softmax: input and output in the compute dtype). Under AMP the mask is fp32 (the
    hidden states' dtype), so the masked scores already are: 4 + 4 B per score. Attention sinks
    (GPT-OSS) keep the masked scores beside the concatenated logits and the softmax. SDPA with a
    4-D mask (a sliding layer past its window, a padded batch) adds the converted mask row and k
    and v repeated to every head."""
    spec = key.model
    compute, q_dim, kv_dim = dtypes(key).compute, spec.q_dim, spec.kv_dim
    if key.attn != "eager":
        per_layer, layers = _sdpa_mask_layer_bytes(key, kv_tokens) if key.attn == "sdpa" else (0, 0)
        return compute * (2 * q_dim + 2 * kv_dim) + (per_layer if layers else 0)
    k_heads = q_dim if spec.num_kv_heads != spec.num_heads else kv_dim
    if spec.model_type in _FP32_QK_EAGER:
        # GPTJAttention: the q and k projections stay referenced by their q_pass/k_pass views, the
        # rotated q beside the cache's k, and _attn's fp32 copies of q and k
        qk = compute * (2 * q_dim + k_heads) + 4 * (q_dim + k_heads)
    else:
        qk = compute * (2 * q_dim + 2 * k_heads)
    mask = 4 if key.amp else compute
    if key.amp:
        scores = 8
    else:
        scores = 2 * compute if spec.model_type in _PLAIN_SOFTMAX else compute + 8
    if spec.attention_sinks:
        # GPT-OSS's eager_attention_forward: the masked scores stay referenced while the sink column
        # is concatenated, the row max subtracted and the softmax taken: one more score-sized tensor
        scores += 4 if key.amp else compute
    return qk + (mask + scores * spec.num_heads) * kv_tokens


def inference_rotary_bytes_per_token(key: ActivationKey) -> int:
    """Prefill working set per token while a layer's queries get their rotary embedding in fp32
    (OLMo: fp32 cos/sin tables; Cohere, Cohere2: q.float(), k.float()), 0 for the other families:
    q, k and v in the compute dtype, `_FP32_ROTARY` q-sized fp32 tensors at once (q * cos,
    rotate_half(q) and its product with sin; Cohere's q.float() too, and its k.float()), the fp32
    cos and sin tables,
    and the layer input and normed input (hidden width). This layer's keys are not cached yet."""
    spec = key.model
    compute = dtypes(key).compute
    if spec.model_type not in _FP32_ROTARY or compute == 4:
        return 0
    q_dim, kv_dim = spec.q_dim, spec.kv_dim
    k_float = 4 * kv_dim if spec.model_type in _FLOAT_QK_ROTARY else 0
    return (compute * (q_dim + 2 * kv_dim) + 4 * _FP32_ROTARY[spec.model_type] * q_dim + k_float
            + 8 * spec.head_dim + 2 * compute * spec.hidden_size)


def inference_linear_attention_bytes_per_token(key: ActivationKey) -> float:
    """Prefill (no autograd) transient of one Qwen3-Next gated delta-net layer per token: what
    `torch_chunk_gated_delta_rule` holds in local variables while its chunk loop runs, fp32 per padded
    token: q, k, k_beta, the decayed keys and k_cumdecay (key-wide), v, v_beta, the solved values and
    the output (value-wide), the decay products, triangular system and intra-chunk attention (chunk
    wide), beta, decay and its cumulative sum; with the layer's projections and conv output in the
    compute dtype (in_proj_qkvz output, the conv input and output)."""
    spec = key.model
    if not spec.num_linear_layers:
        return 0.0
    seq = max(key.seq, 1)
    padded = -(-seq // _DELTA_CHUNK) * _DELTA_CHUNK / seq
    nv, dk, dv = spec.linear_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
    fp32 = padded * 4 * nv * (5 * dk + 4 * dv + 3 * _DELTA_CHUNK + 3)
    compute = dtypes(key).compute * (2 * spec.linear_key_dim + 2 * spec.linear_value_dim + 2 * spec.linear_conv_dim)
    return fp32 + compute


def inference_mlp_bytes_per_token(key: ActivationKey) -> int:
    """Prefill MLP transient per token: activation, up and product (gated); `gelu_new` keeps its
    input, 0.5 x and two intermediates (fp32 under autocast, after pow); a fused gate_up linear's
    output stays whole while its gate and up views are used. MoE: the routed copies."""
    spec, compute = key.model, dtypes(key).compute
    if spec.is_moe and spec.num_moe_layers:
        moe = _inference_moe_bytes_per_token(key, compute)
        if spec.num_moe_layers == spec.num_layers:
            return moe
        return max(moe, 3 * compute * spec.intermediate_size)     # the dense layers' gated MLP
    width, blocks = (spec.intermediate_size, 1.0) if spec.is_moe else mlp_width(spec)
    if spec.mlp_gated and spec.model_type in _FUSED_GATE_UP:
        per_width = 4 * compute    # the gate_up output (gate and up are its views), activation, product
    elif spec.mlp_gated:
        per_width = 3 * compute
    elif spec.activation == "gelu_new":
        per_width = 2 * compute + (8 if key.amp else 2 * compute)
    else:
        per_width = 2 * compute
    return int(per_width * width * blocks)


def _inference_moe_bytes_per_token(key: ActivationKey, compute: int) -> int:
    """Prefill MoE transient per token (transformers 5.23 `grouped_mm_experts_forward`, no grad):
    per chosen expert, the sorted copy of the input with the gate/up output and its activation,
    or later that copy, the experts' output and two routing-weighted copies (the weighted rows and
    their reordering) in the routing weights' dtype (fp32 for an fp32 router), beside the shared
    expert's output where it ran first (`_SHARED_FIRST`); else the shared expert beside the
    experts' summed output."""
    spec, hidden = key.model, key.model.hidden_size
    mt = spec.model_type
    if key.quant == "mxfp4":
        # Mxfp4GptOssExperts.forward_routed: matmul_ogs gathers the routed rows and fuses SwiGLU (the
        # intermediate cache is one expert width per route); the second writes one hidden row per
        # route (its scatter scratchpad) and the weighted sum per token (triton-lang/triton
        # python/triton_kernels/triton_kernels/matmul_ogs.py init_allocation: M + Mc output rows)
        k = spec.experts_per_token
        return compute * (k * (spec.moe_intermediate_size + hidden) + hidden)
    if mt in _DENSE_EXPERTS:
        # Llama4TextMoe: the repeated input and its scaled copy, then per expert the gate/up output,
        # activation and product beside the bmm output; then the routed output and the scaled input
        # (still referenced) beside the shared expert
        e, width = spec.num_experts, spec.moe_intermediate_size
        return max(e * compute * (2 * hidden + 4 * width),
                   e * compute * 2 * hidden + compute * (hidden + 3 * spec.shared_expert_intermediate_size))
    routing = 4 if _fp32_routing_weights(mt) else compute
    width = spec.moe_intermediate_size
    experts = spec.experts_per_token * max(compute * (hidden + 3 * width), hidden * (2 * compute + 2 * routing))
    shared = compute * (hidden + 3 * spec.shared_expert_intermediate_size)
    if mt in _SHARED_FIRST and spec.shared_expert_intermediate_size:
        experts += compute * hidden     # the shared expert's output
    return max(experts, shared)


def inference_residual_bytes_per_token(key: ActivationKey) -> int:
    """Hidden-width tensors alive around a layer's peak in the prefill: the embeddings (the model's
    inputs_embeds), the layer input (held by the model's loop), the residual and the normed input."""
    dt = dtypes(key)
    return (3 * dt.residual + dt.compute) * key.model.hidden_size


def inference_mlp_locals_bytes_per_token(key: ActivationKey) -> int:
    """Hidden-width tensors a decoder layer keeps beside its MLP beyond the residual's
    (`_KEEPS_ATTENTION_LOCALS`: the attention's normed input and output), 0 for the others."""
    spec = key.model
    if spec.model_type in _KEEPS_ATTENTION_LOCALS and not spec.parallel_block:
        return 2 * dtypes(key).compute * spec.hidden_size
    return 0


def inference_post_norm_bytes_per_token(key: ActivationKey) -> int:
    """Prefill working set per token while a post-norm family (`_POST_NORM`) normalises the MLP's
    output: the embeddings, layer input, residual and MLP output, the norm's fp32 normalised input
    and its fp32 weighted product, and the cast output; 0 for the others."""
    spec, dt = key.model, dtypes(key)
    if spec.model_type not in _POST_NORM:
        return 0
    return (4 * dt.residual + dt.compute + 8) * spec.hidden_size
