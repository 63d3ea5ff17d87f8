"""Exact parameter counts of the newer families against transformers 5.23 meta-device builds of
tiny configs (tests/arch_configs.py): total, embedding, lm_head, the routed experts (active
parameters), the largest module (DeepSpeed's definition) and every linear by its own name."""

import copy
import re

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from estimator.model import spec_from_config
from estimator.params import count_params
from tests.arch_configs import TINY

transformers.logging.set_verbosity_error()


def _build(cfg: dict):
    config = AutoConfig.for_model(**copy.deepcopy(cfg))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    return model


@pytest.fixture(scope="module", params=sorted(TINY))
def built(request):
    cfg = TINY[request.param]
    return cfg, _build(cfg), count_params(spec_from_config(cfg, request.param))


def test_total_embedding_head(built):
    cfg, model, p = built
    assert p.total == sum(t.numel() for t in model.parameters())
    assert p.embedding == model.get_input_embeddings().weight.numel()
    out = model.get_output_embeddings()
    tied = out.weight is model.get_input_embeddings().weight
    assert p.lm_head == (0 if tied else out.weight.numel())
    assert p.lm_head_bias == (out.bias.numel() if out.bias is not None else 0)


def test_active_params_from_routed_experts(built):
    # Active = everything but the routed experts, plus k/E of them (shared experts always run).
    cfg, model, p = built
    experts = sum(t.numel() for n, m in model.named_modules() if n.endswith(".experts") for t in m.parameters())
    spec = spec_from_config(cfg)
    if not spec.is_moe:
        assert experts == 0 and p.active == p.total
        return
    assert experts == p.expert_weights + sum(lin.bias_params for lin in p.linears if lin.expert)
    expected = p.total - experts + experts // spec.num_experts * spec.experts_per_token
    assert p.active == expected


def test_largest_module(built):
    cfg, model, p = built
    largest = max(sum(t.numel() for t in m.parameters(recurse=False)) for m in model.modules())
    assert p.largest_layer == largest


def test_linears_by_their_own_names(built):
    # Every nn.Linear of the decoder layers, by its leaf name, with its shape and bias: the LoRA
    # targets the estimator knows are the model's own module names.
    cfg, model, p = built
    found = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and (".layers." in name or ".h." in name) and ".experts" not in name \
                and not name.endswith((".gate", ".router", ".shared_expert_gate")):   # counted as routers
            role = name.rpartition(".")[2]
            key = (role, mod.in_features, mod.out_features, mod.bias is not None)
            found[key] = found.get(key, 0) + 1
    ours = {}
    renamed = _OWN_NAMES.get(cfg["model_type"], {})
    for lin in p.linears:
        if lin.expert:
            continue
        role, d_out = renamed.get(lin.role, lin.role), lin.d_out
        if role == "gate_up_proj":      # one fused linear (GLM): counted once at twice the width
            if lin.role == "up_proj":
                continue
            d_out *= 2
        key = (role, lin.d_in, d_out, lin.bias)
        ours[key] = ours.get(key, 0) + lin.count
    assert ours == found


# the estimator's roles under each family's own module names (transformers 5.23 modeling code)
_OWN_NAMES = {"starcoder2": {"up_proj": "c_fc", "down_proj": "c_proj"},
              "gptj": {"o_proj": "out_proj", "up_proj": "fc_in", "down_proj": "fc_out"},
              "glm": {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"},
              "glm4": {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}}


def test_mla_roles_are_the_modules_names():
    spec = spec_from_config(TINY["deepseek_v3"])
    roles = {lin.role for lin in count_params(spec).linears if not lin.expert}
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} <= roles
    assert "q_proj" not in roles and "k_proj" not in roles
    lite = {lin.role for lin in count_params(spec_from_config(TINY["deepseek_v2-lite"])).linears}
    assert "q_proj" in lite and "q_a_proj" not in lite


def test_moe_layers_follow_the_config():
    ds = spec_from_config(TINY["deepseek_v3"])
    assert ds.moe_layer_flags == (False, True, True)          # first_k_dense_replace = 1
    ernie = spec_from_config(TINY["ernie4_5_moe"])
    assert ernie.moe_layer_flags == (False, True, False, True)  # start 1, interval 2
    model = _build(TINY["ernie4_5_moe"])
    assert [hasattr(layer.mlp, "experts") for layer in model.model.layers] == list(ernie.moe_layer_flags)


def test_default_lora_targets_absent_from_the_model_refuse_lora_only():
    # DeepSeek-V3 compresses q through q_a_proj/q_b_proj and has no v_proj: peft finds neither of the
    # default q_proj,v_proj; a full fine-tune and inference never read the LoRA targets.
    from estimator.errors import InputError
    from estimator.workload import Workload

    spec = spec_from_config(TINY["deepseek_v3"])
    for method in ("full", "inference"):
        assert Workload(spec, method=method).validate().method == method
    with pytest.raises(InputError) as err:
        Workload(spec, method="lora").validate()
    message = str(err.value)
    assert "\n" not in message and "q_a_proj" in message and "kv_b_proj" in message and "--lora-targets" in message
    assert Workload(spec, method="lora", lora_targets=("q_b_proj", "kv_b_proj")).validate()
