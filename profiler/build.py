"""Build the real thing for a Workload: a transformers model from its config with random weights,
created directly on the device, plus LoRA, QLoRA, gradient checkpointing and the optimizer.

One code path for every kind of device: `cuda` (measured), `cpu` (a real step, time only) and
`meta` (the tracer materialises the model under FakeTensorMode). Random values change neither
memory nor time, so no download is needed.

The recipes follow what users run:
- precision: fp32/bf16/fp16 load the model in that dtype; amp-* load fp32 and the step runs under
  autocast in the half dtype.
- LoRA: peft `get_peft_model` with `LoraConfig(r, alpha=2r, dropout 0 (0.05 with --lora-dropout), target
  roles)`; peft keeps
  adapters in fp32 (`autocast_adapter_dtype=True`); `--dora`: `use_dora=True` (a magnitude vector per
  adapted linear).
- QLoRA (and LoRA on an int8 base): every nn.Linear but the output head becomes a bitsandbytes
  layer, as transformers' bitsandbytes quantizer does, built as transformers loads such a model:
  the skeleton on `meta`, each linear's random weight made and quantized on the device one at a
  time, so the device never holds the full-precision model; then peft's `prepare_model_for_kbit_training`,
  which upcasts every non-quantized parameter to fp32 (the HF/TRL recipe), and the step runs under
  autocast in the compute dtype.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from estimator.lora_targets import is_all_linear, is_pattern
from estimator.regimes import LIGER_PATCHED_TYPES, regime
from estimator.states import frozen_vision
from estimator.workload import BNB_QUANTS, INT4_QUANTS, Workload

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
    return torch_dtype(w.base_precision)   # fp8 training: a bf16 model whose linears torchao converts


def autocast_dtype(w: Workload):
    """The dtype the step autocasts to, or None for no autocast (kbit preparation, when the stack
    runs it, makes the step autocast: estimator.regimes)."""
    if w.amp or (w.training and regime(w).kbit_prep):
        return torch_dtype(w.compute_dtype)
    return None


def required_packages(w: Workload) -> list[str]:
    """Import names this Workload needs beyond torch and transformers."""
    need = []
    if w.method in ("lora", "qlora"):
        need.append("peft")
    if w.quant in BNB_QUANTS or w.optimizer.endswith("8bit") or w.optimizer.startswith("paged"):
        need.append("bitsandbytes")
    if w.zero:
        need.append("deepspeed")
    if w.attn == "flash":
        need.append("flash_attn")
    if _liger_patches(w):
        need.append("liger_kernel")
    if w.fp8:
        need.append("torchao")
    return need


def _liger_patches(w: Workload) -> bool:
    """Liger Kernel patches this model (--liger on a model_type liger-kernel 0.8.5 has kernels for),
    whether or not the estimator models them there (estimator.regimes)."""
    return w.liger and w.model.model_type in LIGER_PATCHED_TYPES


_LIGER_UNDO: list = []   # how to put back what Liger rebound, most recent last


def _apply_liger(model) -> None:
    """Liger's kernels on `model`, as the HF Trainer applies them. Beyond the instance, liger-kernel
    0.8.5 rebinds names in transformers' modeling module for every later model of the process
    (monkey_patch.py: `apply_rotary_pos_emb`, the RMSNorm and MLP classes, `cross_entropy` with
    cross_entropy=True; Llama-4's `forward` on its class); `undo_liger_patches` puts them back."""
    import sys

    import torch.nn.functional as F
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    modules = [(m, dict(vars(m))) for name, m in list(sys.modules.items())
               if name.startswith("transformers.models.") and m is not None]
    # and the classes those modules define: some patches assign a method on the class itself
    # (apply_liger_kernel_to_llama4: `Llama4ForCausalLM.forward = lce_forward`, instance or not)
    classes = [(c, dict(vars(c))) for m, names in modules for c in names.values()
               if isinstance(c, type) and c.__module__ == m.__name__]
    cross_entropy = F.cross_entropy

    def undo() -> None:
        for module, before in modules:
            names = vars(module)
            for name in [n for n in names if n not in before]:
                del names[name]
            names.update(before)
        for cls, before in classes:
            for name in [n for n in vars(cls) if n not in before]:
                delattr(cls, name)
            for name, value in before.items():
                if vars(cls).get(name) is not value:
                    setattr(cls, name, value)
        F.cross_entropy = cross_entropy

    _LIGER_UNDO.append(undo)
    _apply_liger_kernel_to_instance(model=model)


def undo_liger_patches() -> None:
    """Put back the names Liger rebound in transformers' modules (`_apply_liger`), once the patched
    model's step is done, so that a later model of the same process (the tracer's) is built as
    transformers has it. A process that builds one model (the profiler's) needs none of this."""
    while _LIGER_UNDO:
        _LIGER_UNDO.pop()()


def check_packages(w: Workload) -> None:
    """Raise MissingPackage naming the first package this Workload needs and lacks, and the
    settings that need it (e.g. "bitsandbytes is not installed (needed for quant nf4)"). A
    flash_attn that is installed but does not import (a wheel built for another torch or CUDA:
    "undefined symbol") counts as missing: the configuration cannot run here, it did not fail."""
    from profiler.fsdp import hybrid_refusal

    refused = hybrid_refusal(w)
    if refused:   # never measured as something else: a skipped row says why
        raise MissingPackage(refused)
    if w.quant in INT4_QUANTS:   # a GPTQ/AWQ checkpoint's kernels (gptqmodel, AutoAWQ) need CUDA builds
        raise MissingPackage(f"the profiler does not build quant {w.quant} (int4 checkpoints run by gptqmodel or "
                             "AutoAWQ kernels) yet (estimator only)")
    if w.quant == "mxfp4":
        raise MissingPackage("the profiler does not build quant mxfp4 (GPT-OSS's packed experts run by the "
                             "`kernels` package's triton matmul_ogs) yet (estimator only)")
    if w.loss == "chunked" and w.world_size > 1:   # the step calls the decoder itself, under no DDP/FSDP wrapper
        raise MissingPackage("the profiler runs loss chunked in one process only (its step calls the decoder and "
                             "the output projection itself) yet (estimator only beyond one GPU)")
    if w.te_fp8:   # Transformer Engine needs CUDA and its own build; the profiler converts with torchao only
        raise MissingPackage("the profiler does not build fp8_backend te (Transformer Engine) yet (estimator only)")
    if w.train_vision:   # token ids only: a trained vision tower would get no gradient, as if frozen
        raise MissingPackage("the profiler does not build train_vision True (it feeds token ids, no images, so "
                             "the vision tower would get no gradient) yet (estimator only)")
    if w.compiled and w.training:   # the profiler never calls torch.compile
        raise MissingPackage("the profiler does not build compiled True (torch.compile of the training step) "
                             "yet (estimator only)")
    for name in required_packages(w):
        if importlib.util.find_spec(name) is None:
            raise MissingPackage(f"{name} is not installed (needed for {_needed_for(name, w)})")
        if name == "flash_attn":
            _check_importable(name, w)


def _check_importable(name: str, w: Workload) -> None:
    """Import `name` (its compiled extension loads with it); MissingPackage if that fails."""
    try:
        importlib.import_module(name)
    except Exception as e:  # ImportError/OSError: undefined symbol, wrong CUDA, missing .so
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
        raise MissingPackage(f"{name} is installed but does not import (needed for "
                             f"{_needed_for(name, w)}): {why}"[:500]) from None


def _needed_for(name: str, w: Workload) -> str:
    """The Workload settings that need package `name`."""
    if name == "peft":
        return f"method {w.method}"
    if name == "deepspeed":
        return f"zero {w.zero}"
    if name == "flash_attn":
        return "attn flash"
    if name == "liger_kernel":
        return "liger"
    if name == "torchao":
        return "precision fp8 (torchao float8 training)"
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
    A quantized base (QLoRA, int8) is built as transformers loads one (see `_build_quantized`):
    the full-precision model never exists on the device.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    check_packages(w)
    config = hf_config(cfg, w)
    quantized = w.quant != "none"
    # a vision-language model (its vision tower counted in the spec) builds as transformers loads it
    auto = AutoModelForImageTextToText if w.model.vision_params else AutoModelForCausalLM
    with torch.device("meta" if quantized else device):
        model = auto.from_config(config, dtype=weight_dtype(w), attn_implementation=_ATTN[w.attn])
    if quantized:
        _build_quantized(model, w, device)
    if _liger_patches(w):   # what the HF Trainer does with use_liger_kernel=True
        _apply_liger(model)
    if w.fp8:
        _convert_to_float8(model)
    if w.grad_ckpt and w.training:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if w.method in ("lora", "qlora"):
        model = _add_lora(model, w)
    elif w.method == "full":
        model.requires_grad_(True)
        if frozen_vision(w):   # a VL model's vision tower stays frozen (estimator.states.frozen_vision)
            _vision_tower(model).requires_grad_(False)
    else:
        model.requires_grad_(False)
    model.train(w.training)
    return model


def _vision_tower(model):
    """The vision tower and merger(s) of a transformers 5 VL model (Qwen2.5-VL, Qwen3-VL: model.visual)."""
    tower = getattr(getattr(model, "model", None), "visual", None)
    if tower is None:
        raise ValueError(f"no vision tower (model.visual) in {type(model).__name__}")
    return tower


def _convert_to_float8(model) -> None:
    """torchao float8 training as estimator.fp8 models it: every decoder nn.Linear with dims divisible
    by 16 becomes Float8Linear (tensorwise dynamic scaling, the default config); lm_head and MoE routers
    stay bf16."""
    import torch
    from torchao.float8 import convert_to_float8_training

    def keep(module, fqn: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and not fqn.endswith(("lm_head", ".gate", ".router"))
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    convert_to_float8_training(model, module_filter_fn=keep)


def quantized_linear_names(model) -> list[str]:
    """Names of the nn.Linear modules a bitsandbytes quantization replaces: all but the output
    head, in module order (layer by layer). transformers 5.23's `replace_with_bnb_linear` takes
    `type(module) is nn.Linear`: a subclass (Llama-4's Llama4Router) stays unquantized."""
    import torch

    head = model.get_output_embeddings()
    return [name for name, mod in model.named_modules()
            if type(mod) is torch.nn.Linear and mod is not head]


def _build_quantized(model, w: Workload, device: str) -> None:
    """Turn the `meta` skeleton `model` into the quantized model on `device`, as transformers'
    bitsandbytes loading does (integrations/bitsandbytes.py `replace_with_bnb_linear` on meta, then
    each weight quantized as it is loaded, `Bnb4bitQuantize`/`Bnb8bitQuantize`): each target
    linear becomes its bitsandbytes layer, whose weight is a random full-precision tensor made for
    that one linear, quantized onto the device and freed at once; then the other parameters and
    buffers are materialised on the device and initialised by transformers' `_init_weights`
    (rotary `inv_freq` included). At most one linear's unquantized weight exists at a time, so the
    build needs the quantized size plus one linear, not the full-precision model (Llama-3.1-70B:
    ~131 GiB in bf16). On `meta` (the tracer) the layers are the tracer's 4-bit stand-in, and
    nothing is materialised: the tracer does that under FakeTensorMode."""
    import torch

    std = _init_std(model.config)
    for name in quantized_linear_names(model):
        model.set_submodule(name, _bnb_linear(model.get_submodule(name), w, device, std))
    model.is_loaded_in_4bit = w.quant in ("nf4", "fp4")
    model.is_loaded_in_8bit = w.quant == "int8"
    if device == "meta":
        return
    materialize(model, device)
    model.initialize_weights()  # the quantized layers are marked initialised: left alone
    model.tie_weights()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _init_std(config) -> float:
    """The standard deviation transformers' `_init_weights` draws linear weights with."""
    for key in ("initializer_range", "init_std", "initializer_factor"):
        value = getattr(config, key, None)
        if value:
            return float(value)
    return 0.02


def materialize(model, device: str) -> None:
    """Give every parameter and buffer still on `meta` uninitialised storage on `device`, keeping
    shared tensors shared (tied embeddings): nn.Module.to_empty would make one new Parameter per
    module and untie them. Tensors already elsewhere (quantized weights) are left as they are."""
    import torch

    memo: dict[int, object] = {}

    def empty(t, param: bool):
        if id(t) not in memo:
            new = torch.empty_like(t, device=device)
            if param:
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                new.__dict__.update(t.__dict__)
            memo[id(t)] = new
        return memo[id(t)]

    for module in model.modules():
        for table, param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                if t is not None and t.is_meta:
                    table[name] = empty(t, param)


def _bnb_linear(linear, w: Workload, device: str, std: float = 0.02):
    """The bitsandbytes layer replacing `linear` (on `meta`) with random weights drawn with `std`
    and quantized on `device`; the tracer's 4-bit stand-in on `meta`. A bias is zero, as
    `_init_weights` makes it, in the linear's dtype."""
    import torch

    if device == "meta":  # Params4bit cannot live on meta: the tracer's stand-in, same storage
        from profiler.trace.qlora import stand_in_linear

        return stand_in_linear(linear, w, torch_dtype(w.compute_dtype))
    import bitsandbytes as bnb

    shape, dtype = (linear.out_features, linear.in_features), linear.weight.dtype
    # FSDP QLoRA: bnb_4bit_quant_storage = the compute dtype, so the packed weights are floating and shard
    storage = {"quant_storage": torch_dtype(w.compute_dtype)} if w.fsdp != "none" else {}
    if w.quant == "int8":
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=False,
                                  has_fp16_weights=False, threshold=6.0, device="meta")
        # Int8Params quantizes when it leaves the CPU (a cpu target quantizes in place)
        data = torch.empty(shape, dtype=dtype, device="cpu").normal_(0.0, std)
        new.weight = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False).to(device)
    else:
        new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False,
                                compute_dtype=torch_dtype(w.compute_dtype), compress_statistics=w.double_quant,
                                quant_type=w.quant, device="meta", **storage)
        data = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std)
        new.weight = bnb.nn.Params4bit(data, requires_grad=False, blocksize=64,
                                       compress_statistics=w.double_quant, quant_type=w.quant,
                                       module=new, **storage).to(device)
    del data  # the unquantized weight: gone before the next linear's is made
    if linear.bias is not None:
        new.bias = torch.nn.Parameter(torch.zeros(linear.out_features, dtype=linear.bias.dtype, device=device),
                                      requires_grad=False)
    new._is_hf_initialized = True  # transformers' initialize_weights must not redraw it
    return new


def lora_module_names(model, w: Workload) -> list[str] | str:
    """What peft's `target_modules` gets: "all-linear", the Workload's one regular expression, or
    its module names, which must name modules of the model (a Llama role the family fuses, such as
    q_proj on GPT-2's c_attn, is refused, not guessed)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    if is_all_linear(w.lora_targets):
        return "all-linear"
    if is_pattern(w.lora_targets):
        return w.lora_targets[0]
    present = {name.rpartition(".")[2] for name, mod in model.named_modules()
               if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding, Conv1D))}
    present |= {name.rpartition(".")[2] for name, _ in model.named_parameters() if "experts" in name}
    present |= {"gate"} if w.model.is_moe else set()
    missing = [role for role in w.lora_targets if role not in present]
    if missing:
        raise ValueError(f"LoRA targets {','.join(missing)} are not linear modules of {w.model.model_type} "
                         f"(its linear layers: {','.join(sorted(present))})")
    return list(w.lora_targets)


def _add_lora(model, w: Workload):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if w.quant != "none" and regime(w).kbit_prep:   # --kbit-prep: what the stack does (estimator.regimes)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=w.grad_ckpt,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    # --lora-dropout: peft's dropout on each adapter's input (0.05: ms-swift's default, many recipes' value)
    config = LoraConfig(r=w.lora_rank, lora_alpha=2 * w.lora_rank, lora_dropout=0.05 if w.lora_dropout else 0.0,
                        bias="none",
                        target_modules=lora_module_names(model, w), task_type="CAUSAL_LM", use_dora=w.dora)
    model = get_peft_model(model, config)
    if w.trainable_dtype == "model":   # the loop keeps the adapters in the model's dtype (torchtune, LitGPT)
        keep_trainable_dtype(model, w)
    return model


def keep_trainable_dtype(model, w: Workload) -> None:
    """`--trainable-dtype model`: every trained floating parameter in the dtype the model loaded in
    (peft made the adapters fp32), as a loop that casts the whole model does."""
    dtype = weight_dtype(w)
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)


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
    """Random token ids for one micro-batch; an attention mask only with --padding-mask."""

    input_ids: object
    labels: object
    attention_mask: object = None


def make_batch(w: Workload, vocab_size: int, device: str, seed: int = 0) -> Batch:
    """`batch` x `seq` random token ids on `device`; labels are the inputs (causal LM loss). With
    `padding_mask` the batch carries an attention mask whose last quarter of each row is 0 (a batch
    padded to --seq, as universal-llm-trainer's qa_dataset pads to max_length); every position still
    computes."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab_size, (w.batch, w.seq), generator=gen).to(device)
    mask = None
    if w.padding_mask:
        mask = torch.ones(w.batch, w.seq, dtype=torch.long)
        mask[:, w.seq - max(1, w.seq // 4):] = 0
        mask = mask.to(device)
    return Batch(input_ids=ids, labels=ids if w.training else None, attention_mask=mask)
