"""An Axolotl recipe YAML -> Workload fields (axolotl `utils/schemas/config.py` key names:
base_model, adapter, load_in_4bit/8bit, lora_r, lora_target_modules / lora_target_linear, peft_use_dora,
sequence_len, micro_batch_size, gradient_accumulation_steps, num_epochs, gradient_checkpointing,
activation_offloading, bf16/fp16, optimizer, flash_attention / sdp_attention, deepspeed, fsdp, liger plugin flags)."""

from __future__ import annotations

from pathlib import Path

from estimator.errors import InputError
from estimator.workload import lora_targets_from_text
from estimator.sources import Mapper, Reading, take_lora_dropout
from estimator.sources.training_args import OPTIMIZERS, _absorb, _relative

QUIET = ("base_model_config", "model_type", "tokenizer_type", "tokenizer_config", "trust_remote_code",
         "datasets", "dataset_prepared_path", "val_set_size", "output_dir", "lora_alpha",
         "learning_rate", "lr_scheduler", "warmup_steps", "warmup_ratio", "weight_decay", "logging_steps",
         "saves_per_epoch", "evals_per_epoch", "save_steps", "eval_steps", "wandb_project", "wandb_entity",
         "wandb_name", "wandb_log_model", "wandb_watch", "special_tokens", "train_on_inputs", "group_by_length",
         "pad_to_sequence_len", "strict", "chat_template", "seed", "resume_from_checkpoint", "local_rank",
         "early_stopping_patience", "debug", "hub_model_id", "max_grad_norm", "eval_sample_packing",
         "tf32", "plugins", "lora_model_dir", "gradient_checkpointing_kwargs", "bnb_config_kwargs")


def _activation_offloading(m: Mapper) -> None:
    """`activation_offloading: true` runs TRL's OffloadActivations around the checkpointed layers
    (axolotl's ActivationOffloadingMixin: trl.models.activation_offloading); `gradient_checkpointing:
    offload` is converted to it (the schema's check_gradient_checkpointing_w_offload). `legacy`
    (axolotl's own offloading checkpoint function) and `disk` (`gradient_checkpointing:
    offload_disk`) are other implementations: listed as not modelled."""
    value = m.get("activation_offloading", (bool, str))
    checkpointing = m.data.get("gradient_checkpointing")
    if value is True:
        m.set("activation_offload", True, "activation_offloading")
    elif value is None and checkpointing == "offload":
        m.set("activation_offload", True, "gradient_checkpointing (offload)")
    elif value in ("legacy", "disk") or (value is None and checkpointing == "offload_disk"):
        what = f"activation_offloading = {value!r}" if value else "gradient_checkpointing = 'offload_disk'"
        m.reading.unmodelled.append(f"{m.name}: {what} (axolotl's own offloading, not TRL's: not modelled; "
                                    "--activation-offload models TRL's)")


def read(config: dict, name: str = "axolotl recipe", base_dir: Path | None = None) -> Reading:
    m = Mapper(config, name)
    m.take("base_model", "model", str)
    adapter = m.get("adapter", str)
    four, eight = m.get("load_in_4bit", bool), m.get("load_in_8bit", bool)
    if adapter in ("lora", "qlora"):
        method = "qlora" if adapter == "qlora" or four else "lora"
        m.set("method", method, "adapter" + (" + load_in_4bit" if four and adapter == "lora" else ""))
        if method == "qlora":
            m.set("quant", "nf4", "adapter qlora (axolotl loads nf4 with double quantization)")
        elif eight:
            m.set("quant", "int8", "load_in_8bit")
    elif adapter is None:
        m.set("method", "full", "(no adapter)")
    else:
        raise InputError(f"{name}: adapter {adapter!r} is not modelled (lora, qlora or none)")
    m.take("lora_r", "lora_rank", int)
    m.take("peft_use_dora", "dora", bool)
    if adapter in ("lora", "qlora"):
        take_lora_dropout(m, "lora_dropout", "peft_use_dora")
    else:
        m.quiet("lora_dropout")
    if m.get("lora_target_linear", bool):
        m.set("lora_targets", lora_targets_from_text("all-linear"), "lora_target_linear")
    else:
        targets = m.get("lora_target_modules", (list, str))
        if targets:
            m.set("lora_targets", lora_targets_from_text(",".join(map(str, targets)) if isinstance(targets, list)
                                                         else targets), "lora_target_modules")
    m.take("sequence_len", "seq", int)
    m.take("micro_batch_size", "batch", int)
    m.take("gradient_accumulation_steps", "grad_accum", int)
    m.take("gradient_checkpointing", "grad_ckpt", (bool, str),
           lambda v: v is True or v in ("unsloth", "offload", "offload_disk"))
    _activation_offloading(m)
    if m.get("bf16", (bool, str)) in (True, "auto"):
        m.set("precision", "bf16", "bf16")
    elif m.get("fp16", bool):
        m.set("precision", "amp-fp16", "fp16")
    optimizer = m.get("optimizer", str)
    if optimizer in OPTIMIZERS:
        opt, impl = OPTIMIZERS[optimizer]
        m.set("optimizer", opt, "optimizer")
        if impl:
            m.set("adamw_impl", impl, "optimizer")
    elif optimizer is not None:
        m.reading.unmodelled.append(f"{name}: optimizer = {optimizer!r} (counted as AdamW)")
    if m.get("flash_attention", bool):
        m.set("attn", "flash", "flash_attention")
    elif m.get("sdp_attention", bool):
        m.set("attn", "sdpa", "sdp_attention")
    if m.get("liger_fused_linear_cross_entropy", bool) or m.get("liger_rms_norm", bool):
        m.set("liger", True, "liger_* plugin flags")
    m.quiet("liger_rope", "liger_glu_activation", "liger_layer_norm", "liger_cross_entropy")
    epochs = m.get("num_epochs", (int, float))
    if epochs is not None:
        m.reading.job["epochs"] = float(epochs)
        m.reading.origin["epochs"] = f"{name}: num_epochs"
    m.unmodelled("sample_packing", "packed to sequence_len: the estimate uses seq = sequence_len")
    ds = m.get("deepspeed", str)
    if ds:
        from estimator.sources import deepspeed, load

        _absorb(m.reading, deepspeed.read(load(_relative(ds, base_dir), "DeepSpeed config"), ds))
    fsdp = m.get("fsdp", (list, str))
    if fsdp:
        from estimator.sources.training_args import workload_fields

        sub = workload_fields({"fsdp": fsdp, "fsdp_config": m.get("fsdp_config", dict) or {}}, name)
        _absorb(m.reading, sub)
    m.quiet(*QUIET)
    return m.finish()
