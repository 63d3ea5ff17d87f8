"""A LLaMA-Factory training YAML -> Workload fields (LLaMA-Factory `hparams/*_args.py` key names:
model_name_or_path, finetuning_type, lora_rank, lora_target, use_dora, quantization_bit, cutoff_len,
per_device_train_batch_size, gradient_accumulation_steps, num_train_epochs, bf16/fp16,
flash_attn, enable_liger_kernel, deepspeed, packing; TrainingArguments keys as in training_args)."""

from __future__ import annotations

from pathlib import Path

from estimator.errors import InputError
from estimator.workload import lora_targets_from_text
from estimator.sources import Mapper, Reading, take_lora_dropout
from estimator.sources.training_args import QUIET as TRAINER_QUIET
from estimator.sources.training_args import _absorb, workload_fields

_OWN = ("model_name_or_path", "finetuning_type", "lora_rank", "lora_target", "quantization_bit",
        "quantization_method", "cutoff_len", "flash_attn", "enable_liger_kernel", "stage", "use_dora", "lora_dropout",
        "freeze_vision_tower")
QUIET = ("template", "dataset", "dataset_dir", "max_samples", "overwrite_cache", "preprocessing_num_workers",
         "lora_alpha", "trust_remote_code", "val_size", "plot_loss", "ddp_timeout",
         "do_sample", "default_system", "tokenized_path", "mix_strategy", "rope_scaling", "use_unsloth")


def read(config: dict, name: str = "LLaMA-Factory recipe", base_dir: Path | None = None) -> Reading:
    own = {k: v for k, v in config.items() if k in _OWN}
    rest = {k: v for k, v in config.items() if k not in _OWN and k not in QUIET}
    m = Mapper(own, name)
    stage = m.get("stage", str, "sft")
    if stage not in ("sft", "pt"):
        m.reading.unmodelled.append(f"{name}: stage = {stage!r} (modelled as supervised fine-tuning)")
    m.take("model_name_or_path", "model", str)
    kind = m.get("finetuning_type", str, "lora")
    bits = m.get("quantization_bit", int)
    if kind == "lora":
        m.set("method", "qlora" if bits == 4 else "lora", "finetuning_type" + (" + quantization_bit" if bits else ""))
        if bits == 4:
            m.set("quant", "nf4", "quantization_bit (LLaMA-Factory's default quant type nf4)")
        elif bits == 8:
            m.set("quant", "int8", "quantization_bit")
    elif kind == "full":
        m.set("method", "full", "finetuning_type")
    else:
        raise InputError(f"{name}: finetuning_type {kind!r} is not modelled (lora or full)")
    # a VL model's vision tower: frozen by default (hparams/finetuning_args.py freeze_vision_tower=True),
    # as the estimator's full fine-tune has it; False trains it (--train-vision)
    if m.get("freeze_vision_tower", bool, True) is False and kind == "full":
        m.set("train_vision", True, "freeze_vision_tower")
    if bits not in (None, 4, 8):
        raise InputError(f"{name}: quantization_bit must be 4 or 8; got {bits}")
    m.quiet("quantization_method")
    m.take("lora_rank", "lora_rank", int)
    m.take("use_dora", "dora", bool)
    if kind == "lora":
        take_lora_dropout(m, "lora_dropout", "use_dora")
    else:
        m.quiet("lora_dropout")
    target = m.get("lora_target", str)
    if target:
        m.set("lora_targets", lora_targets_from_text("all-linear" if target == "all" else target), "lora_target")
    m.take("cutoff_len", "seq", int)
    attn = m.get("flash_attn", str)
    if attn in ("fa2", "fa3"):
        m.set("attn", "flash", "flash_attn")
    elif attn in ("sdpa", "eager"):
        m.set("attn", attn, "flash_attn")
    m.take("enable_liger_kernel", "liger", bool)
    reading = m.finish()
    _absorb(reading, workload_fields(rest, name, base_dir))
    return reading
