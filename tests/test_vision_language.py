"""Vision-language models (Qwen2.5-VL, Qwen3-VL): the language model plus the vision tower, against
transformers 5.23 meta-device builds of tiny configs (tests/arch_configs.py VL) and of the catalog
entries (tests/test_params_transformers.py), and what trains per method: a full fine-tune leaves the
tower frozen (a text-only batch gives it no gradient; LLaMA-Factory and ms-swift freeze it by default;
profiler/build.py freezes it) unless --train-vision; LoRA/QLoRA freeze it (peft freezes every base
parameter) and adapt only the modules the targets match."""

import copy

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForImageTextToText

from estimator.errors import InputError
from estimator.memory import components
from estimator.regimes import regime
from estimator.model import spec_from_config
from estimator.params import count_params
from estimator.workload import Workload
from profiler.build import build_model
from tests.arch_configs import VL

transformers.logging.set_verbosity_error()


def _build(cfg: dict):
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(AutoConfig.for_model(**copy.deepcopy(cfg)))


@pytest.mark.parametrize("name", sorted(VL))
def test_total_vision_and_language_counts_equal_the_meta_build(name):
    cfg = VL[name]
    model, p = _build(cfg), count_params(spec_from_config(cfg, name))
    assert p.total == sum(t.numel() for t in model.parameters())
    assert p.vision == sum(t.numel() for t in model.model.visual.parameters())
    assert p.embedding == model.get_input_embeddings().weight.numel()
    assert p.lm_head == model.lm_head.weight.numel()          # untied
    assert p.active == p.total                               # dense
    # the vision tower's linears by name and shape, as peft would find them
    ours = {(tpl.format(i), d_in, d_out) for tpl, d_in, d_out, n in spec_from_config(cfg).vision_linears
            for i in range(n)}
    found = {(n, m.in_features, m.out_features) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and n.startswith("model.visual.")}
    assert ours == found


@pytest.mark.parametrize("name", sorted(VL))
def test_full_freezes_the_tower_unless_told_lora_freezes_it(name):
    spec = spec_from_config(VL[name], name)
    p = count_params(spec)
    w = Workload(spec, method="full", precision="bf16").validate()
    full = components(w)
    assert full.weights == 2 * p.total and full.gradients == 2 * (p.total - p.vision)   # tower resident, no grad
    assert full.optimizer_states == 2 * 2 * (p.total - p.vision)                      # AdamW, bf16 states
    assert any("vision tower frozen" in n for n in regime(w).notes)
    trained = components(Workload(spec, method="full", precision="bf16", train_vision=True).validate())
    assert trained.weights == 2 * p.total and trained.gradients == 2 * p.total      # tower weights and gradients
    assert trained.optimizer_states == 2 * 2 * p.total
    # the profiler builds what the estimate assumes: the tower frozen, the rest trainable
    model = build_model(VL[name], w, "meta")
    assert sum(t.numel() for t in model.parameters() if t.requires_grad) == p.total - p.vision
    assert not any(t.requires_grad for t in model.model.visual.parameters())
    lora = components(Workload(spec, method="lora", precision="bf16").validate())
    # rank 16 on q_proj (64 -> 64) and v_proj (64 -> 32) of 2 layers, fp32 (peft): the only trained tensors
    adapters = 16 * sum((i + o) for i, o in [(64, 64), (64, 32)]) * 2
    assert lora.weights == 2 * p.total + 4 * adapters                       # the frozen tower stays resident
    assert lora.gradients == 4 * adapters                                   # no gradient for the tower


def test_the_text_keys_of_qwen2_5_vl_sit_at_the_top_level_qwen3_vl_in_text_config():
    a, b = spec_from_config(VL["qwen2_5_vl"]), spec_from_config(VL["qwen3_vl"])
    assert (a.qkv_bias, a.qk_norm, a.num_layers) == (True, False, 2)        # a Qwen2 decoder
    assert (b.qkv_bias, b.qk_norm, b.num_layers, b.head_dim) == (False, True, 2, 16)   # a Qwen3 decoder


def test_train_vision_needs_a_vision_tower_and_a_full_fine_tune():
    spec = spec_from_config(VL["qwen2_5_vl"], "qwen2_5_vl")
    with pytest.raises(InputError, match="full fine-tune"):
        Workload(spec, method="lora", train_vision=True).validate()
    from tests.arch_configs import TINY
    with pytest.raises(InputError, match="no vision tower"):
        Workload(spec_from_config(TINY["olmo2"], "olmo2"), method="full", train_vision=True).validate()


@pytest.mark.parametrize("train_vision", [False, True])
def test_fsdp_counts_the_tower_sharded_and_trains_it_only_when_told(train_vision):
    from estimator.fsdp import model_tensors
    from estimator.states import model_states, states_key

    spec = spec_from_config(VL["qwen2_5_vl"], "qwen2_5_vl")
    p = count_params(spec)
    assert sum(t.rows * t.width * t.count for t in model_tensors(spec, p)) == p.total   # the tower included
    one = Workload(spec, method="full", precision="bf16", fsdp="full", train_vision=train_vision).validate()
    states = model_states(states_key(one))
    trained = p.total - (0 if train_vision else p.vision)
    assert states.trained.trainable == trained           # one rank: no padding
