"""LoRA targets (estimator/lora_targets.py) against peft 0.21.2's own matching.

Oracle: for one catalog config of every model_type (two decoder layers, so the build is quick; the
module layout per layer is the same), transformers 5.23 builds the model on `meta` and
`peft.get_peft_model(model, LoraConfig(r=8, target_modules=...))` puts the adapters where peft's
rules put them; its trainable parameter count must equal the estimator's `lora_params` for:
all-linear, the family's own module names, a regular expression, lm_head, and the embedding.
"""

from __future__ import annotations

import csv
import json
import warnings
from functools import lru_cache

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from estimator.configs import CATALOG_DIR
from estimator.errors import InputError
from estimator.lora_targets import matched, sites
from estimator.model import spec_from_config
from estimator.params import count_params
from estimator.states import lora_params
from estimator.workload import NO_SDPA, Workload, lora_targets_from_text
from tests.arch_configs import TINY

transformers.logging.set_verbosity_error()
RANK = 8


def _families() -> dict[str, dict]:
    out = {}
    with (CATALOG_DIR / "index.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            cfg = json.loads((CATALOG_DIR / row["file"]).read_text())
            out.setdefault(cfg["model_type"], cfg)
    return out


def _two_layers(cfg: dict) -> dict:
    cfg = dict(cfg)
    if isinstance(cfg.get("text_config"), dict):       # a VL model's language model (Qwen3-VL)
        cfg["text_config"] = _two_layers(cfg["text_config"])
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in cfg:
            cfg[key] = 2
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:2]
    if cfg.get("no_rope_layers"):
        cfg["no_rope_layers"] = [1, 0]          # one chunked, one NoPE layer (Llama-4)
    if "moe_layers" in cfg:
        cfg["moe_layers"] = [1]                 # one dense and one MoE layer (Llama-4)
    if "full_attention_interval" in cfg:
        cfg["full_attention_interval"] = 2      # one linear-attention and one full-attention layer (Qwen3-Next)
    if "mlp_only_layers" in cfg:
        cfg["mlp_only_layers"] = [1]        # one dense and one MoE layer (Qwen-MoE)
    return cfg


FAMILIES = {mt: _two_layers(cfg) for mt, cfg in _families().items()}
# families without a catalog entry: their tiny configs (tests/arch_configs.py)
for _name in ("olmo", "stablelm", "stablelm-qk-parallel", "gptj", "glm", "glm4", "cohere2"):
    FAMILIES.setdefault(_name, TINY[_name])


def _peft_trainable(cfg: dict, targets) -> int:
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # vision-language models (language model + vision tower) build through their own auto class
        auto = AutoModelForImageTextToText if "vision_config" in cfg else AutoModelForCausalLM
        model = auto.from_config(AutoConfig.for_model(**cfg))
        model.tie_weights()
        model = get_peft_model(model, LoraConfig(r=RANK, target_modules=targets))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@lru_cache(maxsize=None)
def _spec(model_type: str):
    return spec_from_config(FAMILIES[model_type], model_type)


def _ours(model_type: str, targets: tuple) -> int:
    attn = "eager" if _spec(model_type).model_type in NO_SDPA else "sdpa"   # GPT-J: no SDPA in transformers 5.23
    w = Workload(_spec(model_type), method="lora", lora_rank=RANK, lora_targets=targets, attn=attn)
    try:
        w = w.validate()
    except InputError as exc:
        if "router" not in str(exc):
            raise
        # peft matches Llama-4's router but cannot run it (test_llama4_router_target_is_refused):
        # the matching itself is still compared with peft's
    return lora_params(w, count_params(w.model))


def _native_names(model_type: str) -> list[str]:
    """The family's own leaf names of its decoder-layer linear modules (from our table)."""
    return sorted({s.name.rpartition(".")[2] for s in sites(_spec(model_type))
                   if s.kind == "linear" and s.roles != ("vision",)})   # a VL tower's linears are not decoder modules


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_all_linear_equals_peft(model_type):
    assert _ours(model_type, lora_targets_from_text("all-linear")) == _peft_trainable(FAMILIES[model_type], "all-linear")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_own_module_names_equal_peft(model_type):
    names = _native_names(model_type)
    for chosen in (names[:1], names[-2:], names):
        try:
            expected = _peft_trainable(FAMILIES[model_type], chosen)
        except ValueError as exc:  # peft refuses half of a fused pair (Qwen3-MoE's gate/up), or finds nothing
            # once it has moved the expert names to parameter targets (a cut with no MoE layer): so do we
            with pytest.raises(InputError, match="fuses them" if "fused" in str(exc) else "match no module"):
                _ours(model_type, tuple(chosen))
            continue
        assert _ours(model_type, tuple(chosen)) == expected, chosen


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_regex_lm_head_and_the_embedding_equal_peft(model_type):
    cfg = FAMILIES[model_type]
    first_layer = r".*\.0\..*(proj|fc1|fc2|c_attn|c_fc|query_key_value|dense)"
    assert _ours(model_type, (first_layer,)) == _peft_trainable(cfg, first_layer)
    assert _ours(model_type, ("lm_head",)) == _peft_trainable(cfg, ["lm_head"])
    embed = next(s.name for s in sites(_spec(model_type)) if s.kind == "embedding").rpartition(".")[2]
    assert _ours(model_type, (embed,)) == _peft_trainable(cfg, [embed])


def test_text_forms():
    assert lora_targets_from_text("c_attn, c_proj") == ("c_attn", "c_proj")
    assert lora_targets_from_text(r".*\.(q|v)_proj") == (r".*\.(q|v)_proj",)
    assert lora_targets_from_text("All-Linear") == lora_targets_from_text("all-linear")


def test_llama_roles_keep_their_meaning_on_fused_families():
    # GPT-2 names its fused q/k/v projection c_attn: q_proj,v_proj there keep the estimator's earlier
    # meaning (one adapter per role, as if split), all-linear and c_attn are peft's
    spec = _spec("gpt2")
    h = spec.hidden_size
    assert _ours("gpt2", ("q_proj", "v_proj")) == spec.num_layers * RANK * (h + h + h + spec.kv_dim)
    assert _ours("gpt2", ("c_attn",)) == spec.num_layers * RANK * (h + 3 * h)


def test_moe_experts_and_router_are_targeted_as_peft_converts_them():
    # Mixtral all-linear: attention, the router (r x (hidden + experts)) and one LoRA per expert
    # stacked on gate_up_proj (rank 2r) and down_proj
    spec = _spec("mixtral")
    h, e, i, layers = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size, spec.num_layers
    attention = RANK * (h + spec.q_dim + spec.q_dim + h + 2 * (h + spec.kv_dim))
    experts = 2 * RANK * e * (h + 2 * i) + RANK * e * (i + h)
    assert _ours("mixtral", lora_targets_from_text("all-linear")) == layers * (attention + RANK * (h + e) + experts)


def test_a_target_matching_nothing_is_a_one_line_error():
    with pytest.raises(InputError, match="match no module of llama"):
        Workload(_spec("llama"), method="lora", lora_targets=("c_attn",)).validate()
    with pytest.raises(InputError, match="not a regular expression"):
        matched(_spec("llama"), ("(q_proj",))


def test_llama4_router_target_is_refused_because_peft_cannot_run_it():
    # the oracle: peft wraps Llama4Router (an nn.Linear returning a tuple) and its forward fails
    from peft import LoraConfig, get_peft_model

    cfg = dict(FAMILIES["llama4_text"], hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, num_local_experts=2,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
        model = get_peft_model(model, LoraConfig(r=RANK, target_modules="all-linear"))
        with pytest.raises(AttributeError, match="tuple"):
            model(torch.zeros(1, 4, dtype=torch.long))
    spec = _spec("llama4_text")
    for targets in (("all-linear",), ("router",), (r".*feed_forward\.router",)):
        with pytest.raises(InputError, match="router"):
            Workload(spec, method="lora", lora_targets=targets).validate()
    # naming projections, or a pattern over all of them, leaves the router alone
    Workload(spec, method="lora", lora_targets=("q_proj", "v_proj", "gate_proj")).validate()
    w = Workload(spec, method="lora", lora_targets=(r".*\.(q|k|v|o|gate|up|down)_proj",)).validate()
    assert not any("router" in s.roles for s in matched(spec, w.lora_targets))
