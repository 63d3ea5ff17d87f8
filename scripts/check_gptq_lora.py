"""Check LoRA on a GPTQ base (estimator.activations `int4_dequantized_bytes_per_layer`) against gptqmodel's own
TorchLinear, the kernel a CUDA training load runs (needs gptqmodel and optimum, which the project
does not pin: gptqmodel 7.x asks for torch >= 2.14.1, so install it beside the project, not in it).

A tiny Llama (or Phi, Qwen2) in bf16, its decoder linears converted by optimum's GPTQQuantizer (4 bits, group 128)
with a named gptqmodel backend, LoRA by peft on the given targets, one forward + backward on CPU:
the bytes of the distinct storages autograd saves (saved_tensors_hooks, parameters and buffers
excluded) against the same model without GPTQ. The difference is the dequantized copies, which the
estimator counts as `num_layers x int4_dequantized_bytes_per_layer`:

    pip install --no-deps --no-build-isolation --target /tmp/gq gptqmodel optimum  # + its imports
    PYTHONPATH=/tmp/gq python scripts/check_gptq_lora.py --targets q_proj,v_proj

2026-11-28, torch 2.13.0+cpu, transformers 5.23.0, peft 0.21.2, gptqmodel 7.7.0, optimum (PyPI,
same day), backend "torch" (TorchLinear) and "auto_trainable" (on CPU: TorchAtenLinear), H 256,
I 512, 3 layers, batch 2 x 64: the difference equals the estimate but for the per-layer mean's
rounding (under 1 B per layer): q_proj,v_proj 3,276,800 B (every layer's copies but the first
layer's q, k and v; estimate 3 x 1,092,266 = 3,276,798 B), the same on all seven projections;
down_proj 2,359,296 B (the first layer saves none); o_proj 3,145,728 B (the first layer's gate, up
and down only); with checkpointing the forward keeps none (0 B; the recomputation's are the
estimate's top layer). `--family phi` (a parallel block, whose MLP reads the layer's normed input):
q_proj,v_proj 2,228,224 B, dense 2,097,152 B, fc2 2,097,152 B, fc1 2,359,296 B, each the estimate
but for the mean's rounding; `--family qwen2` (biased q, k and v) as Llama's.

`--ops` counts the aten operators GPTQ adds (TorchDispatchMode, as profiler/opcount.py) against
estimator.ops (estimator/data/time_constants.csv gptq_training_*): 19 per quantized linear in the
forward and in a checkpointed layer's recomputation, none in the backward (Llama exactly); a biased
linear 2 more in the forward, 6 in the backward and 5 in a recomputation (Qwen2's q, k and v
exactly); Phi, all six linears biased, 9 more in the backward (3 layers) and 6 fewer with
checkpointing, within the 1 % of the step's operators the check allows.

`--scratch` measures one TorchLinear's forward in training mode with the tracer's live-bytes counter:
its peak stands 3.977 B per weight element above the state after it (K 1024 x N 2048 and 4096 x
1024), the modelled 4 B (estimator.memory `gptq_training_dequant_scratch_bytes`) less the output, which is
not yet there at the product.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# the repository root replaces scripts/ (whose profile.py would shadow the standard library's)
sys.path[0] = str(Path(__file__).resolve().parents[1])

H, I, LAYERS, VOCAB = 256, 512, 3, 1000
CONFIGS = {  # a sequential block (Llama) and a parallel one (Phi: LayerNorm, partial rotary, biases)
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=H, intermediate_size=I,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5, hidden_act="silu"),
    "phi": dict(model_type="phi", architectures=["PhiForCausalLM"], hidden_size=H, intermediate_size=I,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                max_position_embeddings=256, tie_word_embeddings=False, layer_norm_eps=1e-5,
                hidden_act="gelu_new", partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
                attention_dropout=0.0),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=H, intermediate_size=I,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu"),
}


def build(family: str, gptq: bool, targets: list[str], backend: str, ckpt: bool):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = dict(CONFIGS[family])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).to(torch.bfloat16)
    if gptq:
        from optimum.gptq import GPTQQuantizer

        quantizer = GPTQQuantizer(bits=4, group_size=128, desc_act=False, sym=True, backend=backend)
        model = quantizer.post_init_model(quantizer.convert_model(model, device_map={"": "cpu"}))
    model = get_peft_model(model, LoraConfig(r=8, target_modules=targets, lora_dropout=0.0))
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def saved_bytes(family: str, gptq: bool, targets: list[str], backend: str, ckpt: bool, batch: int,
                seq: int) -> int:
    import torch

    model = build(family, gptq, targets, backend, ckpt)
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    ids = torch.randint(0, VOCAB, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(n for ptr, n in seen.items() if ptr not in owned)


def ops(family: str, gptq: bool, targets: list[str], backend: str, ckpt: bool) -> dict[str, int]:
    """aten operators of the second step (the first builds lazy state), by phase, as
    profiler/opcount.py counts them."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {"forward": 0, "backward": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops["backward" if torch._C._current_graph_task_id() != -1 else "forward"] += 1
            return func(*args, **(kwargs or {}))

    model = build(family, gptq, targets, backend, ckpt)
    ids = torch.randint(0, VOCAB, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    counter = Count()
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.ops


def scratch(k: int, n: int, m: int) -> tuple[int, int]:
    """(forward peak, bytes live after the forward) of one TorchLinear [k -> n] in training mode on
    an [m, k] input that needs a gradient, counted by the tracer's live-bytes counter
    (profiler/trace/tracker.py), the packed buffers made before it not counted."""
    import torch
    from optimum.gptq import GPTQQuantizer

    from profiler.trace.tracker import LiveBytes

    class Peak(LiveBytes):
        def __init__(self):
            super().__init__()
            self.forward_peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.forward_peak = max(self.forward_peak, self.total)
            return out

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].proj = torch.nn.Linear(k, n, bias=False)
    model = model.to(torch.bfloat16)
    quantizer = GPTQQuantizer(bits=4, group_size=128, desc_act=False, sym=True, backend="torch",
                              block_name_to_quantize="layers")
    linear = quantizer.post_init_model(quantizer.convert_model(model, device_map={"": "cpu"})).layers[0].proj
    linear.train()
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    counter = Peak()
    with counter:
        y = linear(x)   # kept: the output and, through its graph, the saved copy
        after = counter.total
    del y
    return counter.forward_peak, after


def estimated_ops(family: str, targets: list[str], ckpt: bool) -> dict[str, float]:
    from estimator.model import spec_from_config
    from estimator.ops import _gptq_ops

    spec = spec_from_config(CONFIGS[family], f"tiny-{family}")
    return {phase: _gptq_ops(spec, phase, ckpt) for phase in ("forward", "backward")}


def estimated(family: str, targets: list[str], ckpt: bool, batch: int, seq: int) -> int:
    from estimator import activations as act
    from estimator.model import spec_from_config
    from estimator.workload import Workload

    spec = spec_from_config(CONFIGS[family], f"tiny-{family}")
    w = Workload(model=spec, method="lora", quant="gptq", precision="bf16", lora_targets=tuple(targets),
                 lora_rank=8, grad_ckpt=ckpt, batch=batch, seq=seq).validate()
    return 0 if ckpt else spec.num_layers * act.int4_dequantized_bytes_per_layer(act.activation_key(w))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(CONFIGS), default="llama")
    p.add_argument("--targets", default="q_proj,v_proj", help="LoRA target module names, comma-separated")
    p.add_argument("--backend", default="torch", help="gptqmodel backend (torch: TorchLinear, CUDA's)")
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--ops", action="store_true", help="count the operators per quantized linear instead")
    p.add_argument("--scratch", action="store_true", help="measure one linear's dequantization scratch instead")
    args = p.parse_args()
    try:
        import gptqmodel  # noqa: F401
        import optimum.gptq  # noqa: F401
    except ImportError as e:
        print(f"check_gptq_lora.py: needs gptqmodel and optimum ({e}); see the docstring", file=sys.stderr)
        return 2
    targets = args.targets.split(",")
    if args.scratch:
        from estimator.memory import gptq_training_dequant_scratch_bytes
        from estimator.model import spec_from_config
        from estimator.workload import Workload

        ok = True
        spec = spec_from_config(CONFIGS["llama"], "tiny-llama")
        w = Workload(model=spec, method="lora", quant="gptq", precision="bf16").validate()
        for k, n, m in ((1024, 2048, 16), (4096, 1024, 64)):
            peak, after = scratch(k, n, m)
            modelled = gptq_training_dequant_scratch_bytes(w, k * n)
            print(f"K={k} N={n} M={m}: forward peak {peak - after:,} B above the state after it (the saved "
                  f"copy and the output); modelled scratch {modelled:,.0f} B ({modelled / (k * n):g} B per element)")
            ok &= abs(peak - after - modelled) <= 2 * m * n + 8 * k   # the output; g_idx's int64 casts
        return 0 if ok else 1
    if args.ops:
        plain, gptq = (ops(args.family, g, targets, args.backend, args.grad_ckpt) for g in (False, True))
        est = estimated_ops(args.family, targets, args.grad_ckpt)
        print(f"{args.family} operators GPTQ adds (checkpointing {args.grad_ckpt}): forward "
              f"{gptq['forward'] - plain['forward']} (estimate {est['forward']:g}), backward "
              f"{gptq['backward'] - plain['backward']} (estimate {est['backward']:g}); the step's "
              f"{sum(gptq.values())}")
        off = sum(abs(gptq[k] - plain[k] - est[k]) for k in est)
        return 0 if off <= 0.01 * sum(gptq.values()) else 1
    plain = saved_bytes(args.family, False, targets, args.backend, args.grad_ckpt, 2, 64)
    gptq = saved_bytes(args.family, True, targets, args.backend, args.grad_ckpt, 2, 64)
    estimate = estimated(args.family, targets, args.grad_ckpt, 2, 64)
    print(f"{args.family} targets {args.targets} backend {args.backend} checkpointing {args.grad_ckpt}: "
          f"saved {plain:,} B without GPTQ, {gptq:,} B with; difference {gptq - plain:,} B, estimate {estimate:,} B")
    return 0 if 0 <= gptq - plain - estimate < LAYERS else 1   # the per-layer mean rounds down


if __name__ == "__main__":
    sys.exit(main())
