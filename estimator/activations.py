"""Bytes that autograd keeps alive between forward and backward, per token, derived per architecture.

Counted from what each op of the transformers 5 implementation saves for backward (PyTorch saves
an operand only when the gradient of another operand needs it, so a frozen linear does not keep
its input) and checked against fake-tensor traces of the real step (profiler.trace, the oracle;
tests/test_estimator_vs_trace.py). Three dtypes matter (`Dtypes`): the compute dtype `a`, the
residual stream `r` (fp32 under AMP and in QLoRA, whose kbit preparation upcasts the embedding),
and the output of the model's linears `lo` (bitsandbytes 4-bit layers return their input dtype).

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

from dataclasses import dataclass
from functools import lru_cache

from estimator.model import ModelSpec
from estimator.tables import dtype_bytes
from estimator.workload import Workload

_PARTIAL_ROTARY = ("phi", "gpt_neox")      # q made contiguous per head by torch.cat
_PLAIN_SOFTMAX = ("gpt2",)                 # eager softmax without dtype=float32
_ATTN_SOFTCAP = ("gemma2",)                # tanh soft-capping of attention scores (eager)
_FUSED_QKV = ("gpt2", "gpt_bigcode", "bloom", "falcon", "gpt_neox", "phi3")  # one qkv linear
_DROPOUT = {"gpt2": ("attn", "resid", "embed"), "gpt_bigcode": ("attn", "resid", "embed"),
            "opt": ("resid", "embed"), "phi": ("resid",)}
_INDEX_BYTES = 8                           # int64 routing indices


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element: compute `a`, residual stream `r`, linear outputs `lo`; `autocast`."""

    a: int
    r: int
    lo: int
    autocast: bool


def dtypes(w: Workload) -> Dtypes:
    """The three activation dtypes of `w` (bytes per element) and whether autocast runs."""
    return _dtypes(w.precision, w.training, w.quant)


@lru_cache(maxsize=64)
def _dtypes(precision: str, training: bool, quant: str) -> Dtypes:
    a = int(dtype_bytes(precision.removeprefix("amp-")))
    amp = precision.startswith("amp-")
    kbit = training and quant != "none"       # peft kbit preparation: fp32 embedding and norms
    r = 4 if (amp or kbit or a == 4) else a
    return Dtypes(a, r, 4 if kbit else a, amp or kbit)


def _trains(w: Workload, role: str) -> bool:
    """Whether `role`'s weight (full) or an adapter on it (LoRA/QLoRA) trains."""
    if w.method == "full":
        return True
    return w.method in ("lora", "qlora") and role in w.lora_targets


def _input_bytes(w: Workload, dt: Dtypes, roles, x_bytes: int, saved: bool = False) -> int:
    """Bytes per element saved for the linears in `roles` reading one tensor of `x_bytes`;
    `saved` when that tensor is already saved by something else."""
    n = sum(_trains(w, role) for role in roles)
    if n == 0:
        return 0
    if w.model.model_type in _FUSED_QKV and set(roles) >= {"q_proj", "k_proj", "v_proj"}:
        n -= sum(_trains(w, role) for role in ("k_proj", "v_proj"))   # q, k, v are one linear
    if w.method == "full":
        if dt.autocast and x_bytes != dt.a:
            return n * dt.a                   # each linear saves its own autocast cast
        return 0 if saved else x_bytes        # the tensor itself, once
    if dt.autocast:
        return n * dt.a                       # adapter casts to fp32, autocast back to half
    if x_bytes == 4:
        return 0 if saved else 4
    return n * 4                              # each adapter's fp32 cast


def _dropout(spec: ModelSpec, where: str) -> bool:
    return where in _DROPOUT.get(spec.model_type, ())


def norm_bytes(spec: ModelSpec, w: Workload, trains: bool) -> int:
    """Saved by one norm over the hidden width, per token (its output excluded)."""
    h, dt = spec.hidden_size, dtypes(w)
    if spec.norm == "layer":
        return dt.r * h + 8
    if spec.model_type.startswith("gemma"):
        return 4 * h + 4 + (4 * h if trains else 0)
    return 4 * h + 4 + (dt.r * h if trains else 0)


def _attention(spec: ModelSpec, w: Workload, dt: Dtypes) -> int:
    """Saved by attention per token besides its input norm (scores excluded: `score_bytes_...`)."""
    a, q, kv = dt.a, spec.q_dim, spec.kv_dim
    if w.attn == "eager":
        k_saved = q if spec.num_kv_heads != spec.num_heads else kv   # repeat_kv copies
        core = a * (q + 2 * k_saved)
        copy = True
    else:
        core = a * (q + 2 * kv) + a * q + 4 * spec.num_heads          # q, k, v, output, lse
        copy = w.attn == "sdpa" and spec.model_type in _PARTIAL_ROTARY
    total = core + _input_bytes(w, dt, ("o_proj",), a, saved=not copy) * q
    if spec.qk_norm:
        heads = spec.num_heads + spec.num_kv_heads
        total += 4 * (q + kv) + 4 * heads + (dt.r * (q + kv) if w.method == "full" else 0)
    if _dropout(spec, "resid"):
        total += spec.hidden_size
    return total


def score_bytes_per_token(spec: ModelSpec, w: Workload, kv_tokens: int) -> int:
    """Eager attention's saved scores per query token: softmax output (fp32 unless the model calls
    a plain softmax outside autocast), the half cast the value matmul reads, dropout mask and
    output when attention dropout is on, Gemma-2's soft-capping tanh."""
    if w.attn != "eager":
        return 0
    dt = dtypes(w)
    soft = dt.a if (spec.model_type in _PLAIN_SOFTMAX and not dt.autocast) else 4
    per_key = soft
    if _dropout(spec, "attn"):
        per_key += 1 + dt.a
    elif soft != dt.a:
        per_key += dt.a
    if spec.model_type in _ATTN_SOFTCAP:
        per_key += dt.a
    return per_key * spec.num_heads * kv_tokens


def _activation_saves(spec: ModelSpec, dt: Dtypes) -> tuple[int, int, bool]:
    """(bytes per intermediate element the activation function saves, bytes of its output,
    whether that output is among what it saves)."""
    if spec.activation == "gelu_new":
        if dt.autocast:       # 0.5 x; pow saves its fp32 (cast) input; tanh, 1 + tanh in fp32
            return dt.lo + 4 + 4 + 4, 4, False
        return 4 * dt.lo, dt.lo, False               # input, 0.5 x, tanh, 1 + tanh
    if spec.activation == "relu":
        return dt.lo, dt.lo, True                    # relu saves its output only
    return dt.lo, dt.lo, False                       # input only (silu, gelu, gelu_pytorch_tanh)


def _mlp(spec: ModelSpec, w: Workload, dt: Dtypes, width: int) -> int:
    """Saved by one feed-forward block per token (its input excluded)."""
    act, out, out_saved = _activation_saves(spec, dt)
    if spec.mlp_gated:
        saved = (act + 2 * dt.lo) * width             # gate (+ activation internals), act, up
        return saved + _input_bytes(w, dt, ("down_proj",), dt.lo) * width
    return act * width + _input_bytes(w, dt, ("down_proj",), out, saved=out_saved) * width


def _moe(spec: ModelSpec, w: Workload, dt: Dtypes) -> int:
    """Saved by one MoE block per token (its input excluded)."""
    a, h, k = dt.a, spec.hidden_size, spec.experts_per_token
    experts = k * _mlp(spec, w, dt, spec.moe_intermediate_size)
    if _trains(w, "gate_proj") or _trains(w, "up_proj"):
        experts += k * a * h if w.method == "full" else 0   # routed input, for the expert weights
    experts += k * a * h                                  # expert outputs x routing weights
    router = 4 * spec.num_experts + (4 * _INDEX_BYTES + a) * k
    shared = 0
    if spec.shared_expert_intermediate_size:
        shared = _mlp(spec, w, dt, spec.shared_expert_intermediate_size)
        if spec.shared_expert_gate:
            shared += a * h + a                         # shared output x sigmoid(gate)
    return experts + router + shared


_LAYER_CACHE: dict = {}


def layer_bytes_per_token(spec: ModelSpec, w: Workload) -> int:
    """Bytes saved for backward by one decoder layer per token (no checkpointing, no scores)."""
    key = (spec, w.method, w.precision, w.attn, w.lora_targets, w.quant)
    hit = _LAYER_CACHE.get(key)
    if hit is None:
        if len(_LAYER_CACHE) > 4096:
            _LAYER_CACHE.clear()
        hit = _LAYER_CACHE[key] = _layer_bytes_per_token(spec, w)
    return hit


def mlp_bytes_per_token(spec: ModelSpec, w: Workload) -> int:
    """The part of `layer_bytes_per_token` saved by the feed-forward block (dense or MoE) and its
    output dropout: the backward frees it before it reaches the attention."""
    dt = dtypes(w)
    block = _moe(spec, w, dt) if spec.is_moe else _mlp(spec, w, dt, spec.intermediate_size)
    return block + (spec.hidden_size if _dropout(spec, "resid") else 0)


def attention_backward_bytes_per_token(spec: ModelSpec, w: Workload, kv_tokens: int) -> int:
    """Extra bytes per query token at the peak of one layer's attention backward, beyond what the
    layer saved: eager softmax's backward holds the incoming gradient and its output in the
    softmax dtype (B x heads x T x T each) after the value matmul released the probabilities;
    the SDPA kernels write q, k and v gradients."""
    dt = dtypes(w)
    if w.attn != "eager":
        return dt.a * (spec.q_dim + 2 * spec.kv_dim)
    soft = dt.a if (spec.model_type in _PLAIN_SOFTMAX and not dt.autocast) else 4
    probs = dt.a if not _dropout(spec, "attn") else 1 + dt.a
    return (2 * soft - probs) * spec.num_heads * kv_tokens


def _layer_bytes_per_token(spec: ModelSpec, w: Workload) -> int:
    dt, h = dtypes(w), spec.hidden_size
    trains = w.method == "full"
    total = spec.norms_per_layer * norm_bytes(spec, w, trains)
    attn_roles, mlp_roles = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
    if spec.parallel_block and spec.norms_per_layer == 1:     # one norm feeds attention and MLP
        total += _input_bytes(w, dt, attn_roles + mlp_roles, dt.r) * h
    else:
        total += _input_bytes(w, dt, attn_roles, dt.r) * h
        total += _input_bytes(w, dt, mlp_roles if spec.mlp_gated or spec.is_moe else ("up_proj",), dt.r) * h
    total += _attention(spec, w, dt)
    if spec.is_moe:
        total += _moe(spec, w, dt)
    else:
        total += _mlp(spec, w, dt, spec.intermediate_size)
    if _dropout(spec, "resid"):
        total += h                                            # the MLP output's dropout mask
    return total + _adapter_bytes(w, dt)


def _adapter_bytes(w: Workload, dt: Dtypes) -> int:
    """LoRA: each adapter's lora_B saves lora_A's rank-wide output (half under autocast)."""
    if w.method not in ("lora", "qlora"):
        return 0
    return len(w.lora_targets) * w.lora_rank * (dt.a if dt.autocast else 4)


def mlp_width(spec: ModelSpec) -> tuple[int, float]:
    """Width of the per-token feed-forward work and how many such blocks a token runs."""
    if spec.is_moe:
        shared = spec.shared_expert_intermediate_size
        return spec.moe_intermediate_size, spec.experts_per_token + (shared / spec.moe_intermediate_size)
    return spec.intermediate_size, 1.0


def checkpoint_bytes_per_token(spec: ModelSpec, w: Workload) -> int:
    """Per layer with gradient checkpointing: the saved layer input (residual dtype)."""
    return dtypes(w).r * spec.hidden_size


def outside_layers_bytes_per_token(spec: ModelSpec, w: Workload) -> int:
    """Final norm, lm_head input and embedding dropout mask (logits counted apart)."""
    dt, h = dtypes(w), spec.hidden_size
    trains = w.method == "full"
    total = norm_bytes(spec, w, trains) if spec.final_norm else 0
    total += _input_bytes(w, dt, ("lm_head",) if trains else (), dt.r) * h
    if spec.embed_norm:
        total += norm_bytes(spec, w, trains)
    if _dropout(spec, "embed"):
        total += h
    return total - _first_layer_discount(spec, w)


def _first_layer_discount(spec: ModelSpec, w: Workload) -> int:
    """With a frozen embedding (LoRA, QLoRA) the first layer's input needs no gradient: its first
    norm saves nothing, nor (parallel block, one norm) its whole MLP branch. Checkpointing keeps the
    layers' inputs instead, so nothing changes there."""
    if w.method not in ("lora", "qlora") or w.grad_ckpt:
        return 0
    discount = norm_bytes(spec, w, trains=False)
    if spec.parallel_block and spec.norms_per_layer == 1 and not any(_trains(w, r) for r in ("up_proj", "down_proj")):
        discount += mlp_bytes_per_token(spec, w)
    return discount


def _logit_bytes(w: Workload) -> int:
    """Bytes per element of the lm_head output (the compute dtype; fp32 model: fp32)."""
    return dtypes(w).a


def logits_saved_per_token(spec: ModelSpec, w: Workload) -> int:
    """Kept for the backward: log_softmax's fp32 output (and Gemma-2's soft-capping tanh)."""
    v, a = spec.vocab_size, _logit_bytes(w)
    return 4 * v + (a * v if spec.logit_softcap else 0)


def logits_forward_per_token(spec: ModelSpec, w: Workload) -> int:
    """Peak of the loss in the forward: the logits, their fp32 upcast (none for fp32 logits) and
    log_softmax's output; with soft-capping the tanh output and the capped logits."""
    v, a = spec.vocab_size, _logit_bytes(w)
    base = (a + 8) * v if a != 4 else 8 * v
    return base + (a * v if spec.logit_softcap else 0)


def logits_backward_per_token(spec: ModelSpec, w: Workload) -> int:
    """Peak of the loss in the backward: log_softmax's saved output, the incoming gradient and the
    outgoing gradient, all fp32 (12 B x vocab), plus the soft-capping tanh output."""
    v, a = spec.vocab_size, _logit_bytes(w)
    return 12 * v + (a * v if spec.logit_softcap else 0)


def inference_attention_bytes_per_token(spec: ModelSpec, w: Workload, kv_tokens: int) -> int:
    """Prefill (no autograd) attention transient per query token: q, k, v (eager repeats k and v
    to all heads for GQA) and the output; eager adds its 4-D mask row and the scores while softmax
    runs: the masked scores, the fp32 copy softmax(dtype=float32) makes and its fp32 output (a
    plain softmax: input and output in the compute dtype). Under AMP the mask is fp32 (the
    hidden states' dtype), so the masked scores already are: 4 + 4 B per score."""
    a, q, kv = dtypes(w).a, spec.q_dim, spec.kv_dim
    if w.attn != "eager":
        return a * (2 * q + 2 * kv)
    k_heads = q if spec.num_kv_heads != spec.num_heads else kv
    mask = 4 if w.amp else a
    if w.amp:
        scores = 8
    else:
        scores = 2 * a if spec.model_type in _PLAIN_SOFTMAX else a + 8
    return a * (2 * q + 2 * k_heads) + (mask + scores * spec.num_heads) * kv_tokens


def inference_mlp_bytes_per_token(spec: ModelSpec, w: Workload) -> int:
    """Prefill MLP transient per token: activation, up and product (gated); `gelu_new` keeps its
    input, 0.5 x and two intermediates (fp32 under autocast, after pow). MoE: the routed copies."""
    a = dtypes(w).a
    width, blocks = mlp_width(spec)
    blocks = min(blocks, spec.experts_per_token or 1)
    if spec.mlp_gated:
        per_width = 3 * a
    elif spec.activation == "gelu_new":
        per_width = 2 * a + (8 if w.amp else 2 * a)
    else:
        per_width = 2 * a
    return int(per_width * width * blocks)


def inference_residual_bytes_per_token(spec: ModelSpec, w: Workload) -> int:
    """Hidden-width tensors alive around a layer's peak in the prefill: the layer input (held by
    the model's loop), the residual, the normed input and one more (a cast or a projection)."""
    dt = dtypes(w)
    return (3 * dt.r + dt.a) * spec.hidden_size
