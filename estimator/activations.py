"""Bytes that autograd keeps alive between forward and backward, per token, derived per architecture.

Counted from what each op of the transformers 5 implementation saves for backward (PyTorch saves
an operand only when the gradient of another operand needs it, so a frozen linear does not keep
its input):

- RMSNorm (Llama style) upcasts to fp32: the fp32 input is saved (4 B), and the bf16 normalized
  tensor is saved by the weight multiply only when the norm weight trains. Gemma norms multiply in
  fp32 (another 4 B). LayerNorm saves its input plus fp32 mean and rstd (8 B).
- Under autocast (AMP) every linear casts its fp32 input to half precision, and each cast is a
  separate saved copy (q, k and v each keep one); the residual stream stays fp32.
- SDPA flash/efficient and FlashAttention save q, k, v (kv heads, no repeat) and the output plus an
  fp32 log-sum-exp per head; eager attention saves the fp32 softmax and its half cast: B x heads x
  T x T, and repeats k and v to all heads.
- Gated MLP (SwiGLU/GeGLU) saves gate, activation, up and product; `gelu_new` is a Python
  composition that keeps four tensors instead of one.
- Dropout in training saves a 1-byte mask.

These are the analytic counts; the fake-tensor tracer is their oracle.
"""

from __future__ import annotations

from estimator.model import ModelSpec
from estimator.workload import Workload

# Tensors of the intermediate width that the activation function saves besides its output.
_ACT_SAVES = {"gelu_new": 4, "gelu_fast": 3, "quick_gelu": 2}


def _shared_input(w: Workload, consumers: int, a: int) -> int:
    """Bytes per element that linears sharing one input save: the input once if any weight (or
    adapter) trains; under AMP each linear keeps its own half-precision cast."""
    if consumers == 0:
        return 0
    return consumers * 2 if w.amp else a


def _trains(w: Workload, role: str) -> bool:
    if w.method == "full":
        return True
    return w.method in ("lora", "qlora") and role in w.lora_targets


def _norm_bytes(spec: ModelSpec, w: Workload, a: int) -> int:
    """Saved by one norm over the hidden width, per hidden element."""
    trains = w.method == "full"
    if spec.norm == "layer":
        return a if not w.amp else 4  # input (fp32 under autocast); mean/rstd added per token
    if spec.model_type.startswith("gemma"):
        return 4 + (4 if trains else 0)
    return 4 + (a if trains and not w.amp else (4 if trains else 0))


def _attention_core(spec: ModelSpec, w: Workload, a: int) -> int:
    """Saved by the attention kernel per token, score tensors excluded (see `score_bytes`)."""
    if w.attn == "eager":
        return a * (spec.q_dim * 3)  # q, and k and v repeated to all heads
    lse = 4 * spec.num_heads
    out = a * spec.q_dim
    return a * (spec.q_dim + 2 * spec.kv_dim) + out + lse


def score_bytes_per_token(spec: ModelSpec, w: Workload, kv_tokens: int) -> int:
    """Eager attention keeps fp32 softmax and its half cast: heads x keys per query token."""
    if w.attn != "eager":
        return 0
    a = w.activation_dtype_bytes
    dropout_mask = 1 if _dropout(spec) else 0
    return (4 + a + dropout_mask) * spec.num_heads * kv_tokens


def _dropout(spec: ModelSpec) -> bool:
    """Families whose published configs train with dropout (GPT-2, OPT, BigCode, Phi)."""
    return spec.model_type in ("gpt2", "opt", "gpt_bigcode", "phi")


def _mlp_bytes(spec: ModelSpec, w: Workload, a: int, width: int) -> int:
    extra = _ACT_SAVES.get(spec.activation, 0)
    if spec.mlp_gated:
        saved = 4 * a * width + extra * a * width  # gate, act, up, product
        if not _trains(w, "down_proj"):
            saved -= a * width                    # product only feeds the frozen down_proj
        return saved
    saved = a * width * (1 + extra)               # activation input
    saved += a * width if _trains(w, "down_proj") else 0
    return saved


def mlp_width(spec: ModelSpec) -> tuple[int, float]:
    """Width of the per-token feed-forward work and how many such blocks a token runs."""
    if spec.is_moe:
        shared = spec.shared_expert_intermediate_size
        return spec.moe_intermediate_size, spec.experts_per_token + (shared / spec.moe_intermediate_size)
    return spec.intermediate_size, 1.0


_LAYER_CACHE: dict = {}


def layer_bytes_per_token(spec: ModelSpec, w: Workload) -> int:
    """Bytes saved for backward by one decoder layer per token (no checkpointing, no scores)."""
    key = (spec, w.method, w.precision, w.attn, w.lora_targets)
    hit = _LAYER_CACHE.get(key)
    if hit is None:
        if len(_LAYER_CACHE) > 4096:
            _LAYER_CACHE.clear()
        hit = _LAYER_CACHE[key] = _layer_bytes_per_token(spec, w)
    return hit


def _layer_bytes_per_token(spec: ModelSpec, w: Workload) -> int:
    a = w.activation_dtype_bytes
    h = spec.hidden_size
    n_norm = spec.norms_per_layer
    total = n_norm * _norm_bytes(spec, w, a) * h
    if spec.norm == "layer":
        total += n_norm * 8
    qkv_consumers = sum(_trains(w, r) for r in ("q_proj", "k_proj", "v_proj"))
    mlp_consumers = sum(_trains(w, r) for r in ("gate_proj", "up_proj"))
    total += _shared_input(w, qkv_consumers, a) * h
    total += _shared_input(w, mlp_consumers, a) * h
    total += _attention_core(spec, w, a)
    if spec.qk_norm:
        total += (4 + a) * (spec.q_dim + spec.kv_dim)
    if _trains(w, "o_proj") and not (w.attn == "flash"):
        total += a * spec.q_dim  # the contiguous copy of the attention output (a view under flash)
    width, blocks = mlp_width(spec)
    total += round(_mlp_bytes(spec, w, a, width) * blocks)
    if spec.is_moe:
        total += 4 * spec.num_experts + 8 * spec.experts_per_token  # router logits, top-k weights
    if _dropout(spec):
        total += 2 * h  # residual and MLP dropout masks
    return total


def checkpoint_bytes_per_token(spec: ModelSpec, w: Workload) -> int:
    """Per layer with gradient checkpointing: the saved layer input (residual dtype)."""
    return 4 * spec.hidden_size if w.amp or w.compute_dtype == "fp32" else 2 * spec.hidden_size


def outside_layers_bytes_per_token(spec: ModelSpec, w: Workload) -> int:
    """Final norm, embedding-side tensors and the lm_head input (logits counted apart)."""
    a = w.activation_dtype_bytes
    h = spec.hidden_size
    total = _norm_bytes(spec, w, a) * h if spec.final_norm else 0
    total += a * h  # lm_head input: saved by the lm_head (full) or kept by the norm output
    if spec.embed_norm:
        total += _norm_bytes(spec, w, a) * h
    if _dropout(spec):
        total += h
    return total


def logits_bytes_per_token(spec: ModelSpec, w: Workload) -> int:
    """Peak bytes of logits and loss per token in training.

    Forward: half-precision logits, the fp32 upcast the HF loss makes, and log_softmax's fp32
    output; backward: saved output, incoming gradient and outgoing gradient, all fp32 (12 B x V).
    Gemma-2 soft-capping adds divide, tanh and multiply outputs in the logits dtype.
    """
    v = spec.vocab_size
    a = w.activation_dtype_bytes
    forward = (a + 4 + 4) * v if a == 2 else 8 * v
    if spec.logit_softcap:
        forward += 3 * a * v
    return max(forward, 12 * v)
