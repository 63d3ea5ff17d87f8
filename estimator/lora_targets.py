"""LoRA targets matched the way peft matches them, on the module names transformers 5 gives each family.

peft 0.21.2 (`tuners/tuners_utils.py` `check_target_module_exists`, `_maybe_include_all_linear_layers`):
- a string is a regular expression that must match the whole module name (`re.fullmatch`);
- a list matches a module whose full name is in it or ends with "." + one of its entries;
- `all-linear` is every `nn.Linear` and GPT-2 `Conv1D` except the output embedding (lm_head);
- `lm_head` targeted by name gets an adapter r x (hidden + vocab); an embedding (`embed_tokens`,
  `wte`, ...) gets `lora_embedding_A` (r x vocab) and `lora_embedding_B` (dim x r).
MoE experts in transformers 5 are fused 3-D parameters and routers are custom modules, not linear
modules; for the families peft converts (Mixtral, Qwen3-MoE: `utils/transformers_weight_conversion.py`)
the old expert and router names (and all-linear, and a regex, resolved to leaf names first) become
parameter targets: one LoRA per expert stacked on `gate_up_proj` (rank doubled) and `down_proj`, and
one on the router weight. Other MoE families (Qwen1.5-MoE) keep their experts untargeted; Qwen-MoE's
`shared_expert_gate` is an `nn.Linear`. What a parameter-targeted expert LoRA adds to the activations
(peft materialises the delta weight) is not modelled yet.

The Workload keeps `lora_targets` as a tuple of strings: one entry with regex characters is a
pattern; `all-linear` (or the seven Llama roles, its stored form) is peft's all-linear; other entries are
module names. A Llama role name a family does not use (q_proj on GPT-2) keeps the estimator's earlier
meaning, the projection of that role inside the family's own (possibly fused) module.

Module names per family come from meta builds of transformers 5.23 (tests/test_lora_targets.py checks
the trainable parameter count against peft's on every catalog family).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import NamedTuple

from estimator.errors import InputError
from estimator.model import ModelSpec
from estimator.params import ALL_LINEAR, _linear_attention_linears, _mla_linears

ALL_LINEAR_TEXT = "all-linear"
_REGEX_CHARS = re.compile(r"[\\^$*+?()\[\]{}|]")
_QKV = ("q_proj", "k_proj", "v_proj")

# model_type -> (decoder layer prefix, {module suffix: roles it holds}, embedding name)
_LLAMA_NAMES = {"self_attn.q_proj": ("q_proj",), "self_attn.k_proj": ("k_proj",), "self_attn.v_proj": ("v_proj",),
                "self_attn.o_proj": ("o_proj",), "mlp.gate_proj": ("gate_proj",), "mlp.up_proj": ("up_proj",),
                "mlp.down_proj": ("down_proj",)}
_GPT2_NAMES = {"attn.c_attn": _QKV, "attn.c_proj": ("o_proj",), "mlp.c_fc": ("up_proj",), "mlp.c_proj": ("down_proj",)}
_BLOOM_NAMES = {"self_attention.query_key_value": _QKV, "self_attention.dense": ("o_proj",),
                "mlp.dense_h_to_4h": ("up_proj",), "mlp.dense_4h_to_h": ("down_proj",)}
_LAYOUTS = {
    "phi": ("model.layers.{}.", {"self_attn.q_proj": ("q_proj",), "self_attn.k_proj": ("k_proj",),
                                 "self_attn.v_proj": ("v_proj",), "self_attn.dense": ("o_proj",),
                                 "mlp.fc1": ("up_proj",), "mlp.fc2": ("down_proj",)}, "model.embed_tokens"),
    "phi3": ("model.layers.{}.", {"self_attn.qkv_proj": _QKV, "self_attn.o_proj": ("o_proj",),
                                  "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)},
             "model.embed_tokens"),
    "opt": ("model.decoder.layers.{}.", {"self_attn.q_proj": ("q_proj",), "self_attn.k_proj": ("k_proj",),
                                         "self_attn.v_proj": ("v_proj",), "self_attn.out_proj": ("o_proj",),
                                         "fc1": ("up_proj",), "fc2": ("down_proj",)}, "model.decoder.embed_tokens"),
    "gpt2": ("transformer.h.{}.", _GPT2_NAMES, "transformer.wte"),
    "gpt_bigcode": ("transformer.h.{}.", _GPT2_NAMES, "transformer.wte"),
    "bloom": ("transformer.h.{}.", _BLOOM_NAMES, "transformer.word_embeddings"),
    "falcon": ("transformer.h.{}.", _BLOOM_NAMES, "transformer.word_embeddings"),
    "gpt_neox": ("gpt_neox.layers.{}.", {"attention.query_key_value": _QKV, "attention.dense": ("o_proj",),
                                         "mlp.dense_h_to_4h": ("up_proj",), "mlp.dense_4h_to_h": ("down_proj",)},
                 "gpt_neox.embed_in"),
    # transformers 5.23 GPTJAttention / GPTJMLP
    "gptj": ("transformer.h.{}.", {"attn.q_proj": ("q_proj",), "attn.k_proj": ("k_proj",), "attn.v_proj": ("v_proj",),
                                   "attn.out_proj": ("o_proj",), "mlp.fc_in": ("up_proj",), "mlp.fc_out": ("down_proj",)},
             "transformer.wte"),
    # GlmMLP / Glm4MLP: one gate_up_proj
    "glm": ("model.layers.{}.", {**{k: v for k, v in _LLAMA_NAMES.items() if k.startswith("self_attn.")},
                                 "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)},
            "model.embed_tokens"),
}
_LAYOUTS["glm4"] = _LAYOUTS["glm"]
# Starcoder2MLP: c_fc, c_proj (a GELU MLP); Starcoder2Attention's q/k/v/o_proj
_LAYOUTS["starcoder2"] = ("model.layers.{}.", {**{k: v for k, v in _LLAMA_NAMES.items() if k.startswith("self_attn.")},
                                               "mlp.c_fc": ("up_proj",), "mlp.c_proj": ("down_proj",)},
                          "model.embed_tokens")
_DEFAULT_LAYOUT = ("model.layers.{}.", _LLAMA_NAMES, "model.embed_tokens")
# vision-language models: the language model under model.language_model (Qwen2.5-VL, Qwen3-VL)
for _vl in ("qwen2_5_vl", "qwen3_vl"):
    _LAYOUTS[_vl] = ("model.language_model.layers.{}.", _LLAMA_NAMES, "model.language_model.embed_tokens")


class Site(NamedTuple):
    """One module an adapter can sit on: full name, input and output width, the roles it holds
    (estimator.params roles; "lm_head", "embed" or "router" outside the decoder's projections)."""

    name: str
    d_in: int
    d_out: int
    roles: tuple[str, ...]
    kind: str          # "linear", "head" (the output embedding), "embedding"


def _widths(spec: ModelSpec, roles: tuple[str, ...], width: int) -> tuple[int, int]:
    gated = 2 if spec.attn_output_gate else 1   # Qwen3-Next's q_proj also emits the output gate
    out = {"q_proj": gated * spec.q_dim, "k_proj": spec.kv_dim, "v_proj": spec.kv_dim, "o_proj": spec.hidden_size,
           "gate_proj": width, "up_proj": width, "down_proj": spec.hidden_size}
    d_in = {"o_proj": spec.q_dim, "down_proj": width}.get(roles[0], spec.hidden_size)
    return d_in, sum(out[r] for r in roles)


# families whose shared experts sit in `mlp.shared_experts` (DeepseekV2/V3MoE, Glm4MoeMoE) rather than
# Qwen-MoE's `mlp.shared_expert`
_SHARED_EXPERTS = {"deepseek_v2": "shared_experts", "deepseek_v3": "shared_experts", "glm4_moe": "shared_experts"}


def _mla_sites(spec: ModelSpec, prefix: str) -> list[Site]:
    """DeepseekV2/V3Attention's linears by their own names, shapes from estimator.params (one owner)."""
    return [Site(f"{prefix}self_attn.{lin.role}", lin.d_in, lin.d_out, (lin.role,), "linear")
            for lin in _mla_linears(spec)]


# families whose feed-forward block is not `mlp` (Llama4TextDecoderLayer.feed_forward); their router
# is an nn.Linear (Llama4Router), so all-linear reaches it
_FEED_FORWARD = {"llama4_text": "feed_forward"}
LINEAR_ROUTER = ("llama4_text",)


def _linear_attention_sites(spec: ModelSpec, prefix: str) -> list[Site]:
    """Qwen3NextGatedDeltaNet's linears (`linear_attn.*`; its conv1d is an nn.Conv1d, not a target)."""
    return [Site(f"{prefix}linear_attn.{lin.role}", lin.d_in, lin.d_out, (lin.role,), "linear")
            for lin in _linear_attention_linears(spec)]


def _layer_sites(spec: ModelSpec, prefix: str, names: dict, i: int) -> list[Site]:
    sites = _mla_sites(spec, prefix) if spec.is_mla else []
    if spec.layer_types and spec.layer_types[i] == "linear":
        sites = _linear_attention_sites(spec, prefix)
        names = {k: v for k, v in names.items() if not k.startswith("self_attn.")}
    moe = spec.is_moe and spec.moe_layer_flags[i]
    ff = _FEED_FORWARD.get(spec.model_type, "mlp")
    names = {(ff + k[3:] if k.startswith("mlp.") else k): v for k, v in names.items()}
    for suffix, roles in names.items():
        if (moe and suffix.startswith(ff + ".")) or (spec.is_mla and suffix.startswith("self_attn.")):
            continue
        sites.append(Site(prefix + suffix, *_widths(spec, roles, spec.intermediate_size), roles, "linear"))
    if moe and spec.model_type in LINEAR_ROUTER:
        sites.append(Site(f"{prefix}{ff}.router", spec.hidden_size, spec.num_experts, ("router",), "linear"))
    if moe and spec.shared_expert_intermediate_size:
        shared = _SHARED_EXPERTS.get(spec.model_type, "shared_expert")
        for suffix, roles in names.items():
            if suffix.startswith(ff + "."):
                name = f"{prefix}{ff}.{shared}.{suffix[len(ff) + 1:]}"
                sites.append(Site(name, *_widths(spec, roles, spec.shared_expert_intermediate_size), roles, "linear"))
        if spec.shared_expert_gate:
            sites.append(Site(prefix + "mlp.shared_expert_gate", spec.hidden_size, 1, ("router",), "linear"))
    return sites


@lru_cache(maxsize=256)
def sites(spec: ModelSpec) -> tuple[Site, ...]:
    """Every module of the model an adapter can target, layer by layer, then the embedding and lm_head."""
    if getattr(spec, "card_path", ""):   # structure card (estimator/cards.py): the module names as built
        from estimator.cards import card_sites
        return card_sites(spec)
    prefix, names, embed = _LAYOUTS.get(spec.model_type, _DEFAULT_LAYOUT)
    out = []
    for i in range(spec.num_layers):
        out += _layer_sites(spec, prefix.format(i), names, i)
    # a VL model's vision tower: peft matches its linears too (all-linear, a regex, a shared leaf name
    # such as Qwen2.5-VL's gate_proj); role "vision" keeps them out of the decoder-layer formulas
    for template, d_in, d_out, blocks in spec.vision_linears:
        out += [Site(template.format(i), d_in, d_out, ("vision",), "linear") for i in range(blocks)]
    if spec.embed_dim != spec.hidden_size:   # OPT-350m's projections around the decoder
        out += [Site("model.decoder.project_in", spec.embed_dim, spec.hidden_size, ("project_in",), "linear"),
                Site("model.decoder.project_out", spec.hidden_size, spec.embed_dim, ("project_out",), "linear")]
    out.append(Site(embed, spec.vocab_size, spec.embed_dim, ("embed",), "embedding"))
    out.append(Site("lm_head", spec.embed_dim, spec.vocab_size, ("lm_head",), "head"))
    return tuple(out)


def is_all_linear(targets: tuple[str, ...]) -> bool:
    return targets == ALL_LINEAR or targets == (ALL_LINEAR_TEXT,)


def is_pattern(targets: tuple[str, ...]) -> bool:
    return len(targets) == 1 and bool(_REGEX_CHARS.search(targets[0]))


# peft 0.21.2 utils/transformers_weight_conversion.py `_MOE_TARGET_MODULE_MAPPING`/`_MOE_FUSED_TARGETS`: for
# these model_types (transformers' conversion pattern) the transformers-4 names of the experts and the router
# are mapped onto the fused 3-D expert parameters (a LoRA per expert, stacked) and the router's weight
_MOE_MAPPING = {
    "mixtral": {"gate": "router", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    "qwen3_moe": {"gate": "router", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"},
}
# transformers 5.23 `conversion_mapping._MODEL_TO_CONVERSION_PATTERN` gives these the qwen2_moe pattern too (peft
# reads that table); each is checked against peft in tests/test_lora_targets.py through its catalog entry
for _model_type in ("deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_next", "olmoe", "ernie4_5_moe"):
    _MOE_MAPPING[_model_type] = _MOE_MAPPING["qwen3_moe"]


def _moe_params(spec: ModelSpec, i: int) -> list[Site]:
    """Layer i's router weight and fused expert parameters, as peft's parameter targeting sees them:
    r x (in + out) for the router, rank x experts rows for the experts' stacked lora_A/lora_B
    (encoded as widths multiplied by the number of experts; gate_up_proj's rank is doubled)."""
    prefix, h, e, width = f"model.layers.{i}.mlp.", spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    return [Site(prefix + "gate.weight", h, e, ("router",), "router"),
            Site(prefix + "experts.gate_up_proj", 2 * e * h, 2 * e * 2 * width, ("gate_proj", "up_proj"), "experts"),
            Site(prefix + "experts.down_proj", e * width, e * h, ("down_proj",), "experts")]


def _moe_converted(spec: ModelSpec, targets: tuple[str, ...], every: tuple[Site, ...]) -> tuple[Site, ...]:
    """peft's conversion of the targets of a transformers-5 MoE model: a regex or all-linear is first
    resolved to leaf names (then applied to every layer); names of the old expert/router modules
    become parameter targets; gate and up must be targeted together (they are fused)."""
    mapping = _MOE_MAPPING[spec.model_type]
    layers = [i for i in range(spec.num_layers) if spec.moe_layer_flags[i]]
    params = [site for i in layers for site in _moe_params(spec, i)]
    if is_all_linear(targets):
        leaves = {x.name.rpartition(".")[2] for x in every if x.kind == "linear"} | set(mapping)
    elif is_pattern(targets):
        pattern = _compile(targets[0])
        keys = [x.name for x in every] + [x.name.removesuffix(".weight") for x in params if x.kind == "router"]
        keys += [x.name for x in params]
        leaves = {k.rpartition(".")[2] for k in keys if pattern.fullmatch(k)}
        containers = {x.name.rpartition(".")[0] for x in params if x.kind == "experts"}
        leaves |= {old for old, new in mapping.items() if new != "router"
                   and any(pattern.fullmatch(f"{c}.{old}") for c in containers)}
    else:
        leaves = set(targets)
    hit = {mapping[t.rpartition(".")[2]] for t in leaves if t.rpartition(".")[2] in mapping}
    fused = [old for old, new in mapping.items() if new == "gate_up_proj"]
    named = [old for old in fused if any(t.rpartition(".")[2] == old for t in leaves)]
    if 0 < len(named) < len(fused):
        raise InputError(f"LoRA target {','.join(named)} needs {','.join(sorted(set(fused) - set(named)))} too: "
                         f"{spec.model_type} fuses them into gate_up_proj (peft refuses one without the other)")
    modules = {t for t in leaves if t.rpartition(".")[2] not in mapping}
    found = [x for x in every if x.name in modules or any(x.name.endswith("." + t) for t in modules)]
    found += [x for x in params if (x.kind == "router" and "router" in hit)
              or (x.kind == "experts" and x.name.rpartition(".")[2] in hit)]
    return tuple(found)


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise InputError(f"LoRA target pattern {pattern!r} is not a regular expression: {exc}") from None


@lru_cache(maxsize=1024)
def matched(spec: ModelSpec, targets: tuple[str, ...]) -> tuple[Site, ...]:
    """The sites peft puts an adapter on for `targets` (InputError when nothing matches, as peft raises)."""
    every = sites(spec)
    if spec.model_type in _MOE_MAPPING and (is_all_linear(targets) or is_pattern(targets)
                                            or any(t.rpartition(".")[2] in _MOE_MAPPING[spec.model_type]
                                                   for t in targets)):
        found = _moe_converted(spec, targets, every)   # peft drops the mapped names from its module targets
    elif is_all_linear(targets):
        return tuple(s for s in every if s.kind == "linear")
    elif is_pattern(targets):
        pattern = _compile(targets[0])
        found = tuple(s for s in every if pattern.fullmatch(s.name))
    else:
        names = {s.name.rpartition(".")[2] for s in every}
        found = []
        for s in every:
            if s.name in targets or any(s.name.endswith("." + t) for t in targets):
                found.append(s)
            elif s.kind == "linear" and any(t in s.roles and t not in names for t in targets):
                found += _role_parts(spec, s, targets)   # Llama roles the family names otherwise
        found = tuple(found)
    if not found:
        raise InputError(f"LoRA targets {','.join(targets)} match no module of {spec.model_type} (its modules: "
                         f"{', '.join(sorted({s.name.rpartition('.')[2] for s in every}))}; choose with --lora-targets, "
                         f"e.g. all-linear)")
    return found


def _role_parts(spec: ModelSpec, s: Site, targets: tuple[str, ...]) -> list[Site]:
    """One adapter per role of `s` that `targets` names (the estimator's role vocabulary: the
    projection of that role, as if the family's fused module were split)."""
    width = spec.shared_expert_intermediate_size if ".shared_expert." in s.name else spec.intermediate_size
    return [Site(s.name, *_widths(spec, (role,), width), (role,), s.kind) for role in s.roles if role in targets]


@lru_cache(maxsize=1024)
def adapter_shapes(spec: ModelSpec, targets: tuple[str, ...]) -> tuple[tuple[int, int, int], ...]:
    """(d_in, d_out, how many) of every adapter, grouped by shape."""
    counts: dict[tuple[int, int], int] = {}
    for s in matched(spec, targets):
        counts[(s.d_in, s.d_out)] = counts.get((s.d_in, s.d_out), 0) + 1
    return tuple((d_in, d_out, n) for (d_in, d_out), n in counts.items())


@lru_cache(maxsize=1024)
def expert_targets(spec: ModelSpec, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The fused expert parameters ("gate_up_proj", "down_proj") peft's conversion targets, sorted."""
    if spec.model_type not in _MOE_MAPPING:
        return ()
    return tuple(sorted({s.name.rpartition(".")[2] for s in matched(spec, targets) if s.kind == "experts"}))


def trained_roles(spec: ModelSpec, targets: tuple[str, ...]) -> tuple[tuple[str, ...], int]:
    """(roles with an adapter in the decoder layers or on lm_head, adapters per layer): what the
    activation formulas read."""
    found = matched(spec, targets)
    # fused expert parameters are not linears: what their LoRA saves follows `expert_targets`
    roles = tuple(sorted({r for s in found for r in s.roles if s.kind not in ("embedding", "experts")}))
    layer_adapters = sum(1 for s in found if s.kind == "linear" and s.roles[0] in ALL_LINEAR)
    return roles, round(layer_adapters / max(spec.num_layers, 1))


def targets_from_text(text: str) -> tuple[str, ...]:
    """`lora_targets` from its text: all-linear, one regular expression, or a comma list of names."""
    text = text.strip()
    if text.lower() == ALL_LINEAR_TEXT:
        return ALL_LINEAR
    if _REGEX_CHARS.search(text):
        return (text,)
    return tuple(t.strip() for t in text.split(",") if t.strip())
