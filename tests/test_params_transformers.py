"""Parameter counts of `estimator.params.count_params` against transformers 5.23 itself.

Golden source: the model transformers builds from the same config.json on the meta device
(no memory, no download), parameters counted once (tied embeddings shared):

    cfg = AutoConfig.for_model(**config_json)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    m.tie_weights()

Three layers of evidence:
- every catalog entry against tests/data/catalog_param_counts.csv (computed earlier with exactly
  that recipe; it also holds published counts with their sources);
- every catalog entry built live at full size (a meta build takes well under a second), so a
  change of transformers or of a catalog file is caught here and not only in the stored table;
- structural variants with fewer layers (MoE dense layers, sparse steps) built live for both
  transformers and our counter, to test the per-layer rules the catalog does not exercise.
"""

import copy
import csv
import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from estimator.configs import CATALOG_DIR, load_spec
from estimator.model import spec_from_config
from estimator.params import count_params

transformers.logging.set_verbosity_error()

TABLE_PATH = Path(__file__).with_name("data") / "catalog_param_counts.csv"


def _catalog_rows() -> list[dict]:
    with (CATALOG_DIR / "index.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def _table() -> dict[str, dict]:
    with TABLE_PATH.open(newline="") as f:
        return {row["hub_id"]: row for row in csv.DictReader(f)}


CATALOG = _catalog_rows()
TABLE = _table()
HUB_IDS = [row["hub_id"] for row in CATALOG]


def _raw_config(hub_id: str) -> dict:
    row = next(r for r in CATALOG if r["hub_id"] == hub_id)
    with (CATALOG_DIR / row["file"]).open() as f:
        return json.load(f)


def _build_meta(cfg_dict: dict):
    cfg = AutoConfig.for_model(**copy.deepcopy(cfg_dict))
    # vision-language models (language model + vision tower) build through their own auto class
    auto = AutoModelForImageTextToText if "vision_config" in cfg_dict else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(cfg)
    model.tie_weights()
    return model


@lru_cache(maxsize=None)
def _hf_counts(cfg_json: str) -> dict:
    """Counts read off the transformers model (the golden values)."""
    model = _build_meta(json.loads(cfg_json))
    params = list(model.parameters())  # shared (tied) tensors appear once
    inp = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is inp
    positions = sum(p.numel() for n, p in model.named_parameters()
                    if n.endswith(("wpe.weight", "embed_positions.weight")))
    # DeepSpeed's definition of the largest layer (stage3.model_to_params): the most parameters
    # held directly by one module.
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    experts = sum(p.numel() for n, m in model.named_modules() if n.endswith(".experts")
                  for p in m.parameters())
    return {
        "total": sum(p.numel() for p in params),
        "embedding": inp.numel(),
        "lm_head": 0 if tied else out.weight.numel(),
        "positions": positions,
        "largest": largest,
        "experts": experts,
        "layers": len(model.model.layers) if hasattr(model, "model") and hasattr(model.model, "layers") else None,
    }


def hf_counts(cfg_dict: dict) -> dict:
    return _hf_counts(json.dumps(cfg_dict, sort_keys=True))


# --- stored table: every catalog entry -------------------------------------------------------

def test_table_covers_every_catalog_entry():
    assert sorted(TABLE) == sorted(HUB_IDS)


@pytest.mark.parametrize("hub_id", HUB_IDS)
def test_counts_equal_stored_transformers_table(hub_id):
    row = TABLE[hub_id]
    p = count_params(load_spec(hub_id))
    assert p.total == int(row["params_total"])
    assert p.embedding == int(row["params_embedding"])
    assert p.lm_head == int(row["params_lm_head_untied"])  # 0 when tied
    assert (p.lm_head == 0) == (row["tied_embeddings"] == "True")


# --- live builds at full size: every catalog entry -------------------------------------------

@pytest.mark.parametrize("hub_id", HUB_IDS)
def test_counts_equal_live_transformers_model(hub_id):
    cfg = _raw_config(hub_id)
    hf = hf_counts(cfg)
    p = count_params(spec_from_config(cfg, hub_id))
    assert p.total == hf["total"]
    assert p.embedding == hf["embedding"]
    assert p.lm_head == hf["lm_head"]
    assert p.positions == hf["positions"]
    assert p.largest_layer == hf["largest"]


def test_live_build_agrees_with_stored_table_for_one_model():
    # Guards the stored table itself: it must still be what transformers builds.
    hub_id = "meta-llama/Llama-2-7b-hf"
    assert hf_counts(_raw_config(hub_id))["total"] == int(TABLE[hub_id]["params_total"])


# --- structural variants with fewer layers ---------------------------------------------------

def _shrunk(hub_id: str, layers: int, **changes) -> dict:
    """A copy of a catalog config with `layers` decoder layers (layer_types and mlp_only_layers
    cut to match), then `changes` applied. Used for BOTH transformers and our counter."""
    cfg = copy.deepcopy(_raw_config(hub_id))
    key = "n_layer" if "n_layer" in cfg else "num_hidden_layers"
    cfg[key] = layers
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    if cfg.get("mlp_only_layers"):
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < layers]
    cfg.update(changes)
    return cfg


VARIANTS = {
    # Qwen-MoE: dense MLP layers listed in mlp_only_layers, and MoE only every k-th layer.
    "qwen2_moe-dense-layer-0": ("Qwen/Qwen1.5-MoE-A2.7B", 4, {"mlp_only_layers": [0]}),
    "qwen2_moe-sparse-step-2": ("Qwen/Qwen1.5-MoE-A2.7B", 4, {"decoder_sparse_step": 2}),
    "qwen3_moe-dense-layer-1": ("Qwen/Qwen3-30B-A3B", 3, {"mlp_only_layers": [1]}),
    "qwen3_moe-sparse-step-2": ("Qwen/Qwen3-30B-A3B", 4, {"decoder_sparse_step": 2}),
    "mixtral-2-layers": ("mistralai/Mixtral-8x7B-v0.1", 2, {}),
    # gemma-3: one full 5-sliding + 1-global period plus one more layer.
    "gemma3-7-layers": ("google/gemma-3-4b-pt", 7, {}),
    "gemma2-3-layers": ("google/gemma-2-9b", 3, {}),
    # Falcon new decoder architecture (40b: GQA, two layer norms in parallel attention).
    "falcon-40b-2-layers": ("tiiuae/falcon-40b", 2, {}),
    "opt-350m-2-layers": ("facebook/opt-350m", 2, {}),
    "phi-2-untied-bias-head": ("microsoft/phi-2", 2, {}),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_counts_equal_transformers_on_structural_variants(name):
    hub_id, layers, changes = VARIANTS[name]
    cfg = _shrunk(hub_id, layers, **changes)
    hf = hf_counts(cfg)
    assert hf["layers"] in (None, layers)
    p = count_params(spec_from_config(cfg, name))
    assert p.total == hf["total"]
    assert p.embedding == hf["embedding"]
    assert p.lm_head == hf["lm_head"]
    assert p.largest_layer == hf["largest"]


def test_dense_layer_variant_changes_the_count():
    # The variants above must exercise a different structure, not the same numbers twice.
    base = hf_counts(_shrunk("Qwen/Qwen1.5-MoE-A2.7B", 4))
    dense = hf_counts(_shrunk("Qwen/Qwen1.5-MoE-A2.7B", 4, mlp_only_layers=[0]))
    assert dense["total"] < base["total"]
    assert dense["experts"] < base["experts"]


# --- MoE active parameters ----------------------------------------------------------------------

MOE = ["mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen1.5-MoE-A2.7B", "Qwen/Qwen3-235B-A22B",
       "deepseek-ai/DeepSeek-V3", "moonshotai/Kimi-K2-Instruct", "meta-llama/Llama-4-Scout-17B-16E"]
# Cards that quote active parameters without the input embedding (gpt-oss's card says so; the
# DeepSeek-V2-Lite figure matches only so) or without both embedding and unembedding (GLM-4.5).
ACTIVE_EXCLUDES = {"openai/gpt-oss-120b": ("embedding",), "openai/gpt-oss-20b": ("embedding",),
                   "deepseek-ai/DeepSeek-V2-Lite": ("embedding",),
                   "zai-org/GLM-4.5": ("embedding", "lm_head"), "zai-org/GLM-4.5-Air": ("embedding", "lm_head")}
MOE_ACTIVE_WITHOUT_EMBEDDINGS = sorted(ACTIVE_EXCLUDES)


@pytest.mark.parametrize("hub_id", MOE)
def test_moe_active_params_match_published(hub_id):
    # Published: Mixtral 12.9B per token (mistral.ai/news/mixtral-of-experts), Qwen3-30B-A3B 3.3B
    # activated, Qwen1.5-MoE-A2.7B 2.7B activated (model cards); the table keeps the source.
    # Published figures are rounded to 2-3 digits: 3 % tolerance.
    published = float(TABLE[hub_id]["published_active"])
    active = count_params(load_spec(hub_id)).active
    assert active == pytest.approx(published, rel=0.03)


@pytest.mark.parametrize("hub_id", MOE_ACTIVE_WITHOUT_EMBEDDINGS)
def test_moe_active_params_without_embeddings_match_published(hub_id):
    published = float(TABLE[hub_id]["published_active"])
    p = count_params(load_spec(hub_id))
    excluded = sum(getattr(p, part) for part in ACTIVE_EXCLUDES[hub_id])
    assert p.active - excluded == pytest.approx(published, rel=0.03)


@pytest.mark.parametrize("hub_id", MOE + MOE_ACTIVE_WITHOUT_EMBEDDINGS)
def test_moe_active_params_exact_from_transformers_experts(hub_id):
    # Exact figure from the transformers model: everything but the routed experts, plus k/E of
    # the routed experts (the fused `.experts` modules; Qwen1.5's shared expert is separate and
    # always active).
    cfg = _raw_config(hub_id)
    hf = hf_counts(cfg)
    k = cfg["num_experts_per_tok"]
    e = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg["num_experts"]
    assert hf["experts"] % e == 0
    expected = hf["total"] - hf["experts"] + hf["experts"] // e * k
    assert count_params(spec_from_config(cfg, hub_id)).active == expected


def test_dense_active_equals_total():
    p = count_params(load_spec("meta-llama/Llama-2-7b-hf"))
    assert p.active == p.total == int(TABLE["meta-llama/Llama-2-7b-hf"]["params_total"])
