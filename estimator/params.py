"""Exact parameter counts of a `ModelSpec`, by component.

Counts match what transformers 5.23 builds (tied embeddings counted once). Linear layers are
split out because quantization (bitsandbytes) and LoRA act on them alone; embeddings, norms and
biases of the quantized layers stay in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from estimator.model import ModelSpec

# Module names as transformers uses them for the Llama family; other families are mapped onto
# these roles so that LoRA target lists mean the same thing everywhere.
ATTENTION_ROLES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_ROLES = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION_ROLES + MLP_ROLES
# Multi-head latent attention (DeepSeek-V2/V3) by its own module names (q_proj when q_lora_rank is
# null, o_proj as above).
MLA_ROLES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# Gated delta-net linear attention (Qwen3-Next's linear_attn), by its own module names.
LINEAR_ATTENTION_ROLES = ("in_proj_qkvz", "in_proj_ba", "out_proj")


@dataclass(frozen=True)
class Linear:
    """One linear layer shape, repeated `count` times in the whole model (layers x experts)."""

    role: str
    d_in: int
    d_out: int
    count: int
    bias: bool
    expert: bool = False  # inside an MoE expert (LoRA all-linear in peft skips fused 3-D experts)

    @property
    def weight_params(self) -> int:
        return self.d_in * self.d_out * self.count

    @property
    def bias_params(self) -> int:
        return self.d_out * self.count if self.bias else 0


@dataclass(frozen=True)
class ParamCounts:
    """Element counts. `linears` are the decoder layers' projections (quantizable, LoRA targets)."""

    embedding: int
    positions: int
    lm_head: int          # 0 when tied to the embedding
    lm_head_bias: int
    norms: int            # every norm weight and bias, q/k norms included
    router: int           # MoE gates
    linears: tuple[Linear, ...]
    largest_layer: int    # largest single parameter tensor (ZeRO-3 gather, optimizer temporaries)
    active_expert_fraction: float  # experts_per_token / num_experts (1.0 for dense)
    vision: int = 0       # vision tower and merger(s) of a vision-language model, counted whole

    @cached_property
    def linear_weights(self) -> int:
        return sum(lin.weight_params for lin in self.linears)

    @cached_property
    def linear_biases(self) -> int:
        return sum(lin.bias_params for lin in self.linears)

    @cached_property
    def expert_weights(self) -> int:
        return sum(lin.weight_params for lin in self.linears if lin.expert)

    @cached_property
    def dense_linears(self) -> tuple[Linear, ...]:
        """The nn.Linear modules (outside fused MoE experts): what bitsandbytes and GPTQ quantize."""
        return tuple(lin for lin in self.linears if not lin.expert)

    @cached_property
    def total(self) -> int:
        return (self.embedding + self.positions + self.lm_head + self.lm_head_bias + self.norms
                + self.router + self.linear_weights + self.linear_biases + self.vision)

    @cached_property
    def dense_fraction(self) -> float:
        """Share of the linear weights outside MoE experts."""
        return sum(lin.weight_params for lin in self.dense_linears) / max(self.linear_weights, 1)

    @cached_property
    def attention_weights(self) -> int:
        """Attention projection weights of the whole model (elements)."""
        return sum(lin.d_in * lin.d_out for lin in self.linears
                   if lin.role in ATTENTION_ROLES or lin.role in MLA_ROLES or lin.role in LINEAR_ATTENTION_ROLES)

    @cached_property
    def active(self) -> int:
        """Parameters used per token: all but the unrouted experts (MoE); equals total for dense."""
        idle = self.expert_weights + sum(l.bias_params for l in self.linears if l.expert)
        return self.total - round(idle * (1.0 - self.active_expert_fraction))


def _norm_params(spec: ModelSpec, width: int) -> int:
    return width * spec.norm_tensors


def _attention_linears(spec: ModelSpec) -> list[Linear]:
    h, n = spec.hidden_size, spec.num_attention_layers
    if spec.is_mla:
        return _mla_linears(spec)
    gated = 2 if spec.attn_output_gate else 1   # Qwen3-Next: queries and the output gate from one q_proj
    return _linear_attention_linears(spec) + [
        Linear("q_proj", h, gated * spec.q_dim, n, spec.qkv_bias),
        Linear("k_proj", h, spec.kv_dim, n, spec.qkv_bias),
        Linear("v_proj", h, spec.kv_dim, n, spec.qkv_bias),
        Linear("o_proj", spec.q_dim, h, n, spec.o_bias),
    ]


def _linear_attention_linears(spec: ModelSpec) -> list[Linear]:
    """Qwen3NextGatedDeltaNet: in_proj_qkvz (q, k, v and the gate z), in_proj_ba (beta and the
    decay's input, one each per value head), out_proj; no biases."""
    n = spec.num_linear_layers
    if not n:
        return []
    h, key_dim, value_dim = spec.hidden_size, spec.linear_key_dim, spec.linear_value_dim
    return [Linear("in_proj_qkvz", h, 2 * key_dim + 2 * value_dim, n, False),
            Linear("in_proj_ba", h, 2 * spec.linear_value_heads, n, False),
            Linear("out_proj", value_dim, h, n, False)]


def _mla_linears(spec: ModelSpec) -> list[Linear]:
    """DeepseekV2/V3Attention: q through a low-rank q_a/q_b pair (or one q_proj), keys and values
    from a latent (`kv_a_proj_with_mqa`: latent + the shared rotary key) expanded by kv_b_proj.
    `attention_bias` puts biases on q_a, kv_a and o_proj only."""
    h, n, bias = spec.hidden_size, spec.num_layers, spec.qkv_bias
    if spec.q_lora_rank:
        q = [Linear("q_a_proj", h, spec.q_lora_rank, n, bias),
             Linear("q_b_proj", spec.q_lora_rank, spec.q_dim, n, False)]
    else:
        q = [Linear("q_proj", h, spec.q_dim, n, False)]
    per_head = spec.qk_nope_head_dim + spec.v_head_dim
    return q + [Linear("kv_a_proj_with_mqa", h, spec.kv_lora_rank + spec.qk_rope_head_dim, n, bias),
                Linear("kv_b_proj", spec.kv_lora_rank, spec.num_heads * per_head, n, False),
                Linear("o_proj", spec.o_dim, h, n, spec.o_bias)]


def _mlp_linears(spec: ModelSpec, width: int, count: int, expert: bool = False) -> list[Linear]:
    h, bias = spec.hidden_size, (spec.expert_bias if expert else spec.mlp_bias)
    if spec.mlp_gated:
        return [Linear("gate_proj", h, width, count, bias, expert),
                Linear("up_proj", h, width, count, bias, expert),
                Linear("down_proj", width, h, count, bias, expert)]
    return [Linear("up_proj", h, width, count, bias, expert),
            Linear("down_proj", width, h, count, bias, expert)]


def _feed_forward(spec: ModelSpec) -> tuple[list[Linear], int]:
    """MLP and MoE linears of all layers, and the router parameter count."""
    if not spec.is_moe:
        return _mlp_linears(spec, spec.intermediate_size, spec.num_layers), 0
    n_moe = spec.num_moe_layers
    n_dense = spec.num_layers - n_moe
    linears = _mlp_linears(spec, spec.moe_intermediate_size, n_moe * spec.num_experts, expert=True)
    if n_dense:
        linears += _mlp_linears(spec, spec.intermediate_size, n_dense)
    router = n_moe * (spec.hidden_size + int(spec.router_bias)) * spec.num_experts
    if spec.shared_expert_intermediate_size:
        linears += _mlp_linears(spec, spec.shared_expert_intermediate_size, n_moe)
        router += n_moe * spec.hidden_size * (1 if spec.shared_expert_gate else 0)
    return linears, router


def _norms(spec: ModelSpec) -> int:
    h = spec.hidden_size
    per_layer = spec.norms_per_layer * _norm_params(spec, h)
    per_attention_layer = 0
    if spec.qk_norm:
        if spec.qk_norm_full:   # weight only in every family that has them (OLMo-2, Cohere, StableLM per head)
            per_attention_layer += spec.q_dim + spec.kv_dim
        else:
            per_attention_layer += _norm_params(spec, 2 * spec.head_dim)
    if spec.is_mla:  # q_a_layernorm (with q_lora_rank) and kv_a_layernorm
        per_layer += spec.q_lora_rank + spec.kv_lora_rank
    if spec.attention_sinks:  # not a norm: one sink logit per head (gpt-oss), kept with them
        per_layer += spec.num_heads
    # Not norms, kept with them (small, unquantized, no LoRA): the gated delta-net's depthwise
    # conv1d weight (conv_dim x kernel, no bias), dt_bias and A_log (one per value head) and its
    # gated RMSNorm over the value head dim.
    per_linear_layer = (spec.linear_conv_dim * spec.linear_conv_kernel + 2 * spec.linear_value_heads
                        + spec.linear_value_head_dim) if spec.num_linear_layers else 0
    total = (spec.num_layers * per_layer + spec.num_attention_layers * per_attention_layer
             + spec.num_linear_layers * per_linear_layer)
    total += _norm_params(spec, h) if spec.final_norm else 0
    total += _norm_params(spec, spec.embed_dim) if spec.embed_norm else 0
    return total


def _projections(spec: ModelSpec) -> list[Linear]:
    """OPT-350m projects a narrow embedding in and out of the residual width (no bias)."""
    if spec.embed_dim == spec.hidden_size:
        return []
    return [Linear("project_in", spec.embed_dim, spec.hidden_size, 1, False),
            Linear("project_out", spec.hidden_size, spec.embed_dim, 1, False)]


def _expert_block(spec: ModelSpec, linears: list[Linear]) -> int:
    """One layer's experts: transformers 5 fuses them into 3-D tensors of one module."""
    if not spec.is_moe or not spec.num_moe_layers:
        return 0
    per_layer = sum(lin.weight_params + lin.bias_params for lin in linears if lin.expert)
    return per_layer // spec.num_moe_layers


@lru_cache(maxsize=1024)
def count_params(spec: ModelSpec) -> ParamCounts:
    """Exact parameter counts by component (cached: specs are frozen)."""
    if getattr(spec, "card_path", ""):   # structure card (estimator/cards.py): counted on the meta build
        from estimator.cards import card_params
        return card_params(spec)
    feed_forward, router = _feed_forward(spec)
    linears = tuple(_attention_linears(spec) + feed_forward + _projections(spec))
    embedding = spec.vocab_size * spec.embed_dim
    lm_head = 0 if spec.tied_embeddings else embedding
    lm_head_bias = spec.vocab_size if spec.lm_head_bias else 0
    positions = spec.learned_positions * spec.hidden_size
    largest = max([embedding, lm_head + lm_head_bias, positions, _expert_block(spec, linears)]
                  + [lin.d_in * lin.d_out + (lin.d_out if lin.bias else 0) for lin in linears])
    fraction = spec.experts_per_token / spec.num_experts if spec.is_moe else 1.0
    return ParamCounts(
        embedding=embedding, positions=positions, lm_head=lm_head, lm_head_bias=lm_head_bias,
        norms=_norms(spec), router=router, linears=linears, largest_layer=largest,
        active_expert_fraction=fraction, vision=spec.vision_params,
    )
