"""HF `TrainingArguments` / TRL `SFTConfig` -> Workload fields (transformers 5.23 `training_args.py`,
TRL `sft_config.py`). `workload_fields(args)` takes a plain dict of argument values (a file's
content, or `TrainingArguments.to_dict()` in a Trainer callback)."""

from __future__ import annotations

from pathlib import Path

from estimator.errors import InputError
from estimator.sources import Mapper, Reading

# transformers OptimizerNames -> (optimizer, adamw_impl or None); names not here are unmodelled
OPTIMIZERS = {
    "adamw_torch": ("adamw", "foreach"), "adamw_torch_fused": ("adamw", "fused"),
    "adamw_8bit": ("adamw-8bit", None), "adamw_bnb_8bit": ("adamw-8bit", None),
    "paged_adamw_32bit": ("paged-adamw", None), "paged_adamw_8bit": ("paged-adamw-8bit", None),
    "adafactor": ("adafactor", None), "sgd": ("sgd", None),
}
# the Trainer's default with torch >= 2.8 (training_args.py: default_optim)
DEFAULT_OPTIM = "adamw_torch_fused"
# keys that change neither memory, time nor cost (not listed as ignored)
QUIET = ("output_dir", "overwrite_output_dir", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
         "adam_epsilon", "max_grad_norm", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_ratio",
         "warmup_steps", "logging_dir", "logging_strategy", "logging_steps", "logging_first_step", "save_strategy",
         "save_steps", "save_total_limit", "seed", "data_seed", "report_to", "run_name", "push_to_hub",
         "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "disable_tqdm", "remove_unused_columns",
         "label_names", "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "do_train",
         "do_eval", "do_predict", "eval_strategy", "evaluation_strategy", "eval_steps", "dataloader_num_workers",
         "dataloader_pin_memory", "dataloader_drop_last", "dataset_text_field", "dataset_num_proc",
         "completion_only_loss", "assistant_only_loss", "optim_args", "log_level", "ddp_find_unused_parameters",
         "gradient_checkpointing_kwargs", "save_safetensors", "include_tokens_per_second", "neftune_noise_alpha",
         "max_steps", "per_device_eval_batch_size", "eval_accumulation_steps", "tf32", "torch_compile",
         "group_by_length", "label_smoothing_factor")


def workload_fields(args: dict, name: str = "training arguments", base_dir: Path | None = None) -> Reading:
    m = Mapper(args, name)
    m.take("per_device_train_batch_size", "batch", int)
    m.take("gradient_accumulation_steps", "grad_accum", int)
    m.take("gradient_checkpointing", "grad_ckpt", bool)
    for key in ("max_length", "max_seq_length"):            # TRL >= 0.20 max_length, earlier max_seq_length
        if m.has(key):
            m.take(key, "seq", int)
            break
    else:
        m.get("max_length"), m.get("max_seq_length")
    _precision(m)
    optim = m.get("optim", str)
    if optim is not None:
        if optim not in OPTIMIZERS:
            m.reading.unmodelled.append(f"{name}: optim = {optim!r} (not modelled: its states are counted as "
                                        f"AdamW's; known: {', '.join(OPTIMIZERS)})")
        else:
            optimizer, impl = OPTIMIZERS[optim]
            m.set("optimizer", optimizer, "optim")
            if impl:
                m.set("adamw_impl", impl, "optim")
    m.take("use_liger_kernel", "liger", bool)
    epochs = m.get("num_train_epochs", (int, float))
    if epochs is not None:
        m.reading.job["epochs"] = float(epochs)
        m.reading.origin["epochs"] = f"{name}: num_train_epochs"
    m.unmodelled("packing", "sequences are packed to max_length: the estimate uses seq = max_length")
    m.unmodelled("auto_find_batch_size", "the Trainer halves the batch on OOM; the estimate uses the given batch")
    m.unmodelled("torch_empty_cache_steps", "empty_cache between steps changes reserved memory only")
    m.take("activation_offloading", "activation_offload", bool)   # TRL's SFT/DPO/KTO/Reward configs
    ds = m.get("deepspeed", (str, dict))
    if ds is not None:
        from estimator.sources import deepspeed, load

        config = ds if isinstance(ds, dict) else load(_relative(ds, base_dir), "DeepSpeed config")
        sub = deepspeed.read(config, f"{name}: deepspeed" if isinstance(ds, dict) else str(ds))
        _absorb(m.reading, sub)
    _fsdp(m)
    m.quiet(*QUIET)
    return m.finish()


def _precision(m: Mapper) -> None:
    """bf16=True: transformers 5 loads the checkpoint's dtype (bf16) and autocasts to bf16 -> bf16;
    fp16=True: fp16 training needs fp32 master weights under a GradScaler -> amp-fp16."""
    bf16, fp16 = m.get("bf16", bool), m.get("fp16", bool)
    if bf16 and fp16:
        raise InputError(f"{m.name}: bf16 and fp16 are both true")
    if bf16:
        m.set("precision", "bf16", "bf16")
    elif fp16:
        m.set("precision", "amp-fp16", "fp16")


_FSDP_WORDS = {"full_shard": "full", "shard_grad_op": "grad-op", "hybrid_shard": "hybrid",
               "hybrid_shard_zero2": "hybrid"}


def _fsdp(m: Mapper) -> None:
    """`fsdp`: "full_shard auto_wrap [offload]" (or a list of those words); `fsdp_config` dict."""
    value = m.get("fsdp", (str, list))
    if value:
        words = value.split() if isinstance(value, str) else [str(w) for w in value]
        modes = [_FSDP_WORDS[w] for w in words if w in _FSDP_WORDS]
        if not modes:
            raise InputError(f"{m.name}: fsdp = {value!r} names no sharding strategy "
                             f"({', '.join(_FSDP_WORDS)})")
        m.set("fsdp", modes[0], "fsdp")
        if "offload" in words:
            m.set("offload", "optimizer+params", "fsdp (offload)")
    config = m.get("fsdp_config", dict)
    if config:
        sub = Mapper(config, f"{m.name}: fsdp_config")
        if sub.get("offload_params", bool) or sub.get("fsdp_offload_params", bool):
            sub.set("offload", "optimizer+params", "offload_params")
        for key in ("activation_checkpointing", "fsdp_activation_checkpointing"):
            sub.take(key, "grad_ckpt", bool)
        sub.quiet("transformer_layer_cls_to_wrap", "fsdp_transformer_layer_cls_to_wrap", "min_num_params",
                  "auto_wrap_policy", "fsdp_auto_wrap_policy", "backward_prefetch", "forward_prefetch",
                  "use_orig_params", "sync_module_states", "cpu_ram_efficient_loading", "limit_all_gathers",
                  "xla", "version", "fsdp_version", "state_dict_type", "fsdp_state_dict_type")
        _absorb(m.reading, sub.finish())


def _absorb(into: Reading, sub: Reading) -> None:
    """Fold a nested file's reading (a DeepSpeed file a recipe points to) into its parent's."""
    for key, value in sub.fields.items():
        into.fields[key] = value
        into.origin[key] = sub.origin[key]
    for key, value in sub.job.items():
        into.job[key] = value
        into.origin[key] = sub.origin[key]
    into.unmodelled += sub.unmodelled
    into.ignored += sub.ignored


def _relative(path: str, base_dir: Path | None) -> Path:
    p = Path(path)
    return p if p.is_absolute() or base_dir is None or not (base_dir / p).exists() else base_dir / p
