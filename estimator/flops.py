"""FLOPs of a Workload per micro-batch on one GPU.

Conventions (docs/design.md section 4): a matmul of a token with an m x n weight costs 2mn;
forward 2N per token for N matmul parameters (MoE: active experts only; embeddings are lookups,
the lm_head is a matmul); backward 4N with weight gradients, 2N without (frozen base); activation
recomputation adds one forward of the decoder layers; attention adds 2 x (q_dim + o_dim) x keys
per token and layer forward (4 x q_dim unless MLA's value heads are narrower than its query heads) (QK^T and PV, counted non-causal as PaLM and torch's FlopCounterMode do).
`model_flops` excludes recomputation (what MFU is quoted against); `hardware_flops` includes it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from estimator import dora
from estimator.states import dora_params, lora_params
from estimator.model import ModelSpec
from estimator.params import ParamCounts, count_params
from estimator.workload import Workload


@dataclass(frozen=True)
class FlopBreakdown:
    forward: float
    backward: float
    recompute: float
    attention_forward: float
    model_flops: float
    hardware_flops: float

    def to_dict(self) -> dict:
        return asdict(self)


def matmul_params(spec: ModelSpec, p: ParamCounts) -> tuple[float, float]:
    """(decoder-layer matmul params active per token, lm_head matmul params)."""
    idle = (1.0 - p.active_expert_fraction) * p.expert_weights
    layers = p.linear_weights - idle
    head = p.lm_head if p.lm_head else p.embedding
    if spec.embed_dim != spec.hidden_size:
        head = spec.vocab_size * spec.embed_dim
    return layers, head


def attention_flops_per_token(spec: ModelSpec, keys: int) -> float:
    """Forward attention FLOPs of one query token over `keys` keys, summed over layers."""
    return 2.0 * (spec.q_dim + spec.o_dim) * spec.attended_tokens(keys)


def training_flops(w: Workload) -> FlopBreakdown:
    """FLOPs of one micro-batch forward+backward on one GPU (tensor/pipeline shares divided)."""
    spec = w.model
    p = count_params(spec)
    tokens = w.batch * w.seq
    layers, head = matmul_params(spec, p)
    attn = attention_flops_per_token(spec, w.seq) * tokens
    fwd_layers = 2.0 * layers * tokens + attn
    fwd = fwd_layers + 2.0 * head * tokens
    if w.method == "full":
        bwd = 2.0 * fwd
    else:  # input gradients through the frozen base (attention needs both of its grads)
        adapters = lora_params(w, p) - dora_params(w)
        fwd += 2.0 * adapters * tokens
        bwd = 2.0 * layers * tokens + 2.0 * attn + 2.0 * head * tokens + 4.0 * adapters * tokens
    # DoRA rebuilds every adapted weight's norm in each forward (the identity through the adapters;
    # detached: no backward), once more in the recomputation
    norm = dora.forward_flops(spec, w.lora_targets, w.lora_rank) if (w.dora and w.method != "full") else 0.0
    fwd += norm
    fwd_layers += norm
    recompute = fwd_layers if w.grad_ckpt else 0.0
    share = w.tp * w.pp
    model = (fwd + bwd) / share
    return FlopBreakdown(fwd / share, bwd / share, recompute / share, attn / share, model,
                         model + recompute / share)


def prefill_flops(w: Workload) -> float:
    """Prompt forward on one GPU; generate computes logits for the last position only."""
    spec = w.model
    p = count_params(spec)
    layers, head = matmul_params(spec, p)
    tokens = w.batch * w.seq
    return (2.0 * layers * tokens + attention_flops_per_token(spec, w.seq) * tokens
            + 2.0 * head * w.batch) / (w.tp * w.pp)


def decode_flops_per_token(w: Workload, cached: int) -> float:
    """One generated token for the whole batch, with `cached` tokens already in the cache."""
    spec = w.model
    p = count_params(spec)
    layers, head = matmul_params(spec, p)
    return w.batch * (2.0 * (layers + head) + attention_flops_per_token(spec, cached)) / (w.tp * w.pp)
