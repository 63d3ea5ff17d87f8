"""KV cache bytes: `estimator.memory.kv_cache_bytes` against the formula computed straight from the
raw config.json values, and against real transformers 5.23 DynamicCache tensors on CPU.

Formula (docs/design.md section 3): 2 (K and V) x layers x batch x cached tokens x kv_heads
x head_dim x bytes, where a sliding-window layer caches at most `sliding_window` tokens.

Which tokens a sliding layer *holds* in transformers 5.23 (cache_utils.DynamicSlidingWindowLayer.
update): it concatenates the new keys to the kept ones and keeps a *view* of the last
`sliding_window - 1` tokens. The view shares the storage of the concatenation, so the memory held is
- during decode: (W - 1) + 1 = W tokens per sliding layer (what the estimator counts), and
- right after a prefill of T > W prompt tokens: the whole T-token storage (nothing is freed until
  the first decode step replaces it). The tests below measure both on a real model.
"""

import csv
import json

import pytest
import torch
import transformers
from transformers import AutoConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from estimator.configs import CATALOG_DIR, catalog_ids, load_spec
from estimator.memory import estimate_memory, kv_cache_bytes
from estimator.model import spec_from_config
from estimator.workload import NO_SDPA, Workload

transformers.logging.set_verbosity_error()


def _raw(hub_id: str) -> dict:
    with (CATALOG_DIR / "index.csv").open(newline="") as f:
        row = next(r for r in csv.DictReader(f) if r["hub_id"] == hub_id)
    with (CATALOG_DIR / row["file"]).open() as f:
        return json.load(f)


def _formula(layers_tokens: list[int], batch: int, kv_heads: int, head_dim: int, nbytes: int) -> int:
    """2 x sum over layers of cached tokens x batch x kv_heads x head_dim x bytes."""
    return 2 * sum(layers_tokens) * batch * kv_heads * head_dim * nbytes


BATCH = 2


# --- full attention: GQA, MHA, MQA ---------------------------------------------------------------

def test_llama31_8b_gqa():
    cfg = _raw("meta-llama/Llama-3.1-8B")
    layers, kv = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert (layers, kv, head_dim) == (32, 8, 128)
    # Widely quoted: Llama-3-8B needs 128 KiB of bf16 KV cache per token.
    assert _formula([1] * layers, 1, kv, head_dim, 2) == 128 * 1024
    spec = load_spec("meta-llama/Llama-3.1-8B")
    for tokens in (1, 4096, 131072):
        assert kv_cache_bytes(spec, BATCH, tokens, 2) == _formula([tokens] * layers, BATCH, kv, head_dim, 2)


def test_qwen25_7b_gqa_window_not_used():
    # config.json has sliding_window 131072 but use_sliding_window false: every layer is full.
    cfg = _raw("Qwen/Qwen2.5-7B-Instruct")
    assert cfg["use_sliding_window"] is False
    layers, kv = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert (layers, kv, head_dim) == (28, 4, 128)
    spec = load_spec("Qwen/Qwen2.5-7B-Instruct")
    for tokens in (1000, 32768):
        assert kv_cache_bytes(spec, BATCH, tokens, 2) == _formula([tokens] * layers, BATCH, kv, head_dim, 2)


def test_llama2_7b_mha():
    cfg = _raw("meta-llama/Llama-2-7b-hf")
    layers = cfg["num_hidden_layers"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert (layers, kv, head_dim) == (32, 32, 128)
    # Widely quoted: Llama-2-7B needs 0.5 MiB of fp16 KV cache per token.
    assert _formula([1] * layers, 1, kv, head_dim, 2) == 512 * 1024
    spec = load_spec("meta-llama/Llama-2-7b-hf")
    assert kv_cache_bytes(spec, BATCH, 4096, 2) == _formula([4096] * layers, BATCH, kv, head_dim, 2)
    assert kv_cache_bytes(spec, BATCH, 4096, 4) == _formula([4096] * layers, BATCH, kv, head_dim, 4)


def test_falcon_7b_mqa():
    cfg = _raw("tiiuae/falcon-7b")
    assert cfg["multi_query"] is True and not cfg.get("new_decoder_architecture")
    layers, kv = cfg["num_hidden_layers"], 1  # multi-query: one K/V head shared by all 71 heads
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert (layers, head_dim) == (32, 64)
    spec = load_spec("tiiuae/falcon-7b")
    assert kv_cache_bytes(spec, BATCH, 2048, 2) == _formula([2048] * layers, BATCH, kv, head_dim, 2)


# --- sliding windows ---------------------------------------------------------------------------------

def test_mistral_7b_v01_window_on_every_layer():
    cfg = _raw("mistralai/Mistral-7B-v0.1")
    layers, kv, window = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["sliding_window"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert (layers, kv, head_dim, window) == (32, 8, 128, 4096)
    spec = load_spec("mistralai/Mistral-7B-v0.1")
    for tokens in (1000, 4096, 8192, 32768):
        expected = _formula([min(tokens, window)] * layers, BATCH, kv, head_dim, 2)
        assert kv_cache_bytes(spec, BATCH, tokens, 2) == expected
    # The cap is real: 8192 tokens cost the same as 4096.
    assert kv_cache_bytes(spec, BATCH, 8192, 2) == kv_cache_bytes(spec, BATCH, 4096, 2)


def test_gemma2_9b_alternating_windows():
    cfg = _raw("google/gemma-2-9b")
    layers, kv, head_dim, window = (cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                                    cfg["head_dim"], cfg["sliding_window"])
    assert (layers, kv, head_dim, window) == (42, 8, 256, 4096)
    spec = load_spec("google/gemma-2-9b")
    for tokens in (2000, 8192):
        # Gemma-2: even layers (0, 2, ...) local with a 4096 window, odd layers global.
        per_layer = [min(tokens, window) if i % 2 == 0 else tokens for i in range(layers)]
        assert kv_cache_bytes(spec, BATCH, tokens, 2) == _formula(per_layer, BATCH, kv, head_dim, 2)


def test_gemma3_4b_five_local_one_global():
    cfg = _raw("google/gemma-3-4b-pt")
    layers, kv, head_dim, window = (cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                                    cfg["head_dim"], cfg["sliding_window"])
    assert (layers, kv, head_dim, window) == (34, 4, 256, 1024)
    kinds = cfg["layer_types"]
    assert kinds.count("full_attention") == 5 and kinds[5] == "full_attention"
    spec = load_spec("google/gemma-3-4b-pt")
    for tokens in (512, 8192):
        per_layer = [min(tokens, window) if k == "sliding_attention" else tokens for k in kinds]
        assert kv_cache_bytes(spec, BATCH, tokens, 2) == _formula(per_layer, BATCH, kv, head_dim, 2)


@pytest.mark.parametrize("hub_id", catalog_ids())
def test_layer_kinds_and_window_match_transformers_cache(hub_id):
    # DynamicCache(config=...) picks its layer classes from get_layer_types_and_kwargs(config):
    # a "sliding_attention" layer becomes a DynamicSlidingWindowLayer with that window.
    cfg = AutoConfig.for_model(**_raw(hub_id))
    # a vision-language model's cache is its language model's (generate passes the text config)
    types, kwargs = get_layer_types_and_kwargs(cfg.get_text_config())
    spec = load_spec(hub_id)
    # a chunked layer (Llama-4) is cached as a sliding window of the chunk size (cache_utils)
    # a linear-attention layer (Qwen3-Next) keeps conv and recurrent states (LinearAttentionLayer)
    assert spec.layer_types == tuple("sliding" if t in ("sliding_attention", "chunked_attention")
                                     else "linear" if t == "linear_attention" else "full" for t in types)
    assert set(types) <= {"sliding_attention", "full_attention", "chunked_attention", "linear_attention"}
    windows = {k["sliding_window"] for k in kwargs if "sliding_window" in k}
    assert windows == ({spec.sliding_window} if spec.sliding_window else set())


# --- tensor parallel -------------------------------------------------------------------------

def test_tensor_parallel_splits_kv_heads():
    spec = load_spec("meta-llama/Llama-3.1-8B")  # 8 kv heads over 8 ranks: one head each
    assert kv_cache_bytes(spec, BATCH, 4096, 2, tp=8) * 8 == kv_cache_bytes(spec, BATCH, 4096, 2)


def test_tensor_parallel_replicates_kv_heads_when_fewer_than_ranks():
    # When tp exceeds the kv heads, each rank still holds at least one whole kv head: the heads are
    # replicated, not split (vLLM QKVParallelLinear: `if tp_size >= total_num_kv_heads:
    # num_kv_heads = 1; num_kv_head_replicas = tp_size // total_num_kv_heads`; SGLang the same).
    # gemma-2b is MQA (1 kv head, 8 heads): tp=4 is a valid workload, and every rank caches the
    # full single head.
    cfg = _raw("google/gemma-2b")
    layers, kv, head_dim = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
    assert kv == 1
    spec = load_spec("google/gemma-2b")
    Workload(model=spec, method="inference", gpus=4, tp=4).validate()  # the estimator accepts it
    per_rank_heads = max(1, kv // 4)
    assert kv_cache_bytes(spec, BATCH, 4096, 2, tp=4) == _formula([4096] * layers, BATCH, per_rank_heads, head_dim, 2)


# --- real transformers DynamicCache on CPU ------------------------------------------------------------

PROMPT = 7


def _storage_bytes(cache) -> int:
    """Bytes of storage the cache keeps alive (a sliced view keeps its whole base storage)."""
    return sum(layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
               for layer in cache.layers)


def _view_bytes(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)


def _bytes(cache) -> tuple:
    """(storage bytes, view bytes) of a key/value cache."""
    return _storage_bytes(cache), _view_bytes(cache)


def _run(cfg, dtype, measure=_bytes):
    """Prefill PROMPT tokens at batch 2, then one decode step; `measure(cache)` after each."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (BATCH, PROMPT))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        prefill = (*measure(cache), type(cache).__name__, [type(layer).__name__ for layer in cache.layers])
        out = model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
        decode = measure(out.past_key_values)
    return prefill, decode


def test_real_dynamic_cache_llama_gqa_bf16():
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    (pre_storage, pre_view, kind, _), (dec_storage, dec_view) = _run(cfg, torch.bfloat16)
    assert kind == "DynamicCache"
    spec = spec_from_config(cfg.to_dict())
    assert pre_storage == pre_view == kv_cache_bytes(spec, BATCH, PROMPT, 2)
    assert dec_storage == dec_view == kv_cache_bytes(spec, BATCH, PROMPT + 1, 2)
    # Independent: 2 layers x 2 (K, V) x batch 2 x 7 tokens x 2 kv heads x 16 dims x 2 bytes.
    assert pre_storage == 2 * 2 * 2 * 7 * 2 * 16 * 2


def test_real_dynamic_cache_falcon_mqa_fp32():
    cfg = transformers.FalconConfig(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    multi_query=True, new_decoder_architecture=False)
    (pre_storage, _, _, _), (dec_storage, _) = _run(cfg, torch.float32)
    spec = spec_from_config(cfg.to_dict())
    assert spec.num_kv_heads == 1
    assert pre_storage == kv_cache_bytes(spec, BATCH, PROMPT, 4) == 2 * 2 * 2 * 7 * 1 * 16 * 4
    assert dec_storage == kv_cache_bytes(spec, BATCH, PROMPT + 1, 4)


WINDOW = 4


def _tiny_mistral():
    return transformers.MistralConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      sliding_window=WINDOW)


def _tiny_gemma3():
    # 6 layers: 5 sliding (window 4) then 1 full, from Gemma3TextConfig's default pattern.
    return transformers.Gemma3TextConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         sliding_window=WINDOW)


@pytest.mark.parametrize("make_cfg", [_tiny_mistral, _tiny_gemma3], ids=["mistral", "gemma3"])
def test_real_sliding_cache_during_decode(make_cfg):
    cfg = make_cfg()
    (_, _, kind, layer_kinds), (dec_storage, dec_view) = _run(cfg, torch.float32)
    spec = spec_from_config(cfg.to_dict())
    n_sliding = spec.layer_types.count("sliding")
    assert kind == "DynamicCache" and layer_kinds.count("DynamicSlidingWindowLayer") == n_sliding > 0
    # After a decode step, 8 tokens seen: a sliding layer holds W = 4 tokens of storage ...
    assert dec_storage == kv_cache_bytes(spec, BATCH, PROMPT + 1, 4)
    # ... of which its keys/values *view* shows W - 1 = 3 (transformers keeps `sliding_window - 1`
    # tokens; the view shares the storage of the W-token concatenation).
    one_token_per_layer = 2 * BATCH * spec.kv_dim * 4
    assert dec_view == dec_storage - n_sliding * one_token_per_layer


@pytest.mark.parametrize("make_cfg", [_tiny_mistral, _tiny_gemma3], ids=["mistral", "gemma3"])
def test_real_sliding_cache_after_prefill_holds_whole_prompt(make_cfg):
    cfg = make_cfg()
    (pre_storage, pre_view, _, _), (dec_storage, _) = _run(cfg, torch.float32)
    spec = spec_from_config(cfg.to_dict())
    # After a 7-token prompt with a window of 4, every sliding layer keeps a 3-token view of the
    # 7-token prefill tensor: the storage of the whole prompt stays allocated until decode starts.
    full = 2 * BATCH * PROMPT * spec.kv_dim * 4 * spec.num_layers
    assert pre_storage == full
    assert pre_view < pre_storage
    # Mechanism-derived expectation for the estimator: the persistent KV of an inference workload
    # is the largest cache held at any time, i.e. max(after prefill, during decode).
    w = Workload(model=spec, method="inference", precision="fp32", batch=BATCH, seq=PROMPT, new_tokens=1).validate()
    predicted = estimate_memory(w, 0.0, 0).kv_cache_bytes
    assert predicted == max(pre_storage, dec_storage)


# --- newer families: the cache transformers really keeps -------------------------------------------

from tests.arch_configs import TINY  # noqa: E402


@pytest.mark.parametrize("name", sorted(TINY))
def test_layer_kinds_of_newer_families_match_transformers_cache(name):
    cfg = AutoConfig.for_model(**TINY[name])
    types, kwargs = get_layer_types_and_kwargs(cfg)
    spec = spec_from_config(TINY[name])
    # a chunked layer (Llama-4) is cached as a sliding window of the chunk size (cache_utils)
    # a linear-attention layer (Qwen3-Next) keeps conv and recurrent states (LinearAttentionLayer)
    assert spec.layer_types == tuple("sliding" if t in ("sliding_attention", "chunked_attention")
                                     else "linear" if t == "linear_attention" else "full" for t in types)
    windows = {k["sliding_window"] for k in kwargs if "sliding_window" in k}
    assert windows == ({spec.sliding_window} if spec.sliding_window else set())


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2-lite"])
def test_real_cache_mla_holds_the_compressed_latent(name):
    # transformers 5.23 DeepseekV2/V3Attention calls past_key_values.update(kv_nope, k_rot): the
    # cache holds the normed latent (kv_lora_rank) and the rotary key (qk_rope_head_dim), one
    # "head", not the keys and values kv_b_proj expands per head.
    raw = TINY[name]
    cfg = AutoConfig.for_model(**raw)
    (pre_storage, pre_view, _, _), (dec_storage, _) = _run(cfg, torch.float32)
    spec = spec_from_config(raw)
    per_token_layer = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    assert pre_storage == pre_view == raw["num_hidden_layers"] * BATCH * PROMPT * per_token_layer * 4
    assert pre_storage == kv_cache_bytes(spec, BATCH, PROMPT, 4)
    assert dec_storage == kv_cache_bytes(spec, BATCH, PROMPT + 1, 4)
    # ... far less than the expanded keys and values would take
    expanded = 2 * raw["num_attention_heads"] * (raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"])
    assert spec.kv_cache_width() < expanded
    # tensor parallel does not split the one latent head
    assert kv_cache_bytes(spec, BATCH, PROMPT, 4, tp=4) == kv_cache_bytes(spec, BATCH, PROMPT, 4)


@pytest.mark.parametrize("name", ["gpt_oss", "exaone4", "starcoder2", "olmo2", "glm4_moe", "llama4_text", "olmo", "stablelm",
                                  "stablelm-qk-parallel", "gptj", "glm", "glm4", "cohere2"])
def test_real_cache_newer_families(name):
    raw = TINY[name]
    cfg = AutoConfig.for_model(**raw)
    # bf16: transformers 5.23's grouped_mm experts (MoE families) take bf16 only on recent GPUs
    (pre_storage, _, _, layer_kinds), (dec_storage, _) = _run(cfg, torch.bfloat16)
    spec = spec_from_config(raw)
    assert layer_kinds.count("DynamicSlidingWindowLayer") == spec.layer_types.count("sliding")
    assert dec_storage == kv_cache_bytes(spec, BATCH, PROMPT + 1, 2)
    attn = "eager" if raw["model_type"] in NO_SDPA else "sdpa"   # GPT-J, GPT-OSS: no SDPA in transformers 5.23
    w = Workload(model=spec, method="inference", precision="bf16", batch=BATCH, seq=PROMPT, new_tokens=1,
                 attn=attn).validate()
    assert estimate_memory(w, 0.0, 0).kv_cache_bytes == max(pre_storage, dec_storage)


def _linear_state_bytes(cache) -> tuple[int, int, list]:
    """(conv + recurrent state bytes, key/value bytes, (shape, dtype) of each state) of a cache."""
    states, kv, seen = 0, 0, []
    for layer in cache.layers:
        for group in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            for t in group.values():
                if t is not None:
                    states += t.untyped_storage().nbytes()
                    seen.append((tuple(t.shape), t.dtype))
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            kv += layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
    return states, kv, seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_cache_qwen3_next_linear_states_constant_in_length(dtype):
    # transformers 5.23 Qwen3-Next: the linear-attention layers' LinearAttentionLayer keeps a conv state
    # (batch, 2 x key dim + value dim, kernel) in the activations' dtype and a recurrent state (batch,
    # value heads, key head dim, value head dim) in fp32 (torch_chunk_gated_delta_rule computes in fp32);
    # the full-attention layers a DynamicLayer of keys and values. Generate on CPU and measure.
    raw = TINY["qwen3_next"]
    cfg = AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (BATCH, PROMPT))
    nbytes = torch.finfo(dtype).bits // 8
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=0)
    states, kv, seen = _linear_state_bytes(out.past_key_values)
    # hand-worked from the raw config: 3 linear layers (interval 4), conv_dim = 2 x 2 x 8 + 4 x 12 = 80
    conv = BATCH * (2 * 2 * 8 + 4 * 12) * 4 * nbytes
    recurrent = BATCH * 4 * 8 * 12 * 4
    assert seen.count(((BATCH, 80, 4), dtype)) == 3 and seen.count(((BATCH, 4, 8, 12), torch.float32)) == 3
    assert states == 3 * (conv + recurrent)
    # the one full layer: keys and values of the prompt and the generated tokens but the last
    assert kv == 2 * BATCH * (PROMPT + 2) * 2 * 16 * nbytes
    spec = spec_from_config(raw)
    assert spec.linear_state_bytes(BATCH, nbytes) == states
    assert kv_cache_bytes(spec, BATCH, PROMPT + 2, nbytes) == states + kv
    # the states do not grow with the sequence: 10x the tokens adds only the full layer's keys/values
    assert kv_cache_bytes(spec, BATCH, 10 * PROMPT, nbytes) - kv_cache_bytes(spec, BATCH, PROMPT, nbytes) \
        == 2 * BATCH * 9 * PROMPT * 2 * 16 * nbytes
    if dtype != torch.bfloat16:
        return    # fp32 MoE experts are refused by the Workload (grouped_mm takes bf16 on GPUs)
    (pre_storage, _, kind, kinds), (dec_storage, _) = _run_linear(cfg, dtype)
    assert kinds.count("LinearAttentionLayer") == 3
    w = Workload(model=spec, method="inference", precision="bf16", batch=BATCH, seq=PROMPT, new_tokens=1).validate()
    assert estimate_memory(w, 0.0, 0).kv_cache_bytes == max(pre_storage, dec_storage)


def _linear_bytes(cache) -> tuple:
    """(bytes of states and keys/values, no view count) of a cache with linear-attention layers."""
    states, kv, _ = _linear_state_bytes(cache)
    return states + kv, None


def _run_linear(cfg, dtype):
    return _run(cfg, dtype, _linear_bytes)


def test_a_decode_step_copies_one_layers_keys_or_repeats_them_for_eager():
    """transformers 5.23 DynamicLayer.update: torch.cat of the keys, then of the values, so one of
    them exists twice for a moment; eager attention then repeats the layer's keys and values to the
    32 query heads (repeat_kv), SDPA does not (GQA for one query)."""
    from estimator.memory import components

    spec = load_spec("llama-3.1-8b")              # 32 layers, 32 heads, 8 kv heads, head_dim 128
    tokens = 128 + 8192
    for attn, expected in (("sdpa", 1 * tokens * 8 * 128 * 2), ("eager", 1 * tokens * 2 * 32 * 128 * 2)):
        w = Workload(spec, method="inference", batch=1, seq=128, new_tokens=8192, attn=attn).validate()
        assert components(w).kv_growth == expected, attn
        assert estimate_memory(w, 0.0, 0).peak_phase == "decode"
