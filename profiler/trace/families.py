"""Trace-sized configs of the newer families (transformers 5.23 model_types): the estimator's
activations and working sets against the fake-tensor tracer for a full fine-tune, LoRA, QLoRA and
inference (`scripts/bench_tracer.py --families`, tests/test_architectures_vs_trace.py).

Each keeps its family's structure (MLA ranks, dense-then-MoE layers, shared experts, sliding/full
alternation, biases, post-norms, attention sinks, NoPE and chunked layers, a vision tower) and is
wide enough that per-token tensors dominate, with a vocabulary large enough that the loss is not
swamped by the final norm.

`FAMILIES`: name -> raw HF config dict; `lora_targets(model_type)` and `attn(model_type)`: the
LoRA target names and attention kernel each family is traced with; `SETTINGS`: batch, sequence and
new tokens of every traced case.
"""

from __future__ import annotations

import copy

SETTINGS = dict(batch=2, seq=256)
NEW_TOKENS = 4
METHODS = ("full", "lora", "qlora", "inference")
# QLoRA without kbit preparation: traced where QLoRA with it is refused (fused experts that
# transformers' grouped_mm takes in bf16 only), as TRL runs QLoRA under FSDP and ms-swift everywhere
QLORA_NO_PREP = "qlora-no-prep"

# the families' own module names: MLA's q_b_proj/kv_b_proj, GPT-J's out_proj and fc_in, GLM's fused
# gate_up_proj, Qwen3-Next's linear-attention in_proj_qkvz/out_proj
LORA = {"deepseek_v3": ("q_b_proj", "kv_b_proj", "o_proj"), "deepseek_v2": ("q_proj", "kv_b_proj", "o_proj"),
        "gptj": ("q_proj", "v_proj", "out_proj", "fc_in"), "glm": ("q_proj", "v_proj", "o_proj", "gate_up_proj"),
        "glm4": ("q_proj", "v_proj", "o_proj", "gate_up_proj"),
        "qwen3_next": ("q_proj", "v_proj", "in_proj_qkvz", "out_proj"),
        "starcoder2": ("q_proj", "v_proj", "o_proj", "c_proj")}   # StarCoder2's MLP: c_fc, c_proj
DEFAULT_LORA = ("q_proj", "v_proj", "o_proj", "down_proj")
# GPT-J and GPT-OSS have no SDPA path in transformers 5.23 (GPT-OSS: eager with its sinks, or flex/kernels)
ATTN = {"gptj": "eager", "gpt_oss": "eager"}


def lora_targets(model_type: str) -> tuple:
    return LORA.get(model_type, DEFAULT_LORA)


def attn(model_type: str) -> str:
    return ATTN.get(model_type, "sdpa")


def config(name: str) -> dict:
    """A fresh copy of the config of `name` (transformers mutates what it is given)."""
    return copy.deepcopy(FAMILIES[name])


def layer_count(cfg: dict) -> int:
    text = cfg.get("text_config", cfg)
    return next(text[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if k in text)


_MLA = dict(vocab_size=2048, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
            num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            kv_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
            max_position_embeddings=512)
_T = dict(vocab_size=2048, hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
          max_position_embeddings=512)

FAMILIES = {
    # sigmoid router with grouped top-k (fp32), shared expert, q compressed through q_a/q_b
    "deepseek_v3-moe": dict(model_type="deepseek_v3", n_shared_experts=1, n_group=2, topk_group=1,
                            first_k_dense_replace=0, q_lora_rank=96, **_MLA),
    # the same attention over dense layers only
    "deepseek_v3-dense": dict(model_type="deepseek_v3", n_shared_experts=1, n_group=2, topk_group=1,
                              first_k_dense_replace=3, q_lora_rank=96, **_MLA),
    # softmax router, one q_proj (DeepSeek-V2-Lite)
    "deepseek_v2-lite": dict(model_type="deepseek_v2", n_shared_experts=2, first_k_dense_replace=0,
                             q_lora_rank=None, **_MLA),
    "olmo": dict(model_type="olmo", num_hidden_layers=2, pad_token_id=0, eos_token_id=1, **_T),
    # OLMo-1.7's clip_qkv: q, k, v clamped in place (autograd keeps copies)
    "olmo-clip": dict(model_type="olmo", num_hidden_layers=2, clip_qkv=8.0, pad_token_id=0, eos_token_id=1, **_T),
    "stablelm": dict(model_type="stablelm", num_hidden_layers=2, use_qkv_bias=True, bos_token_id=0, eos_token_id=0,
                     **_T),
    "stablelm-qk-parallel": dict(model_type="stablelm", num_hidden_layers=2, qk_layernorm=True,
                                 use_parallel_residual=True, bos_token_id=0, eos_token_id=0, **_T),
    "gptj": dict(model_type="gptj", vocab_size=2048, n_embd=256, n_layer=2, n_head=4, rotary_dim=16, n_positions=512,
                 bos_token_id=0, eos_token_id=0),
    "glm": dict(model_type="glm", num_hidden_layers=2, head_dim=64, pad_token_id=0, eos_token_id=1, **_T),
    "glm4": dict(model_type="glm4", num_hidden_layers=2, head_dim=64, pad_token_id=0, eos_token_id=1, **_T),
    # window 64 < the traced 256 tokens: the sliding layers get SDPA's 4-D mask and repeated k/v
    "cohere2": dict(model_type="cohere2", num_hidden_layers=4, sliding_window=64, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2, **_T),
    "mistral-window": dict(model_type="mistral", num_hidden_layers=2, sliding_window=64, **_T),
    # Qwen3-Next: 3 gated delta-net layers (torch fallback kernels on CPU) and one gated full-attention
    # layer, MoE with a shared expert
    "qwen3_next": dict(model_type="qwen3_next", vocab_size=2048, hidden_size=256, intermediate_size=384,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
                       linear_num_key_heads=4, linear_num_value_heads=8, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=128, shared_expert_intermediate_size=128, max_position_embeddings=512),
    # GPT-OSS: sliding/full alternation (window 64 < 256 tokens), attention sinks, biased router and
    # experts, clamped SwiGLU
    "gpt_oss": dict(model_type="gpt_oss", vocab_size=2048, hidden_size=256, intermediate_size=128, head_dim=64,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=64, max_position_embeddings=512),
    # Llama-4: MoE every second layer with a shared expert, dense layers wider, NoPE every 4th layer
    # (full attention), the others chunked (chunk 64 < 256 tokens)
    "llama4_text": dict(model_type="llama4_text", vocab_size=2048, hidden_size=256, intermediate_size=128,
                        intermediate_size_mlp=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                        attention_chunk_size=64, max_position_embeddings=512),
    # GLM-4.5: dense then MoE with a shared expert, sigmoid grouped router, q/k norms, partial rotary
    "glm4_moe": dict(model_type="glm4_moe", moe_intermediate_size=128, head_dim=64, num_hidden_layers=3,
                     n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                     attention_bias=True, use_qk_norm=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                     **_T),
    # OLMo-2: post-norms, q/k RMSNorm over all heads
    "olmo2": dict(model_type="olmo2", num_hidden_layers=2, **_T),
    # OLMoE: every layer MoE (softmax router), q/k norms
    "olmoe": dict(model_type="olmoe", num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                  **{**_T, "intermediate_size": 128}),
    # Granite: embedding/residual/attention/logits multipliers
    "granite": dict(model_type="granite", num_hidden_layers=2, embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=0.015625, logits_scaling=8.0, **_T),
    "granitemoe": dict(model_type="granitemoe", num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                       embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0,
                       **{**_T, "intermediate_size": 128}),
    # SmolLM3: NoPE every 4th layer
    "smollm3": dict(model_type="smollm3", num_hidden_layers=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, **_T),
    # Phi-MoE: LayerNorms, biased attention and lm_head, sparsemixer router
    "phimoe": dict(model_type="phimoe", num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                   attention_bias=True, lm_head_bias=True, **{**_T, "intermediate_size": 128}),
    # ERNIE-4.5-MoE: dense layer 0, MoE every second layer after, shared experts
    "ernie4_5_moe": dict(model_type="ernie4_5_moe", moe_intermediate_size=128, num_hidden_layers=4, moe_num_experts=8,
                         moe_k=2, moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_interval=2,
                         pad_token_id=0, **_T),
    # EXAONE-4: 3 sliding + 1 full layer (window 64 < 256 tokens), post-norms, q/k norms
    "exaone4": dict(model_type="exaone4", num_hidden_layers=4, sliding_window=64, sliding_window_pattern=4, **_T),
    # StarCoder2: LayerNorm with bias, biased linears, GELU MLP c_fc/c_proj, sliding window
    "starcoder2": dict(model_type="starcoder2", num_hidden_layers=2, sliding_window=64, bos_token_id=1,
                       eos_token_id=2, **_T),
    # Cohere: parallel block, LayerNorm without bias, per-head q/k norms, logit_scale
    "cohere": dict(model_type="cohere", num_hidden_layers=2, use_qk_norm=True, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2, **_T),
    # vision-language, text-only batches (the estimator models no image tokens): the tower's weights
    # stay resident (and train under a full fine-tune)
    "qwen2_5_vl": dict(model_type="qwen2_5_vl", num_hidden_layers=2,
                       rope_scaling={"type": "default", "mrope_section": [8, 12, 12]},
                       vision_config=dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=2,
                                          out_hidden_size=256, fullatt_block_indexes=[2]), **_T),
    "qwen3_vl": dict(model_type="qwen3_vl",
                     text_config=dict(num_hidden_layers=2, head_dim=64,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "mrope_section": [8, 12, 12], "mrope_interleaved": True},
                                      **_T),
                     vision_config=dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=2,
                                        out_hidden_size=256, num_position_embeddings=16,
                                        deepstack_visual_indexes=[0, 2])),
}


def workload(name: str, method: str):
    """The validated Workload of family `name` traced with `method` (raises InputError where the
    estimator refuses the combination on purpose)."""
    from estimator.model import spec_from_config
    from estimator.workload import Workload

    cfg = FAMILIES[name]
    mt = cfg["model_type"]
    settings = dict(method=method, attn=attn(mt), lora_targets=lora_targets(mt), **SETTINGS)
    if method in ("qlora", QLORA_NO_PREP):
        settings["quant"] = "nf4"
    if method == QLORA_NO_PREP:
        settings.update(method="qlora", kbit_prep="off")
    if method == "inference":
        settings["new_tokens"] = NEW_TOKENS
    return Workload(spec_from_config(config(name), name), **settings).validate()


def compare_family(name: str, method: str):
    """Trace family `name` whole with `method` and set the raw estimate beside it: a
    profiler.trace.grid.GridRow, or the refusal's text (estimator.errors.InputError) as a str."""
    from estimator.errors import InputError
    from profiler.trace.grid import grid_row
    from profiler.trace.step import trace

    try:
        w = workload(name, method)
    except InputError as exc:
        return str(exc)
    return grid_row(f"{name} {method}", w, trace(w, config(name), layers=layer_count(FAMILIES[name])))
