"""The 30 most common text-generation `model_type`s of 2026: each answered by the estimator (full
fine-tune, LoRA, inference), none refused, every number positive and finite.

Source of the list. No public ranking of Hub downloads per `model_type` could be found through the
search tools of this project; the list is built from (1) transformers 5.23's own registry of causal
language models (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, checked below: every type is a text-generation
model transformers builds), (2) the families of the most-downloaded text-generation models on the
Hub (huggingface.co/models?pipeline_tag=text-generation&sort=downloads, as summarised publicly in
2025-2026: Qwen3/Qwen2.5, Llama 3.x, Gemma 2/3, Mistral/Mixtral, Phi-3/4, gpt-oss, DeepSeek-V3,
GPT-2, SmolLM3 at the top; e.g. the Hub statistics post of L. Bourdois, Oct. 2025, and the live
sort=downloads table quoted by eyesinai.com) and (3) the project's issue 14 list (OLMo, OLMo-2,
StarCoder2, Cohere, Granite, GLM-4, Llama-4, GPT-J, StableLM, Falcon, BLOOM, OPT, GPT-NeoX,
GPT-BigCode). qwen3_next is mapped on another branch and left out here.

Each tiny config is checked against transformers itself (a meta-device build has exactly the
parameters the estimator counts), so a config that does not describe the family fails here.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from estimator.api import estimate
from estimator.model import spec_from_config
from estimator.params import count_params
from estimator.workload import NO_SDPA, Workload
from tests.arch_configs import TINY

transformers.logging.set_verbosity_error()

_A = dict(vocab_size=211, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
_MOE = dict(num_experts_per_tok=2)

COMMON = {
    "llama": dict(model_type="llama", intermediate_size=96, num_hidden_layers=2, **_A),
    "mistral": dict(model_type="mistral", intermediate_size=96, num_hidden_layers=2, sliding_window=8, **_A),
    "mixtral": dict(model_type="mixtral", intermediate_size=32, num_hidden_layers=2, num_local_experts=4, **_MOE, **_A),
    "qwen2": dict(model_type="qwen2", intermediate_size=96, num_hidden_layers=2, **_A),
    "qwen2_moe": dict(model_type="qwen2_moe", intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, num_hidden_layers=2, num_experts=4, **_MOE, **_A),
    "qwen3": dict(model_type="qwen3", intermediate_size=96, num_hidden_layers=2, head_dim=16, **_A),
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                      num_experts=4, head_dim=16, **_MOE, **_A),
    "gemma": dict(model_type="gemma", intermediate_size=96, num_hidden_layers=2, head_dim=16, **_A),
    "gemma2": dict(model_type="gemma2", intermediate_size=96, num_hidden_layers=2, head_dim=16, sliding_window=8, **_A),
    "gemma3_text": dict(model_type="gemma3_text", intermediate_size=96, num_hidden_layers=2, head_dim=16,
                        sliding_window=8, **_A),
    "phi": dict(model_type="phi", vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=128),
    "phi3": dict(model_type="phi3", intermediate_size=96, num_hidden_layers=2, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2, **_A),
    "gpt2": dict(model_type="gpt2", vocab_size=211, n_embd=64, n_layer=2, n_head=4, n_positions=128),
    "gpt_neox": dict(model_type="gpt_neox", vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=128),
    "gpt_bigcode": dict(model_type="gpt_bigcode", vocab_size=211, n_embd=64, n_layer=2, n_head=4, n_positions=128),
    "starcoder2": TINY["starcoder2"],
    "falcon": dict(model_type="falcon", vocab_size=211, hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
    "bloom": dict(model_type="bloom", vocab_size=211, hidden_size=64, n_layer=2, n_head=4),
    "opt": dict(model_type="opt", vocab_size=211, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64),
    "cohere": TINY["cohere"],
    "olmo": TINY["olmo"],
    "olmo2": TINY["olmo2"],
    "deepseek_v3": TINY["deepseek_v3"],
    "gpt_oss": TINY["gpt_oss"],
    "granite": TINY["granite"],
    "smollm3": TINY["smollm3"],
    "stablelm": TINY["stablelm"],
    "gptj": TINY["gptj"],
    "glm4": TINY["glm4"],
    "llama4_text": TINY["llama4_text"],
}
# LoRA targets where peft's default for the family (q_proj, v_proj) does not exist: DeepSeek-V3's
# latent attention names its own projections
_LORA = {"deepseek_v3": ("q_b_proj", "kv_b_proj")}
METHODS = ("full", "lora", "inference")


def test_thirty_types_as_the_brief_lists_them():
    assert len(COMMON) == 30
    assert "qwen3_next" not in COMMON


@pytest.mark.parametrize("model_type", sorted(COMMON))
def test_a_text_generation_type_transformers_builds(model_type):
    cfg = COMMON[model_type]
    assert cfg["model_type"] == model_type
    assert model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**copy.deepcopy(cfg)))
    model.tie_weights()
    assert count_params(spec_from_config(cfg, model_type)).total == sum(p.numel() for p in model.parameters())


def _finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.parametrize("model_type,method", [(t, m) for t in sorted(COMMON) for m in METHODS])
def test_estimate_answers(model_type, method):
    spec = spec_from_config(COMMON[model_type], model_type)
    settings = dict(method=method, batch=2, seq=64, precision="bf16",
                    attn="eager" if model_type in NO_SDPA else "sdpa")   # GPT-J: no SDPA in transformers
    if method == "lora":
        settings["lora_targets"] = _LORA.get(model_type, ("q_proj", "v_proj"))
    if method == "inference":
        settings["new_tokens"] = 8
    est = estimate(Workload(spec, **settings), "h100-80gb", calibration="none")
    m = est.memory
    for name in ("weights_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes"):
        assert _finite_positive(getattr(m, name)), (name, getattr(m, name))
    if method == "inference":
        assert _finite_positive(m.kv_cache_bytes)
        assert _finite_positive(est.time.prefill_s) and _finite_positive(est.time.decode_s_per_token)
    else:
        assert _finite_positive(m.activations_bytes) and _finite_positive(m.optimizer_states_bytes)
    assert _finite_positive(est.time.step_s) and _finite_positive(est.time.tokens_per_s)
    assert m.peak_allocated_bytes >= m.weights_bytes
    for value in vars(m).values():
        if isinstance(value, float):
            assert math.isfinite(value)
