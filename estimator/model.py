"""`ModelSpec`: the architecture facts that memory, FLOPs and KV cache depend on.

Built from a Hugging Face `config.json` dict by an explicit mapping per `model_type` (never by
guessing the architecture from ratios of numbers). Defaults for keys a config omits are the
defaults of the transformers 5.23 config class of that `model_type`.
"""

from __future__ import annotations

import hashlib
from dataclasses import astuple, dataclass, fields
from functools import cached_property

from estimator.errors import InputError
from estimator.limits import check_count, limit


@dataclass(frozen=True)
class ModelSpec:
    """One decoder-only language model, as the memory and FLOP formulas see it.

    Sizes are element counts. `layer_types` holds one entry per layer: "full" or "sliding".
    """

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mlp_gated: bool            # SwiGLU/GeGLU: gate, up, down; else fc1, fc2
    activation: str
    norm: str                  # "rms" (weight), "layer" (weight + bias), "layer_nobias" (weight only: Cohere),
                               # "layer_noparam" (neither: OLMo-1's F.layer_norm without weight)
    norms_per_layer: int
    qk_norm: bool              # per-head RMSNorm on q and k (Qwen3, Gemma-3)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    lm_head_bias: bool
    tied_embeddings: bool
    learned_positions: int     # rows of a learned position table (GPT-2, OPT), 0 for rotary/ALiBi
    embed_dim: int             # width of the token embedding (OPT-350m projects 512 -> 1024)
    embed_norm: bool           # LayerNorm right after the embedding (BLOOM)
    final_norm: bool
    parallel_block: bool       # attention and MLP read the same input (Falcon, Phi, GPT-NeoX)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    moe_layer_flags: tuple[bool, ...] = ()
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    logit_softcap: bool = False
    max_position_embeddings: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3): kv_lora_rank > 0. q_lora_rank 0 = one q_proj.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    qk_norm_full: bool = False     # q/k norms over the whole q/k width (OLMo-2, OLMoE, Cohere)
    attention_sinks: bool = False  # one learned sink logit per head and layer (gpt-oss)
    router_bias: bool = False      # MoE router with a bias (gpt-oss) or a stored score bias (ERNIE-4.5)
    expert_bias: bool = False      # the fused experts carry biases (gpt-oss)
    # Gated delta-net linear attention (Qwen3-Next): layers whose layer_types entry is "linear"
    # hold a conv state and a recurrent state instead of a KV cache (constant in sequence length).
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    attn_output_gate: bool = False  # q_proj also emits a sigmoid gate on the attention output (Qwen3-Next)
    # Vision-language models (Qwen2.5-VL, Qwen3-VL): the vision tower and its merger(s), counted
    # whole (estimator.model._vision_params); the language model is the rest of the spec.
    vision_params: int = 0
    # its nn.Linear modules as (name with {} for the block index, d_in, d_out, blocks): LoRA sites
    vision_linears: tuple[tuple[str, int, int, int], ...] = ()
    qkv_clip: bool = False         # q, k, v clamped in place (OLMo `clip_qkv`)
    # layers with a weightless fp32 L2 norm on q and k after the rotary (Llama-4's Llama4TextL2Norm on
    # its rotary layers when use_qk_norm)
    qk_l2_norm_layers: int = 0

    def __hash__(self) -> int:
        # Specs are dictionary keys of every cache; hashing 30 fields each time costs more than
        # the arithmetic they feed, so the hash is computed once.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(astuple(self))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        # A str's hash differs between processes (PYTHONHASHSEED): a pickled or copied spec must
        # not carry the cached one, or it would hash unlike an equal spec where it lands.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @cached_property
    def fingerprint(self) -> str:
        """8 hex digits of a hash of the architecture (stable across processes, name excluded)."""
        # fields added later count only where they differ from their default, so specs without
        # them keep the fingerprints stored ids carry (qkv_clip as its bare value, as first stored)
        base = tuple(getattr(self, f.name) for f in fields(self)[1:] if f.name not in _LATER_FIELDS)
        later = tuple((name, getattr(self, name)) for name in _LATER_FIELDS[:-1]
                      if getattr(self, name) != _FIELD_DEFAULTS[name])
        values = base + later + ((True,) if self.qkv_clip else ())
        return hashlib.sha1(repr(values).encode()).hexdigest()[:8]

    @property
    def norm_tensors(self) -> int:
        """Parameter tensors of one hidden-width norm: weight and bias, weight, or none."""
        return {"layer": 2, "layer_noparam": 0}.get(self.norm, 1)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def vision_other_params(self) -> int:
        """Elements of a VL model's vision tower outside its nn.Linear weights (patch embedding,
        norms, biases, position table): what a per-tensor count lumps into one."""
        return self.vision_params - sum(d_in * d_out * n for _, d_in, d_out, n in self.vision_linears)

    @property
    def q_dim(self) -> int:
        """Width of the queries (heads x head_dim; MLA: heads x (nope + rope) dims)."""
        if self.is_mla:
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys (kv heads x head_dim; MLA: the expanded keys, one per head)."""
        if self.is_mla:
            return self.q_dim
        return self.num_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of the values and of the attention output (MLA: heads x v_head_dim)."""
        if self.is_mla:
            return self.num_heads * self.v_head_dim
        return self.kv_dim

    @property
    def o_dim(self) -> int:
        """Width of the o_proj input (the attention output over all heads)."""
        return self.num_heads * self.v_head_dim if self.is_mla else self.q_dim

    def kv_cache_width(self, tp: int = 1) -> int:
        """Elements one layer's cache holds per token, keys and values together, on one of `tp`
        ranks. MLA (transformers 5.23 DeepseekV2/V3Attention): `past_key_values.update` stores the
        compressed latent (kv_lora_rank) as "keys" and the shared rotary key (qk_rope_head_dim) as
        "values", one head, before kv_b_proj expands them: not split by tensor parallel. Else
        2 x kv heads x head_dim, kv heads split over ranks (one whole head each when fewer)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        heads = self.num_kv_heads // tp if self.num_kv_heads >= tp else 1
        return 2 * heads * self.head_dim

    @cached_property
    def window_layers(self) -> tuple[int, int]:
        """(layers attending to every token, layers attending to a sliding window); linear-attention
        layers (Qwen3-Next's gated delta-net) are neither."""
        sliding = sum(1 for t in self.layer_types if t == "sliding") if self.sliding_window else 0
        return self.num_layers - sliding - self.num_linear_layers, sliding

    @cached_property
    def num_linear_layers(self) -> int:
        """Layers with gated delta-net linear attention instead of softmax attention."""
        return sum(1 for t in self.layer_types if t == "linear")

    @property
    def num_attention_layers(self) -> int:
        """Layers with softmax attention (q/k/v/o projections and a KV cache)."""
        return self.num_layers - self.num_linear_layers

    @property
    def linear_key_dim(self) -> int:
        return self.linear_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the depthwise causal conv over q, k and v (Qwen3NextGatedDeltaNet.conv_dim)."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def linear_state_bytes(self, batch: int, dtype_bytes: int) -> int:
        """What transformers 5.23's LinearAttentionLayer keeps per linear-attention layer, whatever
        the sequence length: the conv state (batch, conv_dim, kernel) in the activations' dtype and
        the recurrent state (batch, value heads, key head dim, value head dim) in fp32 (the
        torch chunked/recurrent gated delta rule computes and returns it in float32)."""
        per_layer = (self.linear_conv_dim * self.linear_conv_kernel * dtype_bytes
                     + 4 * self.linear_value_heads * self.linear_key_head_dim * self.linear_value_head_dim)
        return batch * self.num_linear_layers * per_layer

    def attended_tokens(self, tokens: int) -> int:
        """Sum over layers of the keys one query at position `tokens` attends (or caches)."""
        full, sliding = self.window_layers
        return full * tokens + (sliding * min(tokens, self.sliding_window) if sliding else 0)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_flags)


# fields added after ids were first stored (estimator.model.ModelSpec.fingerprint): qkv_clip last
_LATER_FIELDS = ("linear_key_heads", "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel", "attn_output_gate", "vision_params", "vision_linears", "qk_l2_norm_layers",
                 "qkv_clip")
_FIELD_DEFAULTS = {f.name: f.default for f in fields(ModelSpec)}


def _get(cfg: dict, key: str, default=None):
    value = cfg.get(key, default)
    return default if value is None else value


def _require(cfg: dict, *keys: str) -> int:
    """First present key among `keys` (HF renamed fields across families)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise InputError(f"config is missing '{keys[0]}' (model_type {cfg.get('model_type')!r})")


def _layer_types(cfg: dict, n_layers: int, default_sliding: bool) -> tuple[str, ...]:
    """Per-layer attention kind from `layer_types`, else all sliding when a window is set."""
    given = cfg.get("layer_types")
    if given:
        if len(given) != n_layers:
            raise InputError(f"config layer_types has {len(given)} entries for {n_layers} layers")
        return tuple("sliding" if "sliding" in t else "full" for t in given)
    return tuple("sliding" if default_sliding else "full" for _ in range(n_layers))


def _llama_like(cfg: dict, name: str, **overrides) -> ModelSpec:
    """Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3, Mixtral, Qwen-MoE: RMSNorm, gated MLP."""
    mt = cfg["model_type"]
    hidden = _require(cfg, "hidden_size")
    heads = _require(cfg, "num_attention_heads")
    kv_heads = _get(cfg, "num_key_value_heads", heads)
    head_dim = _get(cfg, "head_dim", hidden // heads)
    layers = _require(cfg, "num_hidden_layers")
    attention_bias = bool(_get(cfg, "attention_bias", False))
    window = cfg.get("sliding_window")
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        window = window if cfg.get("use_sliding_window") else None
    fields = dict(
        name=name, model_type=mt, vocab_size=_require(cfg, "vocab_size"), hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=_require(cfg, "intermediate_size"), mlp_gated=True,
        activation=_get(cfg, "hidden_activation", _get(cfg, "hidden_act", "silu")),
        norm="rms", norms_per_layer=2, qk_norm=False, qkv_bias=attention_bias,
        o_bias=attention_bias, mlp_bias=bool(_get(cfg, "mlp_bias", False)), lm_head_bias=False,
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", False)), learned_positions=0,
        embed_dim=hidden, embed_norm=False, final_norm=True, parallel_block=False,
        sliding_window=window, max_position_embeddings=_get(cfg, "max_position_embeddings", 0),
    )
    fields.update(overrides)
    if "layer_types" not in overrides:
        fields["layer_types"] = _layer_types(cfg, layers, fields["sliding_window"] is not None)
    if not any(t == "sliding" for t in fields["layer_types"]):
        fields["sliding_window"] = None
    return ModelSpec(**fields)


def _gemma_layer_types(cfg: dict, layers: int, pattern: int) -> tuple[str, ...]:
    """Gemma-2 alternates local/global; Gemma-3 has `pattern - 1` local then one global."""
    if cfg.get("layer_types"):
        return _layer_types(cfg, layers, False)
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers))


def _moe_flags(cfg: dict, layers: int) -> tuple[bool, ...]:
    """Which layers hold a sparse MoE block (Qwen-MoE: `decoder_sparse_step`, `mlp_only_layers`)."""
    step = _get(cfg, "decoder_sparse_step", 1)
    dense_only = set(_get(cfg, "mlp_only_layers", []))
    return tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))


def _from_llama_family(cfg: dict, name: str) -> ModelSpec:
    mt = cfg["model_type"]
    layers = _require(cfg, "num_hidden_layers")
    if mt in ("llama", "mistral"):
        return _llama_like(cfg, name)
    if mt == "qwen2":
        return _llama_like(cfg, name, qkv_bias=True, o_bias=False)
    if mt == "qwen3":
        return _llama_like(cfg, name, qk_norm=True)
    if mt == "gemma":
        return _llama_like(cfg, name, tied_embeddings=bool(_get(cfg, "tie_word_embeddings", True)))
    if mt in ("gemma2", "gemma3_text"):
        pattern = 2 if mt == "gemma2" else _get(cfg, "sliding_window_pattern", 6)
        return _llama_like(
            cfg, name, norms_per_layer=4, qk_norm=(mt == "gemma3_text"),
            tied_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
            layer_types=_gemma_layer_types(cfg, layers, pattern),
            logit_softcap=cfg.get("final_logit_softcapping") is not None,
        )
    if mt == "phi3":
        return _llama_like(cfg, name)
    if mt == "mixtral":
        return _llama_like(
            cfg, name, num_experts=_require(cfg, "num_local_experts"),
            experts_per_token=_require(cfg, "num_experts_per_tok"),
            moe_intermediate_size=_require(cfg, "intermediate_size"),
            moe_layer_flags=(True,) * layers,
        )
    if mt in ("qwen2_moe", "qwen3_moe"):
        shared = _get(cfg, "shared_expert_intermediate_size", 0) if mt == "qwen2_moe" else 0
        return _llama_like(
            cfg, name, qkv_bias=(mt == "qwen2_moe"), o_bias=False, qk_norm=(mt == "qwen3_moe"),
            num_experts=_require(cfg, "num_experts", "num_local_experts"),
            experts_per_token=_require(cfg, "num_experts_per_tok"),
            moe_intermediate_size=_require(cfg, "moe_intermediate_size"),
            shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0,
            moe_layer_flags=_moe_flags(cfg, layers),
        )
    raise AssertionError(mt)


def _plain(cfg: dict, name: str, **fields) -> ModelSpec:
    """GPT-2-era families: LayerNorm with bias, fc1/fc2 MLP, no sliding windows."""
    base = dict(
        name=name, model_type=cfg["model_type"], mlp_gated=False, norm="layer", qk_norm=False,
        lm_head_bias=False, learned_positions=0, embed_norm=False, final_norm=True,
        parallel_block=False, layer_types=(("full",) * fields["num_layers"]),
    )
    base.update(fields)
    base.setdefault("embed_dim", base["hidden_size"])
    base.setdefault("num_kv_heads", base["num_heads"])
    base.setdefault("head_dim", base["hidden_size"] // base["num_heads"])
    return ModelSpec(**base)


def _from_gpt2(cfg: dict, name: str) -> ModelSpec:
    hidden = _require(cfg, "n_embd", "hidden_size")
    mqa = cfg["model_type"] == "gpt_bigcode" and bool(_get(cfg, "multi_query", True))
    heads = _require(cfg, "n_head", "num_attention_heads")
    return _plain(
        cfg, name, vocab_size=_require(cfg, "vocab_size"), hidden_size=hidden,
        num_layers=_require(cfg, "n_layer", "num_hidden_layers"), num_heads=heads,
        num_kv_heads=1 if mqa else heads, intermediate_size=_get(cfg, "n_inner", 4 * hidden),
        activation=_get(cfg, "activation_function", "gelu_new"), norms_per_layer=2,
        qkv_bias=True, o_bias=True, mlp_bias=True,
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
        learned_positions=_require(cfg, "n_positions", "max_position_embeddings"),
        max_position_embeddings=_require(cfg, "n_positions", "max_position_embeddings"),
    )


def _from_opt(cfg: dict, name: str) -> ModelSpec:
    hidden = _require(cfg, "hidden_size")
    final = bool(_get(cfg, "do_layer_norm_before", True)) and not cfg.get("_remove_final_layer_norm")
    bias = bool(_get(cfg, "enable_bias", True))
    positions = _require(cfg, "max_position_embeddings")
    return _plain(
        cfg, name, vocab_size=_require(cfg, "vocab_size"), hidden_size=hidden,
        num_layers=_require(cfg, "num_hidden_layers"), num_heads=_require(cfg, "num_attention_heads"),
        intermediate_size=_require(cfg, "ffn_dim"), activation=_get(cfg, "activation_function", "relu"),
        norms_per_layer=2, qkv_bias=bias, o_bias=bias, mlp_bias=bias,
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
        learned_positions=positions + 2,  # OPT offsets positions by 2
        embed_dim=_get(cfg, "word_embed_proj_dim", hidden), final_norm=final,
        max_position_embeddings=positions,
    )


def _from_bloom(cfg: dict, name: str) -> ModelSpec:
    hidden = _require(cfg, "hidden_size", "n_embed")
    return _plain(
        cfg, name, vocab_size=_require(cfg, "vocab_size"), hidden_size=hidden,
        num_layers=_require(cfg, "n_layer", "num_hidden_layers"),
        num_heads=_require(cfg, "n_head", "num_attention_heads"), intermediate_size=4 * hidden,
        activation="bloom_gelu", norms_per_layer=2, qkv_bias=True, o_bias=True, mlp_bias=True,
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", True)), embed_norm=True,
    )


def _from_falcon(cfg: dict, name: str) -> ModelSpec:
    hidden = _require(cfg, "hidden_size")
    heads = _require(cfg, "num_attention_heads")
    new_arch = bool(_get(cfg, "new_decoder_architecture", False))
    if new_arch:
        kv_heads = _get(cfg, "num_kv_heads", heads)
    else:
        kv_heads = 1 if _get(cfg, "multi_query", True) else heads
    parallel = bool(_get(cfg, "parallel_attn", True))
    norms = 2 if (new_arch and _get(cfg, "num_ln_in_parallel_attn", 2) == 2) or not parallel else 1
    bias = bool(_get(cfg, "bias", False))
    return _plain(
        cfg, name, vocab_size=_require(cfg, "vocab_size"), hidden_size=hidden,
        num_layers=_require(cfg, "num_hidden_layers"), num_heads=heads, num_kv_heads=kv_heads,
        intermediate_size=_get(cfg, "ffn_hidden_size", 4 * hidden), activation="gelu",
        norms_per_layer=norms, qkv_bias=bias, o_bias=bias, mlp_bias=bias,
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", True)), parallel_block=parallel,
        max_position_embeddings=_get(cfg, "max_position_embeddings", 2048),
    )


def _from_neox(cfg: dict, name: str) -> ModelSpec:
    bias = bool(_get(cfg, "attention_bias", True))
    return _plain(
        cfg, name, vocab_size=_require(cfg, "vocab_size"), hidden_size=_require(cfg, "hidden_size"),
        num_layers=_require(cfg, "num_hidden_layers"), num_heads=_require(cfg, "num_attention_heads"),
        intermediate_size=_require(cfg, "intermediate_size"), activation=_get(cfg, "hidden_act", "gelu"),
        norms_per_layer=2, qkv_bias=bias, o_bias=bias, mlp_bias=True,
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        parallel_block=bool(_get(cfg, "use_parallel_residual", True)),
        max_position_embeddings=_get(cfg, "max_position_embeddings", 2048),
    )


def _from_phi(cfg: dict, name: str) -> ModelSpec:
    heads = _require(cfg, "num_attention_heads")
    return _plain(
        cfg, name, vocab_size=_require(cfg, "vocab_size"), hidden_size=_require(cfg, "hidden_size"),
        num_layers=_require(cfg, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=_get(cfg, "num_key_value_heads", heads),
        intermediate_size=_require(cfg, "intermediate_size"), activation=_get(cfg, "hidden_act", "gelu_new"),
        norms_per_layer=1, qkv_bias=True, o_bias=True, mlp_bias=True, lm_head_bias=True,
        qk_norm=bool(_get(cfg, "qk_layernorm", False)),
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", False)), parallel_block=True,
        max_position_embeddings=_get(cfg, "max_position_embeddings", 2048),
    )


# ---- newer families (transformers 5.23 modeling code read per model_type) ------------------------

def _first_k_dense(cfg: dict, layers: int, default: int) -> tuple[bool, ...]:
    """DeepSeek/GLM-MoE: layers before `first_k_dense_replace` hold a dense MLP, the rest MoE."""
    k = _get(cfg, "first_k_dense_replace", default)
    return tuple(i >= k for i in range(layers))


def _from_deepseek(cfg: dict, name: str) -> ModelSpec:
    """DeepSeek-V2/V3 (and Kimi-K2): multi-head latent attention; MoE with shared experts after
    `first_k_dense_replace` dense layers; the router's `e_score_correction_bias` is a buffer."""
    mt = cfg["model_type"]
    layers = _require(cfg, "num_hidden_layers")
    v3 = mt == "deepseek_v3"
    moe_width = _get(cfg, "moe_intermediate_size", 2048 if v3 else 1407)
    shared = _get(cfg, "n_shared_experts", 1 if v3 else 2) * moe_width
    bias = bool(_get(cfg, "attention_bias", False))
    rope = _get(cfg, "qk_rope_head_dim", 64)
    return _llama_like(
        cfg, name, head_dim=rope, qkv_bias=bias, o_bias=bias,
        q_lora_rank=_get(cfg, "q_lora_rank", 0) if "q_lora_rank" in cfg else 1536,  # null: one q_proj
        kv_lora_rank=_get(cfg, "kv_lora_rank", 512), qk_rope_head_dim=rope,
        qk_nope_head_dim=_get(cfg, "qk_nope_head_dim", 128), v_head_dim=_get(cfg, "v_head_dim", 128),
        num_experts=_require(cfg, "n_routed_experts", "num_local_experts"),
        experts_per_token=_require(cfg, "num_experts_per_tok"), moe_intermediate_size=moe_width,
        shared_expert_intermediate_size=shared,
        moe_layer_flags=_first_k_dense(cfg, layers, 3 if v3 else 0),
        mlp_bias=False, sliding_window=None,
    )


def _from_gpt_oss(cfg: dict, name: str) -> ModelSpec:
    """gpt-oss: MoE on every layer (router and experts with biases), attention with biases and a
    learned sink per head, alternating sliding (even layers) and full attention."""
    layers = _require(cfg, "num_hidden_layers")
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return _llama_like(
        {**cfg, "layer_types": types, "sliding_window": _get(cfg, "sliding_window", 128)}, name,
        head_dim=_get(cfg, "head_dim", 64), qkv_bias=bool(_get(cfg, "attention_bias", True)),
        o_bias=bool(_get(cfg, "attention_bias", True)), expert_bias=True, attention_sinks=True,
        router_bias=True, activation="gpt_oss_swiglu",
        num_experts=_require(cfg, "num_local_experts"), experts_per_token=_require(cfg, "num_experts_per_tok"),
        moe_intermediate_size=_require(cfg, "intermediate_size"), moe_layer_flags=(True,) * layers,
    )


def _from_olmo(cfg: dict, name: str) -> ModelSpec:
    """OLMo-2 (post-norms after attention and MLP, q/k RMSNorm over the whole width), OLMoE
    (pre-norms, the same q/k norms, MoE on every layer without shared experts)."""
    layers = _require(cfg, "num_hidden_layers")
    if cfg["model_type"] == "olmo2":
        return _llama_like(cfg, name, qk_norm=True, qk_norm_full=True)
    return _llama_like(
        cfg, name, qk_norm=True, qk_norm_full=True, num_experts=_require(cfg, "num_experts"),
        experts_per_token=_require(cfg, "num_experts_per_tok"),
        moe_intermediate_size=_require(cfg, "intermediate_size"), moe_layer_flags=(True,) * layers)


def _from_granite(cfg: dict, name: str) -> ModelSpec:
    """Granite: Llama with scalar multipliers (no parameters); GraniteMoE: fused experts on every
    layer (`block_sparse_moe`), `intermediate_size` is the expert width."""
    if cfg["model_type"] == "granite":
        return _llama_like(cfg, name)
    layers = _require(cfg, "num_hidden_layers")
    return _llama_like(
        cfg, name, num_experts=_require(cfg, "num_local_experts"), experts_per_token=_require(cfg, "num_experts_per_tok"),
        moe_intermediate_size=_require(cfg, "intermediate_size"), moe_layer_flags=(True,) * layers)


def _from_smollm3(cfg: dict, name: str) -> ModelSpec:
    """SmolLM3: Llama with NoPE every `no_rope_layer_interval`-th layer (no parameters); sliding
    layers only where `use_sliding_window` and the layer has no rotary (config's layer_types)."""
    layers = _require(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if not types:
        interval = _get(cfg, "no_rope_layer_interval", 4)
        no_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        sliding = bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window") is not None
        types = ["sliding_attention" if sliding and not no_rope[i] else "full_attention" for i in range(layers)]
    return _llama_like({**cfg, "layer_types": types}, name,
                       tied_embeddings=bool(_get(cfg, "tie_word_embeddings", True)))


def _from_starcoder2(cfg: dict, name: str) -> ModelSpec:
    """StarCoder2: LayerNorm with bias, c_fc/c_proj MLP (gelu_pytorch_tanh), biases where
    `use_bias`, GQA, a sliding window on every layer when set, tied embeddings by default."""
    bias = bool(_get(cfg, "use_bias", True))
    return _llama_like(
        cfg, name, mlp_gated=False, activation=_get(cfg, "hidden_act", "gelu_pytorch_tanh"), norm="layer",
        qkv_bias=bias, o_bias=bias, mlp_bias=bias, tied_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
        num_kv_heads=_get(cfg, "num_key_value_heads", 2))


def _from_cohere(cfg: dict, name: str) -> ModelSpec:
    """Cohere (Command-R): one weight-only LayerNorm feeding attention and MLP in parallel, optional
    q/k LayerNorms over (heads, head_dim), tied embeddings by default."""
    return _llama_like(
        cfg, name, norm="layer_nobias", norms_per_layer=1, parallel_block=True,
        qk_norm=bool(_get(cfg, "use_qk_norm", False)), qk_norm_full=True,
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", True)))


def _from_exaone4(cfg: dict, name: str) -> ModelSpec:
    """EXAONE-4: post-norms (as OLMo-2), per-head q/k RMSNorm, sliding layers from the config's
    `layer_types` or every layer but each `sliding_window_pattern`-th."""
    layers = _require(cfg, "num_hidden_layers")
    window = cfg.get("sliding_window", 4096)
    types = cfg.get("layer_types")
    if not types:
        pattern = _get(cfg, "sliding_window_pattern", 4) if window is not None else 0
        types = ["sliding_attention" if pattern and (i + 1) % pattern != 0 else "full_attention"
                 for i in range(layers)]
    return _llama_like({**cfg, "layer_types": types, "sliding_window": window}, name, qk_norm=True,
                       num_kv_heads=_get(cfg, "num_key_value_heads", 32))


def _from_glm4_moe(cfg: dict, name: str) -> ModelSpec:
    """GLM-4.5: q/k/v biases (`attention_bias`), o_proj without, optional per-head q/k norms,
    MoE with shared experts after `first_k_dense_replace` dense layers (score bias: a buffer)."""
    layers = _require(cfg, "num_hidden_layers")
    width = _get(cfg, "moe_intermediate_size", 1408)
    return _llama_like(
        cfg, name, o_bias=False, qk_norm=bool(_get(cfg, "use_qk_norm", False)),
        num_kv_heads=_get(cfg, "num_key_value_heads", 8),
        num_experts=_get(cfg, "n_routed_experts", 128), experts_per_token=_get(cfg, "num_experts_per_tok", 8),
        moe_intermediate_size=width, shared_expert_intermediate_size=_get(cfg, "n_shared_experts", 1) * width,
        moe_layer_flags=_first_k_dense(cfg, layers, 1), sliding_window=None)


def _from_phimoe(cfg: dict, name: str) -> ModelSpec:
    """Phi-3.5-MoE: LayerNorm with bias, attention biases (`attention_bias`), MoE on every layer,
    optional lm_head bias."""
    layers = _require(cfg, "num_hidden_layers")
    return _llama_like(
        cfg, name, norm="layer", num_kv_heads=_get(cfg, "num_key_value_heads", 8),
        lm_head_bias=bool(_get(cfg, "lm_head_bias", False)),
        num_experts=_get(cfg, "num_local_experts", 16), experts_per_token=_get(cfg, "num_experts_per_tok", 2),
        moe_intermediate_size=_require(cfg, "intermediate_size"), moe_layer_flags=(True,) * layers)


def _from_ernie_moe(cfg: dict, name: str) -> ModelSpec:
    """ERNIE-4.5-MoE: biases everywhere when `use_bias` (lm_head too), MoE on layers
    start <= i <= end with (i + 1) % interval == 0, shared experts, an fp32 router with a stored
    score bias (a frozen parameter), tied embeddings by default."""
    layers = _require(cfg, "num_hidden_layers")
    bias = bool(_get(cfg, "use_bias", False))
    start, end = _get(cfg, "moe_layer_start_index", 1), _get(cfg, "moe_layer_end_index", -1)
    end = layers - 1 if end == -1 else end
    interval = _get(cfg, "moe_layer_interval", 1)
    width = _get(cfg, "moe_intermediate_size", 1536)
    return _llama_like(
        cfg, name, qkv_bias=bias, o_bias=bias, mlp_bias=bias, lm_head_bias=bias,
        num_kv_heads=_get(cfg, "num_key_value_heads", 4),
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
        num_experts=_require(cfg, "moe_num_experts", "num_experts"),
        experts_per_token=_require(cfg, "moe_k", "num_experts_per_tok"), moe_intermediate_size=width,
        shared_expert_intermediate_size=_get(cfg, "moe_num_shared_experts", 2) * width, router_bias=True,
        moe_layer_flags=tuple((i + 1) % interval == 0 and start <= i <= end for i in range(layers)))


def _from_llama4_text(cfg: dict, name: str) -> ModelSpec:
    """Llama-4 text (transformers 5.23 Llama4TextConfig/Llama4TextModel): MoE on `moe_layers`
    (default every `interleave_moe_layer_step`-th layer) with a shared expert as wide as the experts
    (`intermediate_size`), dense layers `intermediate_size_mlp` wide; NoPE layers (`no_rope_layers`
    0) attend to every token, the rotary ones to chunks of `attention_chunk_size` (their cache is a
    sliding window of that size: cache_utils "chunked_attention"); the q/k L2 norm has no weight."""
    layers = _require(cfg, "num_hidden_layers")
    interval = _get(cfg, "no_rope_layer_interval", 4)
    # transformers indexes no_rope_layers by layer (Llama4TextAttention): entries past the last layer are unread
    no_rope = (cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)])[:layers]
    chunk = _get(cfg, "attention_chunk_size", 8192)
    types = cfg.get("layer_types") or ["chunked_attention" if uses_rope else "full_attention" for uses_rope in no_rope]
    if len(types) != layers:
        raise InputError(f"config layer_types has {len(types)} entries for {layers} layers")
    step = _get(cfg, "interleave_moe_layer_step", 1)
    moe_layers = cfg.get("moe_layers")
    moe_layers = set(moe_layers if moe_layers is not None else range(step - 1, layers, step))
    width = _get(cfg, "intermediate_size", 8192)
    return _llama_like(
        {**cfg, "intermediate_size": _get(cfg, "intermediate_size_mlp", 16384)}, name,
        num_kv_heads=_get(cfg, "num_key_value_heads", _require(cfg, "num_attention_heads")),
        head_dim=_get(cfg, "head_dim", 128), num_experts=_get(cfg, "num_local_experts", 16),
        experts_per_token=_get(cfg, "num_experts_per_tok", 1), moe_intermediate_size=width,
        shared_expert_intermediate_size=width, moe_layer_flags=tuple(i in moe_layers for i in range(layers)),
        qk_l2_norm_layers=sum(no_rope) if _get(cfg, "use_qk_norm", True) else 0,
        layer_types=tuple("sliding" if t == "chunked_attention" else "full" for t in types),
        sliding_window=chunk if chunk and "chunked_attention" in types else None)


def _from_olmo1(cfg: dict, name: str) -> ModelSpec:
    """OLMo (1): Llama with OlmoLayerNorm, a LayerNorm without weight or bias computed in fp32
    (F.layer_norm(x.float(), ..., None, None)); biases on q/k/v/o where `attention_bias`;
    `clip_qkv` clamps q/k/v in place (no parameters); untied by default (OlmoConfig)."""
    return _llama_like(cfg, name, norm="layer_noparam", qkv_clip=cfg.get("clip_qkv") is not None,
                       num_kv_heads=_get(cfg, "num_key_value_heads", _require(cfg, "num_attention_heads")))


def _from_stablelm(cfg: dict, name: str) -> ModelSpec:
    """StableLM (StableLmConfig/StableLmDecoderLayer): nn.LayerNorm with bias, q/k/v biases where
    `use_qkv_bias` (o_proj none), partial rotary through `cat`, optional q/k LayerNorms per head
    (StableLmLayerNormPerHead: one weight-only LayerNorm of head_dim per head), and with
    `use_parallel_residual` one norm feeding attention and MLP (no post_attention_layernorm)."""
    parallel = bool(_get(cfg, "use_parallel_residual", False))
    bias = bool(_get(cfg, "use_qkv_bias", False))
    return _llama_like(
        cfg, name, norm="layer", norms_per_layer=1 if parallel else 2, parallel_block=parallel,
        qkv_bias=bias, o_bias=False, qk_norm=bool(_get(cfg, "qk_layernorm", False)), qk_norm_full=True,
        num_kv_heads=_get(cfg, "num_key_value_heads", _require(cfg, "num_attention_heads")), mlp_bias=False)


def _from_gptj(cfg: dict, name: str) -> ModelSpec:
    """GPT-J (GPTJConfig/GPTJBlock): one LayerNorm (with bias) feeding attention and MLP in parallel,
    q/k/v/out_proj without bias, fc_in/fc_out with bias (`n_inner`, default 4 x n_embd, activation
    `activation_function`), rotary on the first `rotary_dim` of each head, lm_head with a bias,
    untied by default. Its attention runs eager (fp32 scores) or flash_attention_2: no SDPA."""
    hidden = _require(cfg, "n_embd")
    return _plain(
        cfg, name, vocab_size=_require(cfg, "vocab_size"), hidden_size=hidden, num_layers=_require(cfg, "n_layer"),
        num_heads=_require(cfg, "n_head"), intermediate_size=_get(cfg, "n_inner", 4 * hidden),
        activation=_get(cfg, "activation_function", "gelu_new"), norms_per_layer=1, qkv_bias=False,
        o_bias=False, mlp_bias=True, lm_head_bias=True, parallel_block=True,
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        max_position_embeddings=_get(cfg, "n_positions", 2048))


def _from_glm(cfg: dict, name: str) -> ModelSpec:
    """GLM-4 (`glm`, GlmConfig) and GLM-4-0414 (`glm4`): q/k/v biases (`attention_bias`, default
    True), o_proj without, one fused `gate_up_proj` (SiLU-gated) and `down_proj`, head_dim 128 and
    2 kv heads by default, partial rotary (half the head); `glm4` adds RMSNorms after attention
    and after the MLP (post_self_attn_layernorm, post_mlp_layernorm): four per layer."""
    bias = bool(_get(cfg, "attention_bias", True))
    return _llama_like(
        cfg, name, qkv_bias=bias, o_bias=False, head_dim=_get(cfg, "head_dim", 128),
        num_kv_heads=_get(cfg, "num_key_value_heads", 2),
        norms_per_layer=4 if cfg["model_type"] == "glm4" else 2, sliding_window=None)


def _from_cohere2(cfg: dict, name: str) -> ModelSpec:
    """Cohere2 (Command-R7B, Command-A): Cohere's parallel block with one weight-only LayerNorm and
    no q/k norms; layers from `layer_types`, else three sliding then one full
    (`sliding_window_pattern` 4); rotary only on sliding layers; `logit_scale` multiplies the
    logits (no parameter); tied by default."""
    layers = _require(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if not types:
        pattern = _get(cfg, "sliding_window_pattern", 4)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    heads = _require(cfg, "num_attention_heads")
    return _llama_like(
        {**cfg, "layer_types": types, "sliding_window": _get(cfg, "sliding_window", 4096)}, name,
        norm="layer_nobias", norms_per_layer=1, parallel_block=True, head_dim=_require(cfg, "hidden_size") // heads,
        num_kv_heads=_get(cfg, "num_key_value_heads", heads),
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", True)))


def _from_qwen3_next(cfg: dict, name: str) -> ModelSpec:
    """Qwen3-Next (transformers 5.23 Qwen3NextConfig/Qwen3NextModel): `layer_types` (default every
    `full_attention_interval`-th layer full, 4) mixes gated delta-net linear attention
    (Qwen3NextGatedDeltaNet: in_proj_qkvz, in_proj_ba, a depthwise conv1d over q/k/v, dt_bias, A_log,
    a gated RMSNorm over the value head dim, out_proj) with gated full attention (q_proj twice as
    wide: queries and a sigmoid gate on the output; per-head q/k RMSNorm); MoE where
    `num_experts` > 0 on layers (i + 1) % decoder_sparse_step == 0 not in `mlp_only_layers`, with a
    shared expert and its sigmoid gate (nn.Linear(hidden, 1)); dense MLPs `intermediate_size` wide."""
    layers = _require(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if not types:
        interval = _get(cfg, "full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise InputError(f"config layer_types has {len(types)} entries for {layers} layers")
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise InputError(f"qwen3_next layer_types holds {unknown[0]!r} (expected linear_attention or full_attention)")
    experts = _get(cfg, "num_experts", 512)
    shared = _get(cfg, "shared_expert_intermediate_size", 512) if experts else 0
    key_heads, value_heads = _get(cfg, "linear_num_key_heads", 16), _get(cfg, "linear_num_value_heads", 32)
    if key_heads <= 0 or value_heads % key_heads:
        raise InputError(f"malformed config: {value_heads} linear value heads do not divide into {key_heads} key heads")
    return _llama_like(
        cfg, name, qk_norm=True, num_kv_heads=_get(cfg, "num_key_value_heads", 2), head_dim=_get(cfg, "head_dim", 256),
        intermediate_size=_get(cfg, "intermediate_size", 5632), attn_output_gate=True,
        num_experts=experts, experts_per_token=_get(cfg, "num_experts_per_tok", 10) if experts else 0,
        moe_intermediate_size=_get(cfg, "moe_intermediate_size", 512) if experts else 0,
        shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0,
        moe_layer_flags=_moe_flags(cfg, layers) if experts else (),
        layer_types=tuple("linear" if t == "linear_attention" else "full" for t in types), sliding_window=None,
        linear_key_heads=key_heads, linear_value_heads=value_heads,
        linear_key_head_dim=_get(cfg, "linear_key_head_dim", 128),
        linear_value_head_dim=_get(cfg, "linear_value_head_dim", 128),
        linear_conv_kernel=_get(cfg, "linear_conv_kernel_dim", 4))


def _vision_params(cfg: dict) -> int:
    """Parameters of the vision tower (transformers 5.23), from `vision_config` with the vision config
    class's defaults:
    - Qwen2.5-VL (Qwen2_5_VisionTransformerPretrainedModel): Conv3d patch embedding without bias
      (hidden x channels x temporal x patch x patch); per block two RMSNorms (hidden), qkv (hidden -> 3
      hidden, bias), proj (bias), a gated MLP gate/up/down with biases (`intermediate_size`); the
      merger: RMSNorm(hidden), Linear(4 hidden -> 4 hidden) and Linear(4 hidden -> out_hidden_size),
      both with bias (4 = spatial_merge_size^2).
    - Qwen3-VL (Qwen3VLVisionModel): Conv3d patch embedding with bias, a learned position table
      (num_position_embeddings x hidden); per block two LayerNorms (weight + bias), qkv and proj with
      bias, linear_fc1/linear_fc2 with bias; the merger (LayerNorm(hidden)) and one deepstack merger per
      `deepstack_visual_indexes` entry (LayerNorm(4 hidden)), each Linear(4h -> 4h) + Linear(4h -> out)."""
    mt = cfg["model_type"]
    v = cfg.get("vision_config") or {}
    qwen3 = mt == "qwen3_vl"
    h = _get(v, "hidden_size", 1152 if qwen3 else 3584)
    width = _get(v, "intermediate_size", 4304 if qwen3 else 3420)
    depth = _get(v, "depth", 27 if qwen3 else 32)
    channels = _get(v, "in_channels", 3)
    patch = _get(v, "patch_size", 16 if qwen3 else 14)
    temporal = _get(v, "temporal_patch_size", 2)
    merged = h * _get(v, "spatial_merge_size", 2) ** 2
    out = _get(v, "out_hidden_size", 3584)
    linear = lambda d_in, d_out: d_in * d_out + d_out   # noqa: E731 (with bias)
    attention = linear(h, 3 * h) + linear(h, h)
    merger = linear(merged, merged) + linear(merged, out)
    embed = h * channels * temporal * patch * patch
    blocks = [("model.visual.blocks.{}.attn.qkv", h, 3 * h, depth), ("model.visual.blocks.{}.attn.proj", h, h, depth)]
    if qwen3:
        block = 2 * 2 * h + attention + linear(h, width) + linear(width, h)
        deepstack = len(_get(v, "deepstack_visual_indexes", [8, 16, 24]))
        linears = blocks + [("model.visual.blocks.{}.mlp.linear_fc1", h, width, depth),
                            ("model.visual.blocks.{}.mlp.linear_fc2", width, h, depth),
                            ("model.visual.merger.linear_fc1", merged, merged, 1),
                            ("model.visual.merger.linear_fc2", merged, out, 1),
                            ("model.visual.deepstack_merger_list.{}.linear_fc1", merged, merged, deepstack),
                            ("model.visual.deepstack_merger_list.{}.linear_fc2", merged, out, deepstack)]
        return (embed + h + _get(v, "num_position_embeddings", 2304) * h + depth * block
                + 2 * h + merger + deepstack * (2 * merged + merger)), tuple(linears)
    block = 2 * h + attention + 2 * linear(h, width) + linear(width, h)
    linears = blocks + [("model.visual.blocks.{}.mlp.gate_proj", h, width, depth),
                        ("model.visual.blocks.{}.mlp.up_proj", h, width, depth),
                        ("model.visual.blocks.{}.mlp.down_proj", width, h, depth),
                        ("model.visual.merger.mlp.0", merged, merged, 1), ("model.visual.merger.mlp.2", merged, out, 1)]
    return embed + depth * block + h + merger, tuple(linears)


def _from_qwen_vl(cfg: dict, name: str) -> ModelSpec:
    """Qwen2.5-VL and Qwen3-VL (Qwen2_5_VL/Qwen3VLForConditionalGeneration): the language model is a
    Qwen2 (q/k/v biases) or Qwen3 (per-head q/k norms) decoder read from `text_config` (Qwen2.5-VL's
    published configs keep its keys at the top level), mRoPE (no parameters), lm_head tied by the
    top-level `tie_word_embeddings`; plus the vision tower (`_vision_params`). Image tokens are part
    of the language model's sequence (--seq counts them)."""
    import dataclasses

    mt = cfg["model_type"]
    text = cfg.get("text_config")
    text = dict(text) if isinstance(text, dict) else {k: v for k, v in cfg.items() if k != "vision_config"}
    text["model_type"] = "qwen3" if mt == "qwen3_vl" else "qwen2"
    if mt == "qwen3_vl":
        text.setdefault("num_key_value_heads", 32)
        text.setdefault("head_dim", 128)
    spec = _from_llama_family(text, name)
    tied = bool(_get(cfg, "tie_word_embeddings", False)) or bool(_get(text, "tie_word_embeddings", False))
    vision, linears = _vision_params(cfg)
    return dataclasses.replace(spec, model_type=mt, tied_embeddings=tied, vision_params=vision, vision_linears=linears)


_NEWER = {
    "llama4_text": _from_llama4_text, "qwen3_next": _from_qwen3_next,
    "qwen2_5_vl": _from_qwen_vl, "qwen3_vl": _from_qwen_vl,
    "deepseek_v2": _from_deepseek, "deepseek_v3": _from_deepseek,
    "gpt_oss": _from_gpt_oss, "olmo2": _from_olmo, "olmoe": _from_olmo,
    "granite": _from_granite, "granitemoe": _from_granite, "smollm3": _from_smollm3,
    "starcoder2": _from_starcoder2, "cohere": _from_cohere, "exaone4": _from_exaone4,
    "glm4_moe": _from_glm4_moe, "phimoe": _from_phimoe, "ernie4_5_moe": _from_ernie_moe,
    "olmo": _from_olmo1, "stablelm": _from_stablelm, "gptj": _from_gptj, "glm": _from_glm, "glm4": _from_glm,
    "cohere2": _from_cohere2,
}


_BUILDERS = {
    **dict.fromkeys(
        ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
         "mixtral", "qwen2_moe", "qwen3_moe"), _from_llama_family),
    "gpt2": _from_gpt2,
    "gpt_bigcode": _from_gpt2,
    "opt": _from_opt,
    "bloom": _from_bloom,
    "falcon": _from_falcon,
    "gpt_neox": _from_neox,
    "phi": _from_phi,
    **_NEWER,
}

SUPPORTED_MODEL_TYPES = tuple(sorted(_BUILDERS))


def spec_from_config(cfg: dict, name: str = "") -> ModelSpec:
    """Map a HF config dict to a `ModelSpec`; unknown or malformed configs raise InputError."""
    if not isinstance(cfg, dict):
        raise InputError("a model config must be a JSON object")
    mt = cfg.get("model_type")
    if not isinstance(mt, str):
        raise InputError(f"malformed config: model_type must be text, got {type(mt).__name__}")
    _check_counts_before_building(cfg)
    if mt == "gemma3" and isinstance(cfg.get("text_config"), dict):
        raise InputError(
            "gemma3 multimodal configs are not modelled (vision tower); use the text-only "
            "catalog entry, e.g. 'gemma-3-4b'")
    builder = _BUILDERS.get(mt)
    if builder is None:
        # ---- structure cards (estimator/cards.py): an unmapped model_type is traced once ----
        from estimator.cards import traced_spec
        shown = name if isinstance(name, str) and name else cfg.get("_name_or_path")
        return traced_spec(cfg, shown if isinstance(shown, str) and shown else mt, SUPPORTED_MODEL_TYPES)
    shown = name if isinstance(name, str) and name else cfg.get("_name_or_path")
    try:
        spec = builder(cfg, shown if isinstance(shown, str) and shown else mt)
    except InputError:
        raise
    except (TypeError, KeyError, ValueError, AttributeError, IndexError, ZeroDivisionError, OverflowError) as exc:
        # a field of the wrong type or an impossible value reached the mapping's arithmetic
        raise InputError(f"malformed {mt} config: {type(exc).__name__}: {exc}") from None
    _check_types(spec)
    _check_positive(spec)
    return spec


# config keys that size per-layer or per-expert structures, checked before anything is built
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _check_counts_before_building(cfg: dict) -> None:
    for sub in (cfg, cfg.get("text_config")):
        if not isinstance(sub, dict):
            continue
        for keys, limit_name in ((_LAYER_KEYS, "num_layers"), (_EXPERT_KEYS, "num_experts")):
            for key in keys:
                value = sub.get(key)
                if value is not None:
                    check_count(limit_name, value, f"malformed config: {key}", low=0)
        if isinstance(sub.get("layer_types"), list) and len(sub["layer_types"]) > limit("num_layers"):
            raise InputError(f"malformed config: layer_types has {len(sub['layer_types'])} entries")


def _check_types(spec: ModelSpec) -> None:
    """Every field of the built spec has its declared type (a config may hold anything)."""
    for f in fields(spec):
        value = getattr(spec, f.name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "str":
            ok = isinstance(value, str)
        elif kind == "int | None":
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
        elif kind.startswith("tuple[bool"):
            ok = isinstance(value, tuple) and all(isinstance(v, bool) for v in value)
        elif kind.startswith("tuple[str"):
            ok = isinstance(value, tuple) and all(isinstance(v, str) for v in value)
        else:
            ok = True
        if not ok:
            raise InputError(f"malformed config: {f.name} must be {kind}, got {value!r}"[:200])
        if kind in ("int", "int | None") and value is not None and value < 0:
            raise InputError(f"malformed config: {f.name} must not be negative, got {value}")
    for field_name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "intermediate_size",
                       "num_experts"):
        check_count(field_name, getattr(spec, field_name), f"malformed config: {field_name}",
                    low=0 if field_name == "num_experts" else 1)
    check_count("num_heads", spec.num_kv_heads, "malformed config: num_kv_heads")
    for field_name in ("moe_intermediate_size", "shared_expert_intermediate_size", "embed_dim"):
        check_count("intermediate_size", getattr(spec, field_name), f"malformed config: {field_name}", low=0)
    if spec.experts_per_token > max(spec.num_experts, 0):
        raise InputError(f"malformed config: {spec.experts_per_token} experts per token of {spec.num_experts}")
    if len(spec.layer_types) not in (0, spec.num_layers) or len(spec.moe_layer_flags) not in (0, spec.num_layers):
        raise InputError("malformed config: per-layer lists do not have one entry per layer")


def _check_positive(spec: ModelSpec) -> None:
    for field_name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                       "head_dim", "intermediate_size"):
        value = getattr(spec, field_name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InputError(f"malformed config: {field_name} must be a positive integer, got {value!r}")
    if spec.num_heads % spec.num_kv_heads:
        raise InputError(
            f"malformed config: {spec.num_heads} attention heads do not divide into {spec.num_kv_heads} kv heads")
