"""Tiny configs of the newer families (transformers 5.23 model_types), shared by the architecture
tests: each keeps its family's structure (MLA ranks, dense-then-MoE layers, shared experts,
sliding/full alternation, biases, post-norms) at a size a CPU builds and runs in a moment."""

_ATTN = dict(vocab_size=211, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128)

TINY = {
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=211, hidden_size=64, intermediate_size=96,
                        moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1,
                        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=40,
                        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, max_position_embeddings=128),
    "deepseek_v2-lite": dict(model_type="deepseek_v2", vocab_size=211, hidden_size=64, intermediate_size=96,
                             moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                             n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=2,
                             first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
                             v_head_dim=16, qk_nope_head_dim=16, max_position_embeddings=128),
    "deepseek_v2-bias": dict(model_type="deepseek_v2", vocab_size=211, hidden_size=64, intermediate_size=96,
                             moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                             n_shared_experts=2, n_routed_experts=4, num_experts_per_tok=2, attention_bias=True,
                             kv_lora_rank=24, q_lora_rank=40, qk_rope_head_dim=8, v_head_dim=16,
                             qk_nope_head_dim=16, max_position_embeddings=128),
    "gpt_oss": dict(model_type="gpt_oss", vocab_size=211, hidden_size=64, intermediate_size=48, head_dim=16,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=4, max_position_embeddings=128),
    "olmo2": dict(model_type="olmo2", intermediate_size=96, num_hidden_layers=2, **_ATTN),
    "olmoe": dict(model_type="olmoe", intermediate_size=32, num_hidden_layers=2, num_experts=8,
                  num_experts_per_tok=2, **_ATTN),
    "granite": dict(model_type="granite", intermediate_size=96, num_hidden_layers=2, **_ATTN),
    "granitemoe": dict(model_type="granitemoe", intermediate_size=32, num_hidden_layers=2, num_local_experts=8,
                       num_experts_per_tok=2, **_ATTN),
    "smollm3": dict(model_type="smollm3", intermediate_size=96, num_hidden_layers=4, pad_token_id=0,
                    bos_token_id=1, eos_token_id=2, **_ATTN),
    "starcoder2": dict(model_type="starcoder2", intermediate_size=96, num_hidden_layers=2, sliding_window=4,
                       bos_token_id=1, eos_token_id=2, **_ATTN),
    "cohere": dict(model_type="cohere", intermediate_size=96, num_hidden_layers=2, use_qk_norm=True,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2, **_ATTN),
    "exaone4": dict(model_type="exaone4", intermediate_size=96, num_hidden_layers=4, sliding_window=4,
                    sliding_window_pattern=4, **_ATTN),
    "glm4_moe": dict(model_type="glm4_moe", intermediate_size=96, moe_intermediate_size=32, head_dim=16,
                     num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                     first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                     **_ATTN),
    "phimoe": dict(model_type="phimoe", intermediate_size=32, num_hidden_layers=2, num_local_experts=8,
                   num_experts_per_tok=2, attention_bias=True, lm_head_bias=True, **_ATTN),
    "ernie4_5_moe": dict(model_type="ernie4_5_moe", intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=4, moe_num_experts=8, moe_k=2, moe_num_shared_experts=2,
                         moe_layer_start_index=1, moe_layer_interval=2, pad_token_id=0, **_ATTN),
    "ernie4_5_moe-bias": dict(model_type="ernie4_5_moe", intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=3, moe_num_experts=8, moe_k=2, moe_num_shared_experts=0,
                              use_bias=True, tie_word_embeddings=False, pad_token_id=0, **_ATTN),
}

TINY.update({
    # Llama-4: MoE every second layer with a shared expert, dense layers wider, NoPE every 4th layer
    # (full attention), the others chunked (cache: a window of attention_chunk_size)
    "llama4_text": dict(model_type="llama4_text", vocab_size=211, hidden_size=64, intermediate_size=32,
                        intermediate_size_mlp=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                        attention_chunk_size=8, max_position_embeddings=128),
})

TINY.update({
    # Qwen3-Next: linear (gated delta-net) layers, every 4th full with a gated q_proj; MoE with a shared
    # expert (and its sigmoid gate) on all but mlp_only_layers; value heads twice the key heads
    "qwen3_next": dict(model_type="qwen3_next", vocab_size=211, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
                       linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1],
                       max_position_embeddings=128),
})

# Vision-language models (built with AutoModelForImageTextToText, not AutoModelForCausalLM: kept apart
# from TINY; tests/test_vision_language.py)
VL = {
    # vision-language: a Qwen2 decoder (config keys at the top level, as Qwen2.5-VL publishes them) and a
    # Qwen3 decoder under text_config, each with a tiny vision tower (Qwen3-VL: two deepstack mergers)
    "qwen2_5_vl": dict(model_type="qwen2_5_vl", vocab_size=211, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       rope_scaling={"type": "default", "mrope_section": [2, 3, 3]},
                       vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                                          fullatt_block_indexes=[1])),
    "qwen3_vl": dict(model_type="qwen3_vl",
                     text_config=dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
                     vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                                        num_position_embeddings=16, deepstack_visual_indexes=[0, 2])),
}

TINY.update({
    # OLMo-1: LayerNorms without parameters, q/k/v/o biases when attention_bias
    "olmo": dict(model_type="olmo", intermediate_size=96, num_hidden_layers=2, pad_token_id=0, eos_token_id=1,
                 **_ATTN),
    "olmo-bias": dict(model_type="olmo", intermediate_size=96, num_hidden_layers=2, attention_bias=True,
                      pad_token_id=0, eos_token_id=1, **_ATTN),
    # StableLM-2: LayerNorm with bias, q/k/v biases, partial rotary; the -qk variant: per-head q/k
    # LayerNorms and the parallel residual (StableLM-2-12B)
    "stablelm": dict(model_type="stablelm", intermediate_size=96, num_hidden_layers=2, use_qkv_bias=True,
                     bos_token_id=0, eos_token_id=0, **_ATTN),
    "stablelm-qk-parallel": dict(model_type="stablelm", intermediate_size=96, num_hidden_layers=2,
                                 use_qkv_bias=False, qk_layernorm=True, use_parallel_residual=True,
                                 bos_token_id=0, eos_token_id=0, **_ATTN),
    # GPT-J: parallel block, rotary on rotary_dim of each head, biased fc_in/fc_out and lm_head
    "gptj": dict(model_type="gptj", vocab_size=211, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=128,
                 bos_token_id=0, eos_token_id=0),
    # GLM-4 / GLM-4-0414: fused gate_up_proj, q/k/v biases, head_dim set apart from hidden / heads
    "glm": dict(model_type="glm", intermediate_size=96, num_hidden_layers=2, head_dim=16, pad_token_id=0,
                eos_token_id=1, **_ATTN),
    "glm4": dict(model_type="glm4", intermediate_size=96, num_hidden_layers=2, head_dim=16, pad_token_id=0,
                 eos_token_id=1, **_ATTN),
    # Cohere2: 3 sliding + 1 full layer, parallel block, logit_scale
    "cohere2": dict(model_type="cohere2", intermediate_size=96, num_hidden_layers=4, sliding_window=4,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2, **_ATTN),
})

# The trace-sized configs live in the package (profiler/trace/families.py, used by
# scripts/bench_tracer.py --families too); re-exported here for the tests that import them.
from profiler.trace.families import FAMILIES  # noqa: E402

TRACED = {k: v for k, v in FAMILIES.items() if k != "qwen3_next"}
TRACED_LINEAR_ATTENTION = {"qwen3_next": FAMILIES["qwen3_next"]}
