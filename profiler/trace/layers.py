"""Layer extrapolation: which small models to trace, and how to combine their peaks.

A decoder's peak memory is linear in the number of layers of each kind (every layer of a kind
holds the same parameters, states and saved activations; the peak of a phase sits at the same
point of the step). Layer kinds are what changes a layer's memory: its attention type
(`layer_types`: full or sliding, Gemma 2/3) and whether it holds an MoE block (Qwen-MoE's
`mlp_only_layers`). With K kinds the tracer runs K + 1 small models: a base of `repeats` layers
of every kind, and the base plus one more layer of each kind. Then for N_k layers of kind k:

    peak(N) = T_base + sum_k (T_base+k - T_base) x (N_k - repeats)

applied to each phase peak and each category separately.
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.workload import Workload
from profiler.build import hf_config

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_MOE_FLAG_TYPES = ("qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class Kind:
    """What makes one decoder layer's memory differ from another's."""

    attention: str | None   # HF layer_types entry, None when the config has no layer_types
    moe: bool


def layer_kinds(cfg: dict, w: Workload) -> list[Kind]:
    """The kind of every layer of the model, in order."""
    config = hf_config(cfg, w)
    n = w.model.num_layers
    types = list(getattr(config, "layer_types", None) or [None] * n)
    flags = list(w.model.moe_layer_flags) or [False] * n
    if len(types) != n or len(flags) != n:
        raise ValueError(f"layer_types/MoE flags do not match the {n} layers of {w.model.name}")
    if len(set(flags)) > 1 and w.model.model_type not in _MOE_FLAG_TYPES:
        raise NotImplementedError(f"mixed dense/MoE layers of {w.model.model_type} cannot be reduced")
    return [Kind(t, f) for t, f in zip(types, flags)]


def reduced_config(cfg: dict, kinds: list[Kind]) -> dict:
    """`cfg` with its layers replaced by `kinds` (layer count, layer_types, MoE layer flags)."""
    out = dict(cfg)
    keys = [k for k in _LAYER_KEYS if k in cfg] or ["num_hidden_layers"]
    for key in keys:
        out[key] = len(kinds)
    if kinds[0].attention is not None:
        out["layer_types"] = [k.attention for k in kinds]
    if cfg.get("model_type") in _MOE_FLAG_TYPES:
        out["decoder_sparse_step"] = 1
        out["mlp_only_layers"] = [i for i, k in enumerate(kinds) if not k.moe]
    return out


def first_layers(cfg: dict, layers: int) -> dict:
    """A (text) config cut to its first `layers` decoder layers: the layer count, the per-layer
    lists (layer_types; Llama-4's no_rope_layers) and the MoE layer indices kept below it."""
    out = dict(cfg)
    for key in [k for k in _LAYER_KEYS if k in cfg] or ["num_hidden_layers"]:
        out[key] = layers
    for key in ("layer_types", "no_rope_layers"):
        if isinstance(cfg.get(key), list):
            out[key] = cfg[key][:layers]
    if isinstance(cfg.get("moe_layers"), list):
        out["moe_layers"] = [i for i in cfg["moe_layers"] if i < layers]
    return out


@dataclass(frozen=True)
class Plan:
    """The small models to trace and the weight of each in the extrapolated total."""

    models: tuple[tuple[Kind, ...], ...]   # layer kinds of each traced model
    weights: tuple[float, ...]             # coefficient of each traced model's measurement


def plan(kinds: list[Kind], repeats: int = 1) -> Plan:
    """Traces for extrapolating to `kinds`: base = `repeats` x every kind, then base + one of each.
    A model no larger than its base is traced whole (weight 1)."""
    distinct = list(dict.fromkeys(kinds))
    base = tuple(distinct * repeats)
    if len(kinds) <= len(base) + 1:
        return Plan((tuple(kinds),), (1.0,))
    counts = {k: kinds.count(k) for k in distinct}
    models = [base] + [base + (k,) for k in distinct]
    extra = [counts[k] - repeats for k in distinct]
    weights = [1.0 - sum(extra)] + [float(e) for e in extra]
    return Plan(tuple(models), tuple(weights))


def combine(values: list[dict], weights: tuple[float, ...]) -> dict:
    """Weighted sum of {key: bytes} dicts (missing keys count 0), rounded to whole bytes."""
    keys = dict.fromkeys(k for v in values for k in v)
    return {k: int(round(sum(wt * v.get(k, 0) for v, wt in zip(values, weights)))) for k in keys}
