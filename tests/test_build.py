"""profiler/build.py on CPU: the quantized (QLoRA / int8) build never holds the full-precision
model, the model it builds is the one transformers' bitsandbytes loading gives, and a flash-attn
wheel that does not import is a missing package.

Build memory is counted with a dispatch mode that keeps the bytes of every live non-meta storage
(a weak reference per storage, as profiler.trace.tracker.LiveBytes does), on the CPU: bitsandbytes
quantizes there with the same layers and the same order of allocations as on CUDA.
"""

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from profiler import build
from profiler.case import Case
from profiler.child import classify
from tests.tiny_configs import tiny_llama

TINY = Path(__file__).resolve().parent / "data" / "tiny-llama.json"


class LiveStorage(TorchDispatchMode):
    """Peak of the summed bytes of live non-meta storages made under the mode (`keep` filters)."""

    def __init__(self, keep=lambda t: True) -> None:
        super().__init__()
        self.keep, self.live, self.total, self.peak = keep, {}, 0, 0

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key, (0, None))[0]
        self.total -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and self.keep(t):
                st = t.untyped_storage()
                if id(st) not in self.live:
                    key = id(st)
                    self.live[key] = (st.nbytes(), weakref.ref(st, lambda _, key=key: self._free(key)))
                    self.total += st.nbytes()
                    self.peak = max(self.peak, self.total)
        return out


def _config(folder: Path, **changes) -> str:
    """tiny-llama made of six layers whose linears dominate (hidden 256, MLP 512, vocab 1000)."""
    return str(tiny_llama(folder, "wide", **{**dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                                                    num_attention_heads=4, num_key_value_heads=2), **changes}))


def _layer_linear_bytes(cfg: dict, dtype_bytes: int = 2) -> int:
    """Unquantized bytes of one decoder layer's linear weights (q, k, v, o, gate, up, down)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    return dtype_bytes * (2 * h * h + 2 * h * kv + 3 * h * i)


def _linear_numels(cfg: dict) -> set:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    return {h * h, h * kv, h * i}


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_quantized_build_holds_at_most_one_layer_unquantized(tmp_path, quant):
    # The old build made the whole bf16 model on the device and kept every original linear alive
    # until all were quantized: six layers of bf16 linear weights at once (7.1 MB here;
    # Llama-3.1-70B: ~131 GiB on an 80 GB card, a false OOM).
    case = Case(_config(tmp_path), {"method": "inference", "quant": quant})
    one_layer = _layer_linear_bytes(case.config())
    numels = _linear_numels(case.config())

    def unquantized_linear(t) -> bool:  # a full-precision storage the size of a linear's weight
        return t.dtype.is_floating_point and t.untyped_storage().nbytes() // t.element_size() in numels

    everything, linears = LiveStorage(), LiveStorage(unquantized_linear)
    with everything, linears:
        model = build.build_model(case.config(), case.workload(), "cpu")
        gc.collect()  # what is left alive is the model (cycles, e.g. Params4bit.module, collected)
    assert linears.peak > 0  # the weights were drawn in full precision, then quantized
    assert linears.peak <= one_layer, (linears.peak, one_layer)
    assert linears.total == 0  # none is left behind
    assert everything.peak <= everything.total + one_layer, (everything.peak, everything.total)
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("quant,layer", [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_quantized_model_is_the_one_transformers_loads(tmp_path, quant, layer):
    # Every linear but the head is a bitsandbytes layer; the rest is initialised as transformers'
    # _init_weights does (norms 1, embeddings N(0, 0.02), rotary inv_freq computed, biases 0);
    # tied embeddings stay tied.
    cfg = _config(tmp_path, model_type="qwen2", attention_bias=True, tie_word_embeddings=True)
    case = Case(cfg, {"method": "inference", "quant": quant})
    w = case.workload()
    model = build.build_model(case.config(), w, "cpu")
    plain = build.build_model(case.config(), Case(cfg, {"method": "inference"}).workload(), "cpu")
    names = build.quantized_linear_names(plain)
    assert len(names) == 7 * 6
    for name in names:
        assert type(model.get_submodule(name)).__name__ == layer
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert all(p.device.type == "cpu" for p in [*model.parameters(), *model.buffers()])
    emb = model.get_input_embeddings().weight
    assert emb.dtype == torch.bfloat16 and 0.015 < emb.float().std() < 0.025
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    assert torch.equal(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    q = model.model.layers[0].self_attn.q_proj
    assert q.bias.dtype == torch.bfloat16 and not q.bias.any() and not q.bias.requires_grad
    weight = (torch.ops.bitsandbytes.dequantize_4bit(q.weight, q.quant_state.absmax if not w.double_quant
                                                     else _absmax(q.quant_state), 64, w.quant,
                                                     [256, 256], torch.bfloat16)
              if quant == "nf4" else q.weight.float() * q.weight.SCB[:, None] / 127)
    assert 0.015 < weight.float().std() < 0.025  # random N(0, initializer_range) values
    assert model.is_loaded_in_4bit == (quant == "nf4") and model.is_loaded_in_8bit == (quant == "int8")


def _absmax(state):
    from bitsandbytes import functional as F

    return F.dequantize_blockwise(state.absmax, state.state2) + state.offset


def test_qlora_trains_on_the_quantized_build(tmp_path):
    from profiler import steps

    case = Case(_config(tmp_path), {"method": "qlora", "quant": "nf4", "batch": 1, "seq": 8})
    w = case.workload()
    model = build.build_model(case.config(), w, "cpu")
    optimizer = build.make_optimizer(model, w)
    lora = [p for p in model.parameters() if p.requires_grad]
    assert lora and all(p.dtype == torch.float32 for p in lora)
    before = [p.detach().clone() for p in lora]
    steps.train_step(model, optimizer, build.make_batch(w, 1000, "cpu"), w, "cpu")
    assert any(not torch.equal(a, p) for a, p in zip(before, lora))


def test_the_tracer_build_stays_on_meta(tmp_path):
    from profiler.trace.qlora import stand_in_class

    case = Case(_config(tmp_path), {"method": "qlora", "quant": "nf4"})
    model = build.build_model(case.config(), case.workload(), "meta")
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    layers = [m for m in model.modules() if isinstance(m, stand_in_class())]
    assert len(layers) == 7 * 6


# ---------------------------------------------------------------- packages


@pytest.fixture
def broken_flash_attn(tmp_path, monkeypatch):
    """A flash_attn whose compiled extension was built for another torch (it fails on import)."""
    pkg = tmp_path / "site" / "flash_attn"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        'raise ImportError("/site/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: '
        '_ZN3c104cuda9SetDeviceEi")\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)


def test_a_flash_attn_that_does_not_import_is_a_missing_package(broken_flash_attn):
    w = Case(str(TINY), {"attn": "flash"}).workload()
    with pytest.raises(build.MissingPackage) as info:
        build.check_packages(w)
    status, message = classify(info.value)
    assert status == "skipped"
    assert message.startswith("flash_attn is installed but does not import (needed for attn flash): "
                              "ImportError: ")
    assert "undefined symbol" in message and "\n" not in message


def test_other_attention_does_not_import_flash_attn(broken_flash_attn):
    build.check_packages(Case(str(TINY), {"attn": "sdpa"}).workload())
    assert "flash_attn" not in sys.modules
