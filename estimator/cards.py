"""Structure cards: the model types without a mapping in estimator/model.py, read torch-free.

A card is a small JSON file that `profiler/cards.py` writes once per config (it builds the model
on the meta device with transformers and traces a few tiny steps on fake tensors): parameters by
role, every linear layer by name and shape, what each layer's KV cache holds per token, and per
training regime the saved-activation bytes per token the memory formulas need. The estimator
then answers from the card without importing torch; such answers say "structure traced" instead
of "mapped".

Where cards live: `$GPU_BUDGET_CARD_DIR` (default `~/.cache/gpu-budget/cards`, where new cards are
written) and `estimator/data/cards/` (committed). A card's file name is its key: the sha256 of the
canonical config JSON (the keys transformers builds from) and of the transformers version that
built it, so a changed config or another transformers gets another card.

A card without the regime a Workload asks for (a precision, kernel, method, LoRA targets or
checkpointing it was not traced in) gets that regime traced the same way, in a subprocess, and
added to the card. Without torch and transformers installed, a missing card or regime is one
clear error line.

The per-token numbers map onto estimator.memory's `_PerToken` terms exactly as the estimator's own
moments are defined (see `per_token`), so the rest of the assembly (model states, ZeRO, FSDP, the
optimizer, calibration) is the estimator's, unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from estimator.errors import InputError
from estimator.files import parse_json
from estimator.lora_targets import Site
from estimator.model import ModelSpec
from estimator.params import Linear, ParamCounts

CARD_SCHEMA = "gpu-budget-card/1"
ENV_DIR = "GPU_BUDGET_CARD_DIR"
COMMITTED_DIR = Path(__file__).with_name("data") / "cards"
ROOT = Path(__file__).resolve().parents[1]
# what profiler.build.hf_config drops before transformers builds the config (not read)
_UNREAD_KEYS = ("architectures", "auto_map", "quantization_config", "_name_or_path", "transformers_version")
BUILD_TIMEOUT_S = 900


def cache_dir() -> Path:
    """Where new cards are written (and looked up first)."""
    given = os.environ.get(ENV_DIR)
    return Path(given) if given else Path.home() / ".cache" / "gpu-budget" / "cards"


def transformers_version() -> str | None:
    """The installed transformers' version, read from its metadata (no import), or None."""
    from estimator.versions import package_version

    return package_version("transformers")


def canonical_config(cfg: dict) -> str:
    """The config as transformers reads it, in one canonical JSON text."""
    kept = {k: v for k, v in cfg.items() if k not in _UNREAD_KEYS}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def config_sha(cfg: dict) -> str:
    return hashlib.sha256(canonical_config(cfg).encode()).hexdigest()


def card_key(cfg: dict, version: str | None = None) -> str:
    """The card's key: sha256 of the canonical config and the transformers version (hex, 24 digits)."""
    version = version or transformers_version() or "none"
    text = canonical_config(cfg) + "\ntransformers=" + version
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _file_name(cfg: dict, version: str) -> str:
    return f"{cfg.get('model_type', 'model')}-{card_key(cfg, version)}.json"


def find_card(cfg: dict) -> Path | None:
    """The card of `cfg` for the installed transformers (the cache first, then the committed cards);
    without transformers, a card of this config made by any version (the newest file)."""
    version = transformers_version()
    folders = [cache_dir(), COMMITTED_DIR]
    if version is not None:
        for folder in folders:
            path = folder / _file_name(cfg, version)
            if path.is_file():
                return path
        return None
    sha = config_sha(cfg)
    found = [p for folder in folders if folder.is_dir() for p in folder.glob(f"{cfg.get('model_type', 'model')}-*.json")
             if _read(str(p), p.stat().st_mtime_ns).get("config_sha256") == sha]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


@lru_cache(maxsize=64)
def _read(path: str, mtime_ns: int) -> dict:
    """A card file, parsed and checked (memoised on its path and modification time)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read structure card {path}: {exc.strerror}") from None
    card = parse_json(raw, path, "structure card")
    if not isinstance(card, dict) or card.get("schema") != CARD_SCHEMA:
        raise InputError(f"{path} is not a structure card ({CARD_SCHEMA})")
    for key in ("params", "linears", "kv", "num_layers", "hidden_size", "vocab_size"):
        if key not in card:
            raise InputError(f"structure card {path} lacks '{key}'")
    return card


def read_card(path: str | Path) -> dict:
    p = Path(path)
    try:
        mtime = p.stat().st_mtime_ns
    except OSError as exc:
        raise InputError(f"cannot read structure card {p}: {exc.strerror}") from None
    return _read(str(p), mtime)


def _torch_missing() -> str | None:
    for name in ("torch", "transformers"):
        if importlib.util.find_spec(name) is None:
            return name
    return None


def build(cfg: dict, regimes: list[dict] | None = None, path: Path | None = None) -> Path:
    """Make (or extend with `regimes`) the card of `cfg` in a subprocess that has torch
    (`python -m profiler.cards`); InputError with its one line when it cannot."""
    from estimator.progress import after

    missing = _torch_missing()
    mt = cfg.get("model_type")
    if missing:
        raise InputError(f"model_type {mt!r} has no mapping and no structure card here; tracing its structure "
                         f"needs torch and transformers ({missing} is not installed)")
    out = path or cache_dir() / _file_name(cfg, transformers_version() or "none")
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(cfg))
        cmd = [sys.executable, "-m", "profiler.cards", str(cfg_path), "--out", str(out)]
        for regime in regimes or []:
            cmd += ["--regime", json.dumps(regime, sort_keys=True)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        what = f"regime {regimes[0]['method']}" if regimes else "structure"
        # the progress line is for a person at a terminal: a refusal elsewhere stays one line
        message = f"tracing the {what} of model_type {mt!r} with transformers (once; cached in {out.parent})"
        with (after(2.0, message) if sys.stderr.isatty() else contextlib.nullcontext()):
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT),
                                      timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise InputError(f"tracing the structure of model_type {mt!r} took over {BUILD_TIMEOUT_S} s") from None
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr or "").splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit code {done.returncode}"
        why = why.removeprefix("profiler.cards: error: ")
        raise InputError(f"model_type {mt!r} has no mapping, and transformers {transformers_version()} cannot "
                         f"build or trace this config: {why}"[:400])
    return out


@dataclass(frozen=True)
class TracedSpec(ModelSpec):
    """A ModelSpec whose structure comes from a card (`card_path`), not from a mapping. The fields
    of ModelSpec hold what the card read off the built model (layer count, widths, heads, cache
    shape) for the formulas that still read them (FLOPs, KV cache, the lm_head and logits)."""

    card_path: str = ""

    def __hash__(self) -> int:
        return hash((self.name, self.card_path))

    @property
    def structure(self) -> str:
        return "traced"


def structure_of(spec: ModelSpec) -> str:
    """"traced" (from a card) or "mapped" (estimator/model.py)."""
    return getattr(spec, "structure", "mapped")


@lru_cache(maxsize=1)
def causal_lm_types() -> frozenset | None:
    """The model_types transformers builds a causal LM for (its MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
    read from the installed package's source text without importing it; None without transformers."""
    import re

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.origin:
        return None
    source = Path(spec.origin).parent / "models" / "auto" / "modeling_auto.py"
    try:
        text = source.read_text(encoding="utf-8")
    except OSError:
        return None
    start = text.find("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = OrderedDict(")
    end = text.find("\n)\n", start)
    if start < 0 or end < 0:
        return None
    return frozenset(re.findall(r'\(\s*"([^"]+)",\s*"[A-Za-z0-9_]+"\s*\)', text[start:end]))


def traced_spec(cfg: dict, name: str, supported: tuple[str, ...] = ()) -> TracedSpec:
    """The spec of a config whose model_type has no mapping: from its card, made when missing.
    A model_type transformers has no causal LM for is refused at once (no subprocess)."""
    mt = cfg.get("model_type")
    path = find_card(cfg)
    if path is None:
        known = causal_lm_types()
        if known is not None and mt not in known:
            raise InputError(f"model_type {mt!r} is not supported: no mapping here and transformers "
                             f"{transformers_version()} has no causal LM for it; mapped: {', '.join(supported)}")
        path = build(cfg)
    return spec_from_card(read_card(path), str(path), name)


def spec_from_card(card: dict, path: str, name: str = "") -> TracedSpec:
    s = card["spec"]
    try:
        return TracedSpec(
            name=name or card["model_type"], model_type=card["model_type"], vocab_size=int(card["vocab_size"]),
            hidden_size=int(card["hidden_size"]), num_layers=int(card["num_layers"]), num_heads=int(s["num_heads"]),
            num_kv_heads=int(s["num_kv_heads"]), head_dim=int(s["head_dim"]),
            intermediate_size=int(s["intermediate_size"]), mlp_gated=bool(s["mlp_gated"]),
            activation=str(s["activation"]), norm=str(s["norm"]), norms_per_layer=int(s["norms_per_layer"]),
            qk_norm=False, qkv_bias=False, o_bias=False, mlp_bias=False,
            lm_head_bias=bool(card["params"]["lm_head_bias"]), tied_embeddings=bool(card["params"]["tied"]),
            learned_positions=int(s["learned_positions"]), embed_dim=int(s["embed_dim"]), embed_norm=False,
            final_norm=True, parallel_block=False,
            layer_types=tuple(layer["kind"] for layer in card["kv"]["layers"]) or ("full",) * int(card["num_layers"]),
            sliding_window=card["kv"].get("sliding_window"),
            max_position_embeddings=int(s.get("max_position_embeddings") or 0),
            card_path=path)
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"structure card {path} is malformed: {type(exc).__name__}: {exc}") from None


def card_of(spec: ModelSpec) -> dict:
    return read_card(spec.card_path)


# ---- parameters and LoRA sites ------------------------------------------------------------------

def card_params(spec: TracedSpec):
    """estimator.params.ParamCounts from the card (exact: counted on the meta build)."""
    card = card_of(spec)
    p = card["params"]
    counts: dict[tuple, int] = {}
    for lin in _all_linears(card):
        key = (lin["role"], lin["d_in"], lin["d_out"], lin["bias"])
        counts[key] = counts.get(key, 0) + 1
    linears = tuple(Linear(role, d_in, d_out, n, bias) for (role, d_in, d_out, bias), n in counts.items())
    return CardParamCounts(
        embedding=p["embedding"], positions=p["positions"], lm_head=p["lm_head"], lm_head_bias=p["lm_head_bias"],
        norms=p["other"], router=0, linears=linears, largest_layer=p["largest_tensor"],
        active_expert_fraction=1.0, attention_elements=p["attention_linear_weights"])


def _all_linears(card: dict):
    """Every linear of the model but the output head: {name, role, d_in, d_out, bias, block}."""
    prefix = card["layer_prefix"]
    structures = card["linears"]["layer_structures"]
    for i, which in enumerate(card["linears"]["layer_structure_of"]):
        for lin in structures[which]:
            yield dict(lin, name=prefix.format(i) + lin["name"], role=lin["name"])
    for lin in card["linears"]["outside"]:
        yield dict(lin, role=lin["name"])


def card_sites(spec: TracedSpec):
    """estimator.lora_targets.Site of every linear by its full module name, then the input
    embedding and the output head: peft's matching (names, regex, all-linear) runs on them as is."""
    card = card_of(spec)
    out = [Site(lin["name"], lin["d_in"], lin["d_out"], (lin["name"].rpartition(".")[2],), "linear")
           for lin in _all_linears(card)]
    emb = card["embedding_module"]
    out.append(Site(emb, spec.vocab_size, spec.embed_dim, ("embed",), "embedding"))
    out.append(Site(card["head_module"], spec.embed_dim, spec.vocab_size, ("lm_head",), "head"))
    return tuple(out)


@dataclass(frozen=True)
class CardParamCounts(ParamCounts):
    """ParamCounts whose attention weights are the linears found inside the layers' attention modules."""

    attention_elements: int = 0

    @property
    def attention_weights(self) -> int:
        return self.attention_elements


# ---- activations per regime ---------------------------------------------------------------------

def regime_of(key) -> dict:
    """The traced regime an estimator.activations.ActivationKey needs (what a single-process step
    of the card's model must be built with to save what `key` describes)."""
    return {"method": key.method, "precision": key.precision, "attn": key.attn,
            "lora_targets": list(key.lora_targets) if key.method in ("lora", "qlora") else [],
            "lora_rank": key.lora_rank if key.method in ("lora", "qlora") else 0,
            "quant": key.quant, "grad_ckpt": bool(key.grad_ckpt), "kbit_prep": bool(key.kbit_prep),
            "liger": bool(key.liger), "loss": key.loss}


def regime_id(regime: dict) -> str:
    return hashlib.sha256(json.dumps(regime, sort_keys=True).encode()).hexdigest()[:16]


def regime_entry(spec: TracedSpec, regime: dict) -> dict:
    """The card's traced numbers of `regime`, traced now (and added to the card) when missing."""
    rid = regime_id(regime)
    card = card_of(spec)
    entry = card.get("regimes", {}).get(rid)
    if entry is None:
        build(card["config"], [regime], Path(spec.card_path))
        entry = card_of(spec).get("regimes", {}).get(rid)
        if entry is None:
            raise InputError(f"structure card {spec.card_path} did not get regime {regime}")
    return entry


def per_token(key) -> tuple[int, int, int, int, int, int, int]:
    """(layer, checkpoint, outside, top, logits_saved, logits_forward, logits_backward) bytes per token
    at `key.seq`: estimator.memory._PerToken's terms, from the traced regime.

    The card holds, per regime, each term as `a + b x seq` bytes per token, fitted on traces of
    2- and 3-layer models at two sequence lengths (three with eager attention, whose scores grow
    with the sequence): per-token slopes, so what does not grow with tokens (weight casts under
    autocast, counted apart by the estimator) stays out. The split between `outside` and the
    loss's saved log-softmax uses the estimator's formula for the latter (vocab x 4 B with the HF
    loss); only the split between those two components depends on it, never the peaks."""
    from estimator import activations as act

    entry = regime_entry(key.model, regime_of(key))
    seq = key.seq

    def at(name: str) -> float:
        a, b = entry["per_token"][name]
        return a + b * seq

    saved = act.logits_saved_per_token(key)
    outside = at("outside_and_loss_saved") - saved
    layer = at("layer")
    checkpoint = at("checkpoint") if key.grad_ckpt else act.checkpoint_bytes_per_token(key)
    if key.grad_ckpt:
        top = at("top_minus_saved") + saved + outside
        layer = top                  # the recomputed layer: only the components' split reads it
    else:
        top = at("top_minus_saved") + saved + outside + layer
    forward = at("forward_minus_saved") + saved
    backward = at("loss_backward_minus_saved") + saved
    return tuple(int(round(v)) for v in (layer, checkpoint, outside, top, saved, forward, backward))


def describe(card: dict, path: str) -> str:
    """One line for the text output."""
    return (f"structure traced (no mapping for model_type {card['model_type']!r}): card {path}, built with "
            f"transformers {card.get('transformers')}")
