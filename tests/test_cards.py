"""Structure cards (issue 14 item 2): a model_type without a mapping is built once with transformers
(profiler/cards.py) and answered from a small JSON card, torch-free (estimator/cards.py).

The unmapped type is Persimmon (fused query_key_value, q/k LayerNorms, partial rotary, relu^2 MLP,
no mapping in estimator/model.py). Checked: the card's parameter count against transformers' own
meta build; the card's training peaks against the fake-tensor tracer on the whole model at a batch
and sequence the card was not traced at; the second answer reads the cache without importing
torch; unbuildable configs are one line and exit 2; the key follows the config. Cross-check on a
mapped model (Llama): the card path and the mapping agree on parameters and saved activations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.scripts_loader import call_main, load_script

from estimator import cards as ec
from estimator.activations import activation_key
from estimator.api import estimate
from estimator.configs import load_spec
from estimator.memory import saved_activation_bytes
from estimator.model import SUPPORTED_MODEL_TYPES, spec_from_config
from estimator.params import count_params
from estimator.states import lora_params
from estimator.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
CLI = load_script("estimate")
PERSIMMON = {"model_type": "persimmon", "vocab_size": 1024, "hidden_size": 128, "num_attention_heads": 4,
             "num_hidden_layers": 4, "intermediate_size": 512, "max_position_embeddings": 2048,
             "qk_layernorm": True, "partial_rotary_factor": 0.5, "tie_word_embeddings": False}
LLAMA = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1376,
         "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_act": "silu",
         "max_position_embeddings": 4096, "tie_word_embeddings": False}
GPU = "h100-80gb"


@pytest.fixture(scope="module")
def card_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cards")
    saved = os.environ.get(ec.ENV_DIR)
    os.environ[ec.ENV_DIR] = str(folder)
    yield folder
    if saved is None:
        os.environ.pop(ec.ENV_DIR, None)
    else:
        os.environ[ec.ENV_DIR] = saved


@pytest.fixture(scope="module")
def persimmon(card_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(PERSIMMON))
    return path


def _meta_param_count(cfg: dict) -> int:
    """transformers' own count: the model built on meta, each tensor once (tied weights once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(cfg)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_persimmon_is_unmapped():
    assert "persimmon" not in SUPPORTED_MODEL_TYPES


def test_unmapped_type_gets_a_card_and_says_structure_traced(persimmon, card_dir, capsys):
    spec = load_spec(str(persimmon))                       # builds the card in a subprocess
    assert list(card_dir.glob("persimmon-*.json")), "no card written"
    w = Workload(spec, method="full", batch=1, seq=256).validate()
    data = estimate(w, GPU, calibration="none").to_dict()
    assert data["model"]["structure"] == "traced"
    assert data["model"]["params_total"] == _meta_param_count(PERSIMMON)
    code, out, err = call_main(CLI, capsys, "--model", str(persimmon), "--method", "full", "--seq", "256")
    assert code == 0, err
    assert "structure traced" in out


def _trace_peak(w: Workload, cfg: dict) -> int:
    from profiler.trace.step import trace

    return trace(w, cfg).peak_allocated_bytes


@pytest.mark.parametrize("method,ckpt,targets", [("full", False, None), ("lora", True, ("all-linear",)),
                                                 ("lora", False, ("query_key_value", "dense"))])
def test_card_peak_matches_the_tracer(persimmon, method, ckpt, targets):
    """The card was traced on 2 and 3 layers at batch 1 x 128/256 tokens; the tracer runs the whole
    4-layer model at 2 x 384 tokens."""
    from profiler.cards import make

    spec = load_spec(str(persimmon))
    extra = {"lora_targets": targets} if targets else {}
    w = Workload(spec, method=method, grad_ckpt=ckpt, batch=2, seq=384, **extra).validate()
    make(PERSIMMON, Path(spec.card_path), [ec.regime_of(activation_key(w))])   # in-process: torch is loaded here
    # the tracer runs no cuBLAS: the estimate of a CPU trace leaves the workspaces out
    predicted = estimate(w, GPU, calibration="none", cpu_trace=True).raw_memory.peak_allocated_bytes
    traced = _trace_peak(w, PERSIMMON)
    assert abs(predicted - traced) / traced <= 0.03, (predicted, traced)


def test_lora_targets_count_as_peft_does(persimmon):
    """Trainable LoRA parameters on the card's module names equal peft's on the meta build."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = load_spec(str(persimmon))
    values = dict(PERSIMMON)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    for targets, peft_targets in ((("all-linear",), "all-linear"), ((r".*\.mlp\.dense_.*",), r".*\.mlp\.dense_.*"),
                                  (("dense",), ["dense"])):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        model = get_peft_model(model, LoraConfig(r=8, target_modules=peft_targets))
        expected = sum(p.numel() for p in model.parameters() if p.requires_grad)
        w = Workload(spec, method="lora", lora_rank=8, lora_targets=targets).validate()
        assert lora_params(w, count_params(spec)) == expected, targets


_PROBE = r"""
import json, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "peft"):
            raise ImportError(name + " is blocked")
sys.meta_path.insert(0, Refuse())
from estimator.api import estimate
from estimator.configs import load_spec
from estimator.workload import Workload
w = Workload(load_spec(sys.argv[1]), method="full", batch=1, seq=256).validate()
data = estimate(w, "h100-80gb", calibration="none").to_dict()
print(json.dumps({"structure": data["model"]["structure"], "params": data["model"]["params_total"],
                  "torch": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))}))
"""


def test_second_answer_reads_the_card_without_torch(persimmon, card_dir):
    load_spec(str(persimmon))
    Workload(load_spec(str(persimmon)), method="full", batch=1, seq=256).validate()
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{ec.ENV_DIR: str(card_dir)})
    done = subprocess.run([sys.executable, "-c", _PROBE, str(persimmon)], capture_output=True, text=True,
                          env=env, cwd=str(ROOT), timeout=60)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["structure"] == "traced" and answer["torch"] == []
    assert answer["params"] == _meta_param_count(PERSIMMON)


def test_bogus_model_type_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PERSIMMON, "model_type": "no_such_arch_at_all"}))
    code, out, err = call_main(CLI, capsys, "--model", str(path), "--method", "full")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("estimate.py: error: ") and "Traceback" not in err
    assert "no_such_arch_at_all" in err and "not supported" in err


def test_unbuildable_config_is_one_error_line_exit_2(tmp_path, capsys, card_dir):
    """A known model_type whose config transformers refuses (hidden size not divisible by the heads)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PERSIMMON, "hidden_size": 130}))
    code, out, err = call_main(CLI, capsys, "--model", str(path), "--method", "full")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("estimate.py: error: ")
    assert "cannot build" in err and "divisible" in err
    assert not list(card_dir.glob("*.json")) or all("hidden_size\": 130" not in p.read_text()
                                                     for p in card_dir.glob("*.json"))   # no card written


def test_changed_config_changes_the_key():
    changed = {**PERSIMMON, "intermediate_size": 768}
    assert ec.card_key(PERSIMMON, "5.23.0") != ec.card_key(changed, "5.23.0")
    assert ec.card_key(PERSIMMON, "5.23.0") != ec.card_key(PERSIMMON, "5.24.0")
    # keys transformers does not read do not change it
    assert ec.card_key(PERSIMMON, "5.23.0") == ec.card_key({**PERSIMMON, "_name_or_path": "x"}, "5.23.0")


def test_card_of_a_mapped_model_agrees_with_its_mapping(tmp_path):
    """Llama through the card path (never through its mapping) against the mapping."""
    from profiler.cards import make

    mapped = spec_from_config(LLAMA, "tiny-llama")
    workloads = [Workload(mapped, method=m, grad_ckpt=ck, batch=2, seq=384).validate()
                 for m in ("full", "lora") for ck in (False, True)]
    path = make(LLAMA, tmp_path / "llama.json", [ec.regime_of(activation_key(w)) for w in workloads])
    card = ec.spec_from_card(ec.read_card(path), str(path), "tiny-llama")
    assert count_params(card).total == count_params(mapped).total
    assert card.num_kv_heads == mapped.num_kv_heads and card.head_dim == mapped.head_dim
    for w in workloads:
        wc = replace(w, model=card).validate()
        a, b = saved_activation_bytes(w), saved_activation_bytes(wc)
        # checkpointed: the layers keep only their inputs, and the rest (the rotary cos/sin per
        # position, which the mapping leaves out and the card counts per token at batch 1) weighs more
        assert abs(b - a) / a <= (0.015 if w.grad_ckpt else 0.01), (w.method, w.grad_ckpt, a, b)
        pa = estimate(w, GPU, calibration="none").raw_memory.peak_allocated_bytes
        pb = estimate(wc, GPU, calibration="none").raw_memory.peak_allocated_bytes
        assert abs(pb - pa) / pa <= 0.01, (w.method, w.grad_ckpt, pa, pb)
