"""FSDP2 model states of the estimator (estimator/fsdp.py, estimator/states.py) against a real
2-rank `fully_shard` run on CPU under gloo (torch 2.13).

The model is wrapped as accelerate 1.15.0's `fsdp2_prepare_model` wraps it (every decoder layer,
the untied input embedding, a tail group of the final norm and lm_head not resharded after the
forward, then the root), with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`; full
fine-tuning first upcasts the trainable parameters to fp32 as accelerate does, LoRA keeps a bf16
base with peft's fp32 adapters. One real training step (forward, backward, AdamW step) runs, and
each rank reports the bytes of the storages it holds: parameter shards, gradient shards (one flat
reduce-scatter output per group) and Adam's two states. Rank 0 holds the largest (padded) chunks;
its bytes must equal the estimator's exactly. The config has odd sizes (vocab 1001, hidden 45,
MLP 99) so FSDP's padding of dim 0 to a multiple of the world size matters.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from estimator.configs import load_spec
from estimator.errors import InputError
from estimator.memory import estimate_memory
from estimator.params import count_params
from estimator.states import model_states, states_key
from estimator.workload import Workload

from tests.tiny_configs import ODD, tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2


def _odd_config(folder: Path) -> Path:
    return tiny_llama(folder, "odd", **ODD, num_hidden_layers=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors read through their local shard)."""
    seen, total = set(), 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _build(config_path: str, method: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if method in ("lora", "lora-model"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))  # fp32 adapters
        if method == "lora-model":   # a loop that keeps the model's dtype (torchtune, fsdp_qlora): bf16 adapters
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    else:   # accelerate: trainable parameters upcast to fp32 under mixed precision
        for p in model.parameters():
            p.data = p.data.to(torch.float32)
    return model


def _shard_like_accelerate(model) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(base.get_input_embeddings(), **kwargs)
    fully_shard([base.model.norm, base.get_output_embeddings()], reshard_after_forward=False, **kwargs)
    fully_shard(model, **kwargs)


def _worker(rank: int, port: int, config_path: str, method: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = _build(config_path, method)
        _shard_like_accelerate(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=False)
        ids = torch.randint(0, 1001, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        states = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
        result = {"params": _storage_bytes(model.parameters()),
                  "grads": _storage_bytes(p.grad for p in trainable),
                  "optimizer": _storage_bytes(states),
                  "dtypes": sorted({str(p.dtype) for p in trainable})}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, method: str) -> tuple[Path, list[dict]]:
    config = _odd_config(tmp_path)
    mp.spawn(_worker, args=(_free_port(), str(config), method, str(tmp_path)), nprocs=WORLD, join=True)
    return config, [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _states(config: Path, **settings):
    w = Workload(load_spec(str(config)), fsdp="full", gpus=WORLD, precision="bf16", **settings).validate()
    return model_states(states_key(w))


@pytest.mark.parametrize("method", ["full", "lora", "lora-model"])
def test_shards_equal_a_real_fully_shard_run(tmp_path, method):
    settings = {"method": method} if method == "full" else {"method": "lora", "lora_rank": 4,
                                                              "lora_targets": ("q_proj", "k_proj", "v_proj",
                                                                               "o_proj", "gate_proj", "up_proj",
                                                                               "down_proj")}
    if method == "lora-model":
        settings["trainable_dtype"] = "model"
    config, ranks = _run(tmp_path, method)
    states = _states(config, **settings)
    rank0 = ranks[0]
    # fp32 shards of what trains; bf16 when the loop keeps the model's dtype
    assert rank0["dtypes"] == ["torch.bfloat16" if method == "lora-model" else "torch.float32"]
    assert states.weights == rank0["params"]
    assert states.gradients == rank0["grads"]
    assert states.optimizer == rank0["optimizer"]
    # rank 0 holds the padded chunks: never less than any other rank
    assert all(rank0[k] >= r[k] for r in ranks[1:] for k in ("params", "grads", "optimizer"))


def test_full_shard_is_about_a_world_fraction_of_ddp(tmp_path):
    config = _odd_config(tmp_path)
    spec = load_spec(str(config))
    total = count_params(spec).total
    states = _states(config, method="full")
    # 16 B per parameter (fp32 weights, gradients, two Adam states) over two ranks, plus padding
    assert 16 * total / 2 <= states.weights + states.gradients + states.optimizer <= 16 * total / 2 * 1.01


def test_offload_moves_every_shard_to_the_host(tmp_path):
    config = _odd_config(tmp_path)
    on_device = _states(config, method="full")
    offloaded = _states(config, method="full", offload="optimizer+params")
    assert offloaded.weights == offloaded.gradients == offloaded.optimizer == 0
    assert offloaded.host == on_device.weights + on_device.gradients + on_device.optimizer
    assert offloaded.zero_buffers == on_device.zero_buffers > 0


def test_shard_grad_op_keeps_every_layer_gathered():
    spec = load_spec("llama-3.1-8b")
    base = Workload(spec, method="full", fsdp="full", gpus=8, batch=1, seq=1024).validate()
    grad_op = base.with_(fsdp="grad-op")
    full_buffers = model_states(states_key(base)).zero_buffers
    kept = model_states(states_key(grad_op)).zero_buffers
    layer_bf16 = 2 * (count_params(spec).total - 2 * spec.vocab_size * spec.hidden_size) / spec.num_layers
    # every layer's bf16 copy instead of two (the rest is the same tail and gradient buffers)
    assert kept - full_buffers == pytest.approx((spec.num_layers - 2) * layer_bf16, rel=1e-3)


def test_hybrid_shards_within_a_node_only():
    spec = load_spec("llama-3.1-8b")
    hybrid = Workload(spec, method="full", fsdp="hybrid", gpus=8, nodes=2).validate()
    full8 = Workload(spec, method="full", fsdp="full", gpus=8, nodes=1).validate()
    assert model_states(states_key(hybrid)).weights == model_states(states_key(full8)).weights


def test_qlora_under_fsdp_shards_the_packed_weights_and_keeps_bf16():
    spec = load_spec("llama-3.1-8b")
    one = Workload(spec, method="qlora", quant="nf4", fsdp="full", gpus=1).validate()
    two = one.with_(gpus=2)
    w1, w2 = model_states(states_key(one)).weights, model_states(states_key(two)).weights
    p = count_params(spec)
    quantized = p.linear_weights
    # packed 4-bit halves with the world; absmax (double quant: 1/64 + 4/(64*256) B) is replicated
    absmax = quantized / 64 + 4 * quantized / (64 * 256)
    assert w1 - w2 == pytest.approx((w1 - absmax) / 2, rel=1e-4)
    # embeddings, norms and lm_head stay bf16 (no kbit preparation under FSDP), adapters bf16 (TRL)
    other = p.total - quantized
    adapters = sum(16 * (lin.d_in + lin.d_out) * lin.count for lin in p.linears if lin.role in ("q_proj", "v_proj"))
    assert w1 == pytest.approx(quantized / 2 + absmax + 2 * other + 2 * adapters, rel=1e-6)


def test_packed_4bit_shape_is_bitsandbytes():
    import bitsandbytes as bnb
    from estimator.fsdp import Tensor, packed_4bit

    weight = torch.randn(99, 45, dtype=torch.bfloat16)
    packed, _ = bnb.functional.quantize_4bit(weight, quant_type="nf4", quant_storage=torch.bfloat16)
    t = packed_4bit(Tensor(99, 45, 1, "linear"))
    assert tuple(packed.shape) == (t.rows, t.width)


def test_invalid_fsdp_settings_are_one_line_errors():
    spec = load_spec("llama-3.2-1b")
    for settings, match in (({"zero": 3}, "alternatives"), ({"method": "inference"}, "apply to training"),
                            ({"method": "lora", "quant": "int8"}, "int8"), ({"pp": 2}, "--pp")):
        with pytest.raises(InputError, match=match):
            Workload(spec, fsdp="full", gpus=2, **settings).validate()


def test_fsdp_peak_is_assembled(tmp_path):
    spec = load_spec("llama-3.1-8b")
    w = Workload(spec, method="full", fsdp="full", gpus=8, batch=1, seq=2048, grad_ckpt=True).validate()
    m = estimate_memory(w, 0.0, 0)
    assert m.zero_buffers_bytes > 0 and m.master_weights_bytes == 0
    assert m.peak_allocated_bytes < estimate_memory(w.with_(fsdp="none", gpus=1), 0.0, 0).peak_allocated_bytes / 3


def test_gradient_accumulation_keeps_unsharded_gradients():
    # accelerate's no_sync under FSDP2 is set_requires_gradient_sync(False): every micro-batch but
    # the last keeps the unsharded bf16 gradients (the whole trained model) alive
    from estimator.regimes import regime

    spec = load_spec("llama-3.2-1b")
    w = Workload(spec, method="full", fsdp="full", gpus=4, batch=1, seq=512).validate()
    one, four = estimate_memory(w, 0.0, 0), estimate_memory(w.with_(grad_accum=4), 0.0, 0)
    shards = model_states(states_key(w)).gradients
    assert four.peak_allocated_bytes - one.peak_allocated_bytes >= shards + 2 * count_params(spec).total * 0.99
    assert any("no_sync" in note for note in regime(w.with_(grad_accum=4)).notes)
