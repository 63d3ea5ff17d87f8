"""Build the real thing for a Workload: a transformers model from its config with random weights,
created directly on the device, plus LoRA, QLoRA, gradient checkpointing and the optimizer.

One code path for every kind of device: `cuda` (measured), `cpu` (a real step, time only) and
`meta` (the tracer materialises the model under FakeTensorMode). Random values change neither
memory nor time, so no download is needed.

The recipes follow what users run:
- precision: fp32/bf16/fp16 load the model in that dtype; amp-* load fp32 and the step runs under
  autocast in the half dtype.
- LoRA: peft `get_peft_model` with `LoraConfig(r, alpha=2r, dropout 0, target roles)`; peft keeps
  adapters in fp32 (`autocast_adapter_dtype=True`).
- QLoRA (and LoRA on an int8 base): every nn.Linear but the output head becomes a bitsandbytes
  layer, as transformers' bitsandbytes quantizer does; then peft's `prepare_model_for_kbit_training`,
  which upcasts every non-quantized parameter to fp32 (the HF/TRL recipe), and the step runs under
  autocast in the compute dtype.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from estimator.workload import Workload

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_ATTN = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}


class MissingPackage(RuntimeError):
    """A package this configuration needs is not installed (the row is `skipped`, not `error`)."""


def torch_dtype(name: str):
    """torch dtype of a precision name (fp32, bf16, fp16; amp-* gives the autocast dtype)."""
    import torch

    return getattr(torch, _DTYPES[name.removeprefix("amp-")])


def weight_dtype(w: Workload):
    """dtype of the parameters as loaded: fp32 for fp32 and AMP, else the half dtype. QLoRA and
    int8 bases load in the compute dtype (the non-quantized parts are upcast later by peft)."""
    import torch

    if w.amp or w.precision == "fp32":
        return torch.float32
    return torch_dtype(w.precision)


def autocast_dtype(w: Workload):
    """The dtype the step autocasts to, or None for no autocast."""
    if w.amp or (w.training and w.quant != "none"):
        return torch_dtype(w.compute_dtype)
    return None


def required_packages(w: Workload) -> list[str]:
    """Import names this Workload needs beyond torch and transformers."""
    need = []
    if w.method in ("lora", "qlora"):
        need.append("peft")
    if w.quant != "none" or w.optimizer.endswith("8bit") or w.optimizer.startswith("paged"):
        need.append("bitsandbytes")
    if w.zero:
        need.append("deepspeed")
    if w.attn == "flash":
        need.append("flash_attn")
    return need


def check_packages(w: Workload) -> None:
    """Raise MissingPackage naming the first package this Workload needs and lacks, and the
    settings that need it (e.g. "bitsandbytes is not installed (needed for quant nf4)")."""
    for name in required_packages(w):
        if importlib.util.find_spec(name) is None:
            raise MissingPackage(f"{name} is not installed (needed for {_needed_for(name, w)})")


def _needed_for(name: str, w: Workload) -> str:
    """The Workload settings that need package `name`."""
    if name == "peft":
        return f"method {w.method}"
    if name == "deepspeed":
        return f"zero {w.zero}"
    if name == "flash_attn":
        return "attn flash"
    reasons = [f"quant {w.quant}"] if w.quant != "none" else []
    if w.optimizer.endswith("8bit") or w.optimizer.startswith("paged"):
        reasons.append(f"optimizer {w.optimizer}")
    return ", ".join(reasons)


def hf_config(cfg: dict, w: Workload):
    """A transformers PretrainedConfig from the raw config dict, set up for this Workload."""
    from transformers import AutoConfig

    values = {k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "quantization_config")}
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values)
    config.use_cache = not w.training
    return config


def build_model(cfg: dict, w: Workload, device: str):
    """The model of `w` on `device` (cuda, cpu or meta), LoRA/QLoRA and checkpointing applied.

    Training models are in train mode with dropout as configured; inference models in eval mode.
    """
    import torch
    from transformers import AutoModelForCausalLM

    check_packages(w)
    config = hf_config(cfg, w)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=weight_dtype(w),
                                                 attn_implementation=_ATTN[w.attn])
    if w.quant != "none":
        _quantize_linears(model, w, device)
    if w.grad_ckpt and w.training:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if w.method in ("lora", "qlora"):
        model = _add_lora(model, w)
    elif w.method == "full":
        model.requires_grad_(True)
    else:
        model.requires_grad_(False)
    model.train(w.training)
    return model


def _quantize_linears(model, w: Workload, device: str) -> None:
    """Replace every nn.Linear except the output head by its bitsandbytes counterpart,
    quantizing the random weights on the way to `device` (as transformers' bnb quantizer)."""
    import torch

    head = model.get_output_embeddings()
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) and mod is not head]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _bnb_linear(linear, w, device))
        del linear
    model.is_loaded_in_4bit = w.quant in ("nf4", "fp4")
    model.is_loaded_in_8bit = w.quant == "int8"
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _bnb_linear(linear, w: Workload, device: str):
    if device == "meta":  # Params4bit cannot live on meta: the tracer's stand-in, same storage
        from profiler.trace.qlora import stand_in_linear

        return stand_in_linear(linear, w, torch_dtype(w.compute_dtype))
    import bitsandbytes as bnb

    bias = linear.bias is not None
    if w.quant == "int8":
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias,
                                  has_fp16_weights=False, threshold=6.0, device="meta")
        data = linear.weight.data.to("cpu")  # Int8Params quantizes when leaving the CPU
        new.weight = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False).to(device)
    else:
        new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias,
                                compute_dtype=torch_dtype(w.compute_dtype), compress_statistics=w.double_quant,
                                quant_type=w.quant, device="meta")
        new.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, blocksize=64,
                                       compress_statistics=w.double_quant, quant_type=w.quant,
                                       module=new).to(device)
    if bias:
        new.bias = type(linear.bias)(linear.bias.data, requires_grad=False)
    return new


def lora_module_names(model, w: Workload) -> list[str]:
    """The module names peft should target: the Workload's roles, which must exist as nn.Linear
    (or bitsandbytes linear) leaves of the model (fused qkv layers are refused, not guessed)."""
    import torch

    present = {name.rpartition(".")[2] for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear)}
    missing = [role for role in w.lora_targets if role not in present]
    if missing:
        raise ValueError(f"LoRA targets {','.join(missing)} are not linear modules of {w.model.model_type} "
                         f"(its linear layers: {','.join(sorted(present))})")
    return list(w.lora_targets)


def _add_lora(model, w: Workload):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if w.quant != "none":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=w.grad_ckpt,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    config = LoraConfig(r=w.lora_rank, lora_alpha=2 * w.lora_rank, lora_dropout=0.0, bias="none",
                        target_modules=lora_module_names(model, w), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def trainable_parameters(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(model, w: Workload):
    """The Workload's optimizer over the trainable parameters (None for inference). The AdamW
    implementation is explicit: torch's default choice differs between devices and fake tensors."""
    import torch

    if not w.training:
        return None
    params = trainable_parameters(model)
    if w.optimizer == "adamw":
        impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}
        return torch.optim.AdamW(params, lr=1e-5, **impl[w.adamw_impl])
    if w.optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-5, momentum=0.9, foreach=True)
    if w.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-5, scale_parameter=False, relative_step=False, warmup_init=False)
    import bitsandbytes as bnb

    cls = {"adamw-8bit": bnb.optim.AdamW8bit, "paged-adamw": bnb.optim.PagedAdamW,
           "paged-adamw-8bit": bnb.optim.PagedAdamW8bit}[w.optimizer]
    return cls(params, lr=1e-5)


@dataclass(frozen=True)
class Batch:
    """Random token ids (no padding, so no attention mask) for one micro-batch."""

    input_ids: object
    labels: object


def make_batch(w: Workload, vocab_size: int, device: str, seed: int = 0) -> Batch:
    """`batch` x `seq` random token ids on `device`; labels are the inputs (causal LM loss)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab_size, (w.batch, w.seq), generator=gen).to(device)
    return Batch(input_ids=ids, labels=ids if w.training else None)
