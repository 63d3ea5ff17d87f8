"""Make a structure card (estimator/cards.py reads it torch-free): build a config's model once on
the meta device with transformers and read off what the estimator's formulas need.

    python -m profiler.cards CONFIG.json [--out CARD.json] [--regime JSON ...] [--default-regimes]

- parameters by role, counted on the meta build (tied weights once): the input embedding, other
  embeddings (learned positions), the output head (tied or not, bias), every nn.Linear / GPT-2
  Conv1D by module name and shape (layer by layer, so LoRA targets are matched as peft matches
  them), and everything else (norms, fused experts, ...), with each layer's attention / MLP / norm
  / other split;
- the KV cache per layer: the model runs one short forward with `use_cache=True` on fake tensors
  (FakeTensorMode: the whole model, no memory) and each layer of the DynamicCache it returns is
  read: elements cached per token (keys and values) and whether it is a sliding-window layer;
- per training regime (method, precision, kernel, LoRA targets and rank, quantization,
  checkpointing, ...), saved-activation bytes per token: the fake-tensor tracer (profiler.trace)
  runs the real step of 2- and 3-layer versions of the model at two sequence lengths (three for
  eager attention, whose scores grow with the sequence), and the per-token slopes of what the
  estimator's moments read (saved at the backward's start, the forward's peak at the loss, the
  backward's peak at the loss and in the top layer) are stored. Assumed: every layer of the model
  saves what the traced ones do (layer kinds from `layer_types` are averaged with equal weights),
  and the memory is linear (quadratic with eager attention) in the sequence.

A config transformers cannot build exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from estimator import cards as ec
from estimator.errors import InputError
from estimator.files import atomic_write_json, parse_json

SEQS = (128, 256)          # two lengths: fp32 per-token scalars (4 B x T) fill whole 512-B blocks
SEQS_EAGER = (128, 256, 384)
LAYERS = (2, 3)
DEFAULT_REGIMES = [
    {"method": m, "precision": "bf16", "attn": "sdpa", "lora_targets": t, "lora_rank": r, "quant": "none",
     "grad_ckpt": ck, "kbit_prep": False, "liger": False, "loss": "hf"}
    for m, t, r in (("full", [], 0),) for ck in (False, True)]


class CardError(Exception):
    """What cannot be built or traced: one line for the user."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def build_config(cfg: dict):
    from transformers import AutoConfig

    values = {k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "quantization_config")}
    mt = values.pop("model_type", None)
    if not isinstance(mt, str):
        raise CardError("the config has no model_type")
    try:
        return AutoConfig.for_model(mt, **values)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; the user gets one line
        raise CardError(f"no config class for it ({_first_line(exc)})") from None


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def meta_model(cfg: dict, attn: str = "sdpa", dtype: str = "bfloat16"):
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(cfg)
    try:
        with torch.device("meta"):
            try:
                return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation=attn)
            except ValueError as exc:
                if "does not support an attention implementation" not in str(exc) or attn == "eager":
                    raise
                return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation="eager")
    except Exception as exc:  # noqa: BLE001
        raise CardError(_first_line(exc)) from None


def _layers(model):
    """(name, ModuleList) of the decoder layers: the longest list of modules of one class."""
    import torch

    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) and len({type(m) for m in mod}) == 1:
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise CardError(f"{type(model).__name__} has no list of decoder layers")
    return best


def _is_linear(mod) -> bool:
    import torch
    from transformers.pytorch_utils import Conv1D

    return isinstance(mod, (torch.nn.Linear, Conv1D))


def _shape(mod) -> tuple[int, int]:
    import torch

    if isinstance(mod, torch.nn.Linear):
        return mod.in_features, mod.out_features
    return mod.weight.shape[0], mod.weight.shape[1]      # Conv1D: (in, out)


def _block(rel: str) -> str:
    parts = rel.lower().split(".")
    return "attention" if any("attn" in p or "attention" in p for p in parts[:-1]) else "mlp"


def structure(cfg: dict) -> dict:
    """Everything but the regimes (see the module docstring)."""
    import torch

    model = meta_model(cfg)
    config = model.config
    layers_name, layers = _layers(model)
    prefix = f"{layers_name}.{{}}."
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    tied = head is not None and head.weight is emb.weight
    # linears layer by layer (distinct structures stored once)
    structures, which = [], []
    for layer in layers:
        lins = [{"name": rel, "d_in": _shape(m)[0], "d_out": _shape(m)[1], "bias": m.bias is not None,
                 "block": _block(rel)} for rel, m in layer.named_modules() if _is_linear(m)]
        if lins not in structures:
            structures.append(lins)
        which.append(structures.index(lins))
    in_layers = {id(p) for p in layers.parameters()}
    outside = [{"name": n, "d_in": _shape(m)[0], "d_out": _shape(m)[1], "bias": m.bias is not None, "block": "outside"}
               for n, m in model.named_modules() if _is_linear(m) and m is not head
               and not n.startswith(layers_name + ".")]
    # parameters by role, each tensor once
    seen, total, largest = set(), 0, 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
            largest = max(largest, p.numel())
    embedding = emb.weight.numel()
    lm_head = 0 if (head is None or tied) else head.weight.numel()
    lm_head_bias = head.bias.numel() if head is not None and getattr(head, "bias", None) is not None else 0
    positions = sum(m.weight.numel() for m in model.modules()
                    if isinstance(m, torch.nn.Embedding) and m is not emb and id(m.weight) not in in_layers)
    linear_elems = 0
    for i, s in enumerate(which):
        for lin in structures[s]:
            linear_elems += lin["d_in"] * lin["d_out"] + (lin["d_out"] if lin["bias"] else 0)
            largest = max(largest, lin["d_in"] * lin["d_out"] + (lin["d_out"] if lin["bias"] else 0))
    linear_elems += sum(x["d_in"] * x["d_out"] + (x["d_out"] if x["bias"] else 0) for x in outside)
    other = total - embedding - lm_head - lm_head_bias - positions - linear_elems
    attention_w = sum(lin["d_in"] * lin["d_out"] for s in which for lin in structures[s] if lin["block"] == "attention")
    per_layer = []
    for layer in layers:
        roles = {"attention": 0, "mlp": 0, "norm": 0, "other": 0}
        for rel, p in layer.named_parameters():
            owner = layer.get_submodule(rel.rpartition(".")[0]) if "." in rel else layer
            if _is_linear(owner):
                roles[_block(rel.rpartition(".")[0] + ".x")] += p.numel()
            elif "norm" in type(owner).__name__.lower():
                roles["norm"] += p.numel()
            else:
                roles["other"] += p.numel()
        per_layer.append(roles)
    hidden = int(getattr(config, "hidden_size", None) or emb.weight.shape[1])
    layer0 = structures[which[0]]
    mlp = [x for x in layer0 if x["block"] == "mlp"]
    inter = max([x["d_out"] for x in mlp if x["d_in"] == hidden] or [4 * hidden])
    readers = [x for x in mlp if x["d_in"] == hidden and x["d_out"] == inter]
    norms = [m for m in layers[0].children() if "norm" in type(m).__name__.lower()]
    pos_rows = max([m.weight.shape[0] for m in model.modules() if isinstance(m, torch.nn.Embedding)
                    and m is not emb and id(m.weight) not in in_layers] or [0])
    kv = kv_cache(model, len(layers))
    heads = int(getattr(config, "num_attention_heads", None) or kv["num_kv_heads"])
    card = {
        "schema": ec.CARD_SCHEMA,
        "model_type": cfg["model_type"], "class": type(model).__name__,
        "config_sha256": ec.config_sha(cfg), "transformers": _tf_version(), "torch": torch.__version__.split("+")[0],
        "key": ec.card_key(cfg, _tf_version()),
        "config": cfg,
        "num_layers": len(layers), "hidden_size": hidden, "vocab_size": int(emb.weight.shape[0]),
        "layer_prefix": prefix, "embedding_module": names[id(emb)], "head_module": names.get(id(head), "lm_head"),
        "params": {"total": total, "embedding": embedding, "positions": positions, "lm_head": lm_head,
                   "lm_head_bias": lm_head_bias, "tied": tied, "linear": linear_elems, "other": other,
                   "largest_tensor": largest, "attention_linear_weights": attention_w, "per_layer": per_layer},
        "linears": {"layer_structures": structures, "layer_structure_of": which, "outside": outside},
        "kv": kv,
        "spec": {"num_heads": heads, "num_kv_heads": kv["num_kv_heads"], "head_dim": kv["head_dim"],
                 "intermediate_size": inter, "mlp_gated": len(readers) >= 2,
                 "activation": str(getattr(config, "hidden_act", None) or getattr(config, "activation_function", "unknown")),
                 "norm": "layer" if any(isinstance(m, torch.nn.LayerNorm) for m in layers[0].modules()) else "rms",
                 "norms_per_layer": max(1, len(norms)), "learned_positions": pos_rows,
                 "embed_dim": int(emb.weight.shape[1]),
                 "max_position_embeddings": int(getattr(config, "max_position_embeddings", 0) or 0)},
        "assumptions": [
            "per-token activation bytes: slopes over 2- and 3-layer traces at two sequence lengths (three with eager)",
            "layer kinds (layer_types) weighted equally; MoE experts all counted active",
            "inference working set: the estimator's formulas on the card's widths (not traced)"],
        "regimes": {},
    }
    return card


def kv_cache(model, n_layers: int, tokens: int = 8) -> dict:
    """What each layer of the DynamicCache holds per token after a `tokens`-long prefill on fake tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from profiler.trace.patches import tracing_patches
    from profiler.trace.step import _materialize

    model.config.use_cache = True
    model.eval()
    with FakeTensorMode(allow_non_fake_inputs=True), tracing_patches():
        _materialize(model, "cpu")
        ids = torch.zeros((1, tokens), dtype=torch.long)
        try:
            with torch.no_grad():
                out = model(input_ids=ids, use_cache=True)
        except Exception as exc:  # noqa: BLE001
            raise CardError(f"a forward of {type(model).__name__} on fake tensors failed: {_first_line(exc)}") from None
    cache = getattr(out, "past_key_values", None)
    layers = list(getattr(cache, "layers", []) or [])
    if not layers:
        raise CardError(f"{type(model).__name__} returns no key/value cache layers (state-space or recurrent "
                        f"caches are not modelled)")
    rows, window = [], None
    for layer in layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None:
            raise CardError(f"cache layer {type(layer).__name__} holds no keys/values (not modelled)")
        sliding = getattr(layer, "sliding_window", None)
        per_token = (keys.numel() + values.numel()) // tokens
        rows.append({"kind": "sliding" if sliding else "full", "window": sliding, "elements_per_token": per_token,
                     "key_shape": list(keys.shape), "value_shape": list(values.shape), "class": type(layer).__name__})
        window = window or sliding
    if len(rows) != n_layers:
        raise CardError(f"the cache has {len(rows)} layers for {n_layers} decoder layers (not modelled)")
    first = rows[0]
    kv_heads = first["key_shape"][1] if len(first["key_shape"]) == 4 else 1
    per = max(r["elements_per_token"] for r in rows)
    head_dim = per // (2 * kv_heads) if per % (2 * kv_heads) == 0 else per // 2
    kv_heads = kv_heads if per % (2 * kv_heads) == 0 else 1
    return {"layers": rows, "sliding_window": window, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "note": "elements per token of keys and values together; bytes = elements x the cache dtype"}


# ---- regimes -------------------------------------------------------------------------------------

def _workload(spec, regime: dict, seq: int):
    from estimator.workload import Workload

    lora = regime["method"] in ("lora", "qlora")
    w = Workload(model=spec, method=regime["method"], precision=regime["precision"], attn=regime["attn"],
                 batch=1, seq=seq, lora_rank=regime["lora_rank"] or 16,
                 lora_targets=tuple(regime["lora_targets"]) if lora else ("q_proj", "v_proj"),
                 quant=regime["quant"], grad_ckpt=regime["grad_ckpt"],
                 kbit_prep=("on" if regime["kbit_prep"] else "off") if regime["quant"] != "none" else "auto", liger=regime["liger"], loss=regime["loss"])
    return w


def _fit(ts, qs) -> list[float]:
    """Per-token coefficients [a, b] of q(T) = c + a T (+ b T^2): d(q)/dT per token is a + b T."""
    if len(ts) == 2:
        return [(qs[1] - qs[0]) / (ts[1] - ts[0]), 0.0]
    (t1, t2, t3), (q1, q2, q3) = ts, qs
    s12, s23 = (q2 - q1) / (t2 - t1), (q3 - q2) / (t3 - t2)
    b = (s23 - s12) / (t3 - t1)
    a = s12 - b * (t1 + t2)
    return [a, b]


def _work(measure, part: str) -> int:
    from profiler.trace.tracker import ACTIVATION, TEMP

    cats = measure.part_categories.get(part, {})
    return cats.get(ACTIVATION, 0) + cats.get(TEMP, 0)


def trace_regime(card: dict, path: str, regime: dict) -> dict:
    """The per-token terms of `regime` (estimator.cards.per_token reads them)."""
    from profiler.trace import layers as tl
    from profiler.trace.step import _trace_once
    from profiler.trace.tracker import ACTIVATION

    cfg = card["config"]
    spec = ec.spec_from_card(card, path, card["model_type"])
    seqs = SEQS_EAGER if regime["attn"] == "eager" else SEQS
    q = {k: [] for k in ("layer", "outside_and_loss_saved", "forward_minus_saved", "loss_backward_minus_saved",
                         "top_minus_saved")}
    for seq in seqs:
        w = _workload(spec, regime, seq).validate()
        kinds = list(dict.fromkeys(tl.layer_kinds(cfg, w)))
        counts = [len(kinds) * n for n in LAYERS]
        measures = []
        for n in LAYERS:
            try:
                measures.append(_trace_once(tl.reduced_config(cfg, kinds * n), w))
            except Exception as exc:  # noqa: BLE001
                raise CardError(f"tracing {regime['method']} on {len(kinds) * n} layers failed: {_first_line(exc)}") from None
        s1, s2 = (m.phase_start.get("backward", {}).get(ACTIVATION, 0) for m in measures)
        layer = (s2 - s1) / (counts[1] - counts[0])
        big = measures[1]
        q["layer"].append(layer)
        q["outside_and_loss_saved"].append(s2 - counts[1] * layer)
        q["forward_minus_saved"].append(_work(big, "forward/post") - s2)
        q["loss_backward_minus_saved"].append(_work(big, "backward/loss") - s2)
        q["top_minus_saved"].append(_work(big, "backward/top") - s2)
    per_token = {k: _fit(seqs, v) for k, v in q.items()}
    per_token["checkpoint"] = per_token["layer"]      # in a checkpointed regime the slope is the kept input
    return {"regime": regime, "per_token": per_token, "seqs": list(seqs), "layers_traced": list(LAYERS)}


def make(cfg: dict, out: Path, regimes: list[dict]) -> Path:
    """Write the card of `cfg` to `out` (kept when it exists for this config and transformers), with `regimes`."""
    card = None
    if out.is_file():
        try:
            card = ec.read_card(out)
        except InputError:
            card = None
        if card is not None and card.get("key") != ec.card_key(cfg, _tf_version()):
            card = None
    if card is None:
        card = structure(cfg)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out, card, indent=1)
    card = json.loads(json.dumps(card))
    added = False
    for regime in regimes:
        rid = ec.regime_id(regime)
        if rid not in card["regimes"]:
            card["regimes"][rid] = trace_regime(card, str(out), regime)
            added = True
    if added:
        atomic_write_json(out, card, indent=1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="profiler.cards", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a config.json")
    p.add_argument("--out", help="card path (default: the card cache, $GPU_BUDGET_CARD_DIR)")
    p.add_argument("--regime", action="append", default=[], help="a regime to trace, as JSON (estimator.cards.regime_of)")
    p.add_argument("--default-regimes", action="store_true", help="also trace full bf16 SDPA, checkpointing off and on")
    args = p.parse_args(argv)
    try:
        try:
            cfg = parse_json(Path(args.config).read_bytes(), args.config, "config")
        except OSError as exc:
            raise CardError(f"cannot read {args.config}: {exc.strerror}") from None
        if not isinstance(cfg, dict):
            raise CardError("a config must be a JSON object")
        regimes = [json.loads(r) for r in args.regime] + (DEFAULT_REGIMES if args.default_regimes else [])
        from estimator.progress import quiet_libraries

        with quiet_libraries():
            out = make(cfg, Path(args.out) if args.out else ec.cache_dir() / ec._file_name(cfg, _tf_version()), regimes)
    except (CardError, InputError, NotImplementedError) as exc:
        print(f"profiler.cards: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
