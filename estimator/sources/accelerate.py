"""An `accelerate config` YAML -> Workload fields (accelerate 1.x `commands/config/config_args.py`:
distributed_type, num_processes over num_machines, mixed_precision, fsdp_config, deepspeed_config)."""

from __future__ import annotations

from estimator.errors import InputError
from estimator.sources import Mapper, Reading

_STRATEGIES = {"FULL_SHARD": "full", "1": "full", "SHARD_GRAD_OP": "grad-op", "2": "grad-op",
               "HYBRID_SHARD": "hybrid", "4": "hybrid", "HYBRID_SHARD_ZERO2": "hybrid", "5": "hybrid"}


def read(config: dict, name: str = "accelerate config") -> Reading:
    m = Mapper(config, name)
    kind = m.get("distributed_type", str, "NO")
    machines = m.get("num_machines", int, 1)
    processes = m.get("num_processes", int)
    if machines < 1 or (processes is not None and (processes < 1 or processes % machines)):
        raise InputError(f"{name}: num_processes ({processes}) must be a positive multiple of num_machines ({machines})")
    if machines > 1:
        m.set("nodes", machines, "num_machines")
    if processes is not None:
        m.set("gpus", processes // machines, "num_processes / num_machines")
    precision = m.get("mixed_precision", str)
    if precision in ("bf16", "fp16"):
        m.set("precision", "bf16" if precision == "bf16" else "amp-fp16", "mixed_precision")
    elif precision not in (None, "no", "fp8"):
        raise InputError(f"{name}: mixed_precision must be no, fp16, bf16 or fp8; got {precision!r}")
    elif precision == "fp8":
        # accelerate 1.x: fp8_config.backend AO (torchao float8, also what backend NO picks first when
        # torchao is installed) is `--precision fp8`, TE `--fp8-backend te` (Transformer Engine with
        # TERecipeKwargs' delayed scaling, amax history 1024: estimator.fp8); MS-AMP is not modelled
        fp8 = m.get("fp8_config", dict) or {}
        backend = str(fp8.get("backend") or "AO").upper()
        if backend in ("AO", "NO", "TE"):
            m.set("precision", "fp8", "mixed_precision")
            if backend == "TE":
                m.set("fp8_backend", "te", "fp8_config.backend")
                history = fp8.get("amax_history_len", 1024)
                if history != 1024:
                    m.reading.unmodelled.append(f"{name}: fp8_config.amax_history_len = {history!r} (modelled: "
                                                "1024, accelerate's default; 20 B per row per te.Linear)")
        else:
            m.reading.unmodelled.append(f"{name}: mixed_precision = 'fp8' with backend {backend} (torchao float8, "
                                        "backend AO, and Transformer Engine, TE, are modelled)")
    fsdp = m.get("fsdp_config", dict)
    if kind == "FSDP":
        f = Mapper(fsdp or {}, f"{name}: fsdp_config", m.reading)
        strategy = str(f.get("fsdp_sharding_strategy", (str, int), "FULL_SHARD"))
        if f.get("fsdp_reshard_after_forward", (bool, str)) is False:   # FSDP2 spelling of grad-op
            strategy = "SHARD_GRAD_OP"
        if strategy not in _STRATEGIES:
            raise InputError(f"{name}: fsdp_sharding_strategy {strategy!r} is not one of "
                             f"{', '.join(k for k in _STRATEGIES if not k.isdigit())}")
        f.set("fsdp", _STRATEGIES[strategy], "fsdp_sharding_strategy")
        if f.get("fsdp_offload_params", bool):
            f.set("offload", "optimizer+params", "fsdp_offload_params")
        f.take("fsdp_activation_checkpointing", "grad_ckpt", bool)
        f.quiet("fsdp_auto_wrap_policy", "fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_version",
                "fsdp_cpu_ram_efficient_loading", "fsdp_state_dict_type", "fsdp_sync_module_states",
                "fsdp_transformer_layer_cls_to_wrap", "fsdp_use_orig_params", "fsdp_min_num_params")
        f.finish()
    ds = m.get("deepspeed_config", dict)
    if kind == "DEEPSPEED":
        d = Mapper(ds or {}, f"{name}: deepspeed_config", m.reading)
        d.take("zero_stage", "zero", int)
        if d.get("offload_param_device", str, "none") in ("cpu", "nvme"):
            d.set("offload", "optimizer+params", "offload_param_device")
        elif d.get("offload_optimizer_device", str, "none") in ("cpu", "nvme"):
            d.set("offload", "optimizer", "offload_optimizer_device")
        if d.has("deepspeed_config_file"):
            d.unmodelled("deepspeed_config_file", "pass it with --deepspeed")
        d.quiet("gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag", "zero3_save_16bit_model",
                "deepspeed_multinode_launcher")
        d.finish()
    if kind not in ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED"):
        m.reading.unmodelled.append(f"{name}: distributed_type = {kind!r} (modelled as data parallel)")
    m.quiet("compute_environment", "machine_rank", "main_training_function", "rdzv_backend", "same_network",
            "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "downcast_bf16", "enable_cpu_affinity",
            "debug", "gpu_ids", "main_process_ip", "main_process_port", "dynamo_config")
    return m.finish()
