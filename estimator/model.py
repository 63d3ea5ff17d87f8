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
    norm: str                  # "rms" (weight) or "layer" (weight + bias)
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
        fields = astuple(self)[1:]
        return hashlib.sha1(repr(fields).encode()).hexdigest()[:8]

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

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
        """(layers attending to every token, layers attending to a sliding window)."""
        sliding = sum(1 for t in self.layer_types if t == "sliding") if self.sliding_window else 0
        return self.num_layers - sliding, sliding

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
        layer_types=tuple("sliding" if t == "chunked_attention" else "full" for t in types),
        sliding_window=chunk if chunk and "chunked_attention" in types else None)


_NEWER = {
    "llama4_text": _from_llama4_text,
    "deepseek_v2": _from_deepseek, "deepseek_v3": _from_deepseek,
    "gpt_oss": _from_gpt_oss, "olmo2": _from_olmo, "olmoe": _from_olmo,
    "granite": _from_granite, "granitemoe": _from_granite, "smollm3": _from_smollm3,
    "starcoder2": _from_starcoder2, "cohere": _from_cohere, "exaone4": _from_exaone4,
    "glm4_moe": _from_glm4_moe, "phimoe": _from_phimoe, "ernie4_5_moe": _from_ernie_moe,
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
