"""Workload: stable id, hashability, and validate() rejecting every impossible combination."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import pytest

from estimator.errors import InputError
from estimator.model import spec_from_config
from estimator.workload import Workload

CFG = json.loads((Path(__file__).with_name("data") / "tiny-llama.json").read_text())
TINY = spec_from_config(CFG, "tiny")                  # 4 heads, 2 kv heads, 2 layers
OTHER = spec_from_config(CFG, "tiny-other")           # same architecture, other name

# One non-default value per field (validity does not matter for the id).
CHANGES = {
    "model": OTHER, "method": "lora", "precision": "fp32", "optimizer": "sgd", "adamw_impl": "foreach",
    "batch": 2, "seq": 1024, "new_tokens": 5, "grad_accum": 4, "lora_rank": 8,
    "lora_targets": ("q_proj", "k_proj"), "dora": True, "lora_dropout": True, "grad_ckpt": True, "attn": "eager", "quant": "int8",
    "double_quant": False, "gpus": 2, "nodes": 2, "zero": 2, "offload": "optimizer", "tp": 2, "pp": 2, "ep": 2,
    "fsdp": "full", "kbit_prep": "off", "liger": True, "train_vision": True, "activation_offload": True, "fp8_backend": "te",
    "compiled": True,
    "loss": "model-dtype", "padding_mask": True, "trainable_dtype": "model",
}


def test_every_field_has_a_change_listed():
    # a new Workload field must be added here (and to the id checks below)
    assert set(CHANGES) == {f.name for f in fields(Workload)}


def test_id_format_is_stable():
    # documented rule: model name and an 8-hex architecture fingerprint, then every field that
    # differs from its default, in field order
    w = Workload(model=TINY, method="lora", batch=4, lora_targets=("q_proj", "k_proj", "v_proj"), grad_ckpt=True)
    head, rest = w.id.split("|", 1)
    assert rest == "method=lora|batch=4|lora_targets=q_proj,k_proj,v_proj|grad_ckpt=True"
    name, fingerprint = head.split("#")
    assert name == "tiny" and len(fingerprint) == 8 and int(fingerprint, 16) >= 0
    assert Workload(model=TINY).id == head
    # equal workloads built separately give the same id
    again = Workload(model=spec_from_config(dict(CFG), "tiny"), method="lora", batch=4,
                     lora_targets=("q_proj", "k_proj", "v_proj"), grad_ckpt=True)
    assert again.id == w.id


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_id_differs_when_a_field_differs(name):
    base = Workload(model=TINY)
    changed = replace(base, **{name: CHANGES[name]})
    assert changed.id != base.id
    assert changed != base


def test_id_differs_for_different_architectures_with_the_same_name():
    """The id is the key under which results are stored and compared; two different models must
    not share it. Local configs are named after their folder (configs.load_config), so
    runs/a/checkpoint-500/config.json and runs/b/checkpoint-500/config.json are both
    'checkpoint-500'. Here: same name 'tiny', hidden size 64 vs 128."""
    wide = spec_from_config({**CFG, "hidden_size": 128}, "tiny")
    assert wide != TINY
    assert Workload(model=wide).id != Workload(model=TINY).id


def test_hashable_and_usable_as_key():
    a = Workload(model=TINY, batch=2)
    b = Workload(model=spec_from_config(dict(CFG), "tiny"), batch=2)
    c = Workload(model=TINY, batch=3)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, c}) == 2
    table = {a: "x"}
    assert table[b] == "x"


def test_frozen():
    w = Workload(model=TINY)
    with pytest.raises(AttributeError):
        w.batch = 4  # type: ignore[misc]


def test_with_validates():
    w = Workload(model=TINY)
    assert w.with_(batch=8).batch == 8
    with pytest.raises(InputError):
        w.with_(batch=0)


VALID = [
    dict(),
    dict(method="lora", quant="int8"),
    dict(method="qlora", quant="nf4"),
    dict(method="qlora", quant="fp4", precision="amp-bf16"),
    dict(method="inference", new_tokens=16, quant="nf4", tp=2, gpus=2),
    dict(zero=1, offload="optimizer", gpus=2),
    dict(zero=3, offload="optimizer+params", gpus=8),
    dict(tp=4, gpus=4),                      # 4 heads; 2 kv heads replicated over 4 ranks
    dict(pp=2, gpus=2),
    dict(attn="flash", precision="amp-fp16"),
    dict(attn="eager", precision="fp32"),
    dict(method="inference", new_tokens=0),
]


@pytest.mark.parametrize("kw", VALID, ids=[str(k) for k in VALID])
def test_valid_workloads_pass(kw):
    w = Workload(model=TINY, **kw)
    assert w.validate() is w


INVALID = {
    # _check_choices
    "method": dict(method="pretrain"),
    "precision": dict(precision="fp6"),
    "optimizer": dict(optimizer="lion"),
    "adamw_impl": dict(adamw_impl="apex"),
    "attn": dict(attn="xformers"),
    "quant": dict(method="lora", quant="awq"),
    "offload": dict(zero=3, offload="nvme"),
    "zero": dict(zero=4),
    "lora target unknown": dict(method="lora", lora_targets=("bogus",)),
    "lora targets empty": dict(method="lora", lora_targets=()),
    # _check_sizes
    "batch 0": dict(batch=0),
    "batch negative": dict(batch=-1),
    "batch float": dict(batch=1.5),
    "batch bool": dict(batch=True),
    "seq 0": dict(seq=0),
    "seq negative": dict(seq=-5),
    "grad_accum 0": dict(grad_accum=0),
    "lora_rank 0": dict(method="lora", lora_rank=0),
    "gpus 0": dict(gpus=0),
    "nodes 0": dict(nodes=0),
    "tp 0": dict(tp=0),
    "pp 0": dict(pp=0),
    "new_tokens negative": dict(method="inference", new_tokens=-1),
    "new_tokens float": dict(method="inference", new_tokens=2.5),
    # _check_method
    "qlora without 4-bit quant": dict(method="qlora"),
    "qlora with int8": dict(method="qlora", quant="int8"),
    "qlora fp32": dict(method="qlora", quant="nf4", precision="fp32"),
    "full on quantized weights": dict(method="full", quant="int8"),
    "lora on 4-bit is qlora": dict(method="lora", quant="nf4"),
    "lora on fp4 is qlora": dict(method="lora", quant="fp4"),
    "inference with zero": dict(method="inference", zero=1, gpus=2),
    "inference with offload": dict(method="inference", zero=0, offload="optimizer"),
    "new tokens in training": dict(method="full", new_tokens=8),
    "flash in fp32": dict(attn="flash", precision="fp32"),
    "quantized inference in fp32": dict(method="inference", quant="int8", precision="fp32"),
    # _check_parallel
    "tp x pp does not divide gpus": dict(tp=2, gpus=3),
    "tp does not divide heads": dict(tp=3, gpus=3),
    "pp exceeds layers": dict(pp=4, gpus=4),
    "offload without zero": dict(offload="optimizer"),
    "param offload below stage 3": dict(zero=2, offload="optimizer+params", gpus=2),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_validate_rejects(case):
    with pytest.raises(InputError) as info:
        Workload(model=TINY, **INVALID[case]).validate()
    message = str(info.value)
    assert message and "\n" not in message  # one line a user can act on


def test_tp_must_fit_kv_heads():
    # 12 heads, 3 kv heads: tp=4 divides the heads but neither divides nor is a multiple of 3 kv heads
    spec = spec_from_config({**CFG, "hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 3}, "t")
    with pytest.raises(InputError):
        Workload(model=spec, tp=4, gpus=4).validate()
    assert Workload(model=spec, tp=3, gpus=3).validate().tp == 3


@pytest.mark.parametrize("model", ["gemma-2-2b", "bloomz-7b1"])
def test_models_without_sdpa_refuse_it_and_default_to_eager(model):
    """transformers 5.23 builds Gemma-2 (`_supports_sdpa = False`: SDPA cannot soft-cap) and BLOOM
    (never declared) without SDPA: asking for it is refused in one line; a sweep case or an imported
    row that does not state its attention gets eager, as transformers loads them."""
    from estimator.configs import load_spec
    from estimator.errors import InputError
    from profiler.case import Case

    with pytest.raises(InputError, match="no SDPA attention"):
        Workload(load_spec(model), method="lora").validate()
    assert Case(model, dict(method="lora")).workload().attn == "eager"
    assert Case(model, dict(method="lora", attn="flash")).workload().attn == "flash"
