"""A DeepSpeed config -> Workload fields, `"auto"` resolved as transformers' integration resolves it
(transformers 5.23 `integrations/deepspeed.py`: `trainer_config_process` fills bf16/fp16 from the
TrainingArguments; `trainer_config_finalize` fills reduce_bucket_size = hidden^2, and for ZeRO-3
stage3_prefetch_bucket_size = int(0.9 hidden^2) and stage3_param_persistence_threshold = 10 hidden).
The estimator models those "auto" sizes (estimator/states.py `deepspeed_buckets`); an explicit size
is listed as read but not modelled."""

from __future__ import annotations

from estimator.errors import InputError
from estimator.sources import Mapper, Reading

_AUTO_SIZED = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
               "allgather_bucket_size")


def read(config: dict, name: str = "DeepSpeed config") -> Reading:
    m = Mapper(config, name)
    for section, precision in (("bf16", "bf16"), ("fp16", "fp16")):
        sub = m.get(section, dict)
        if sub is not None:
            enabled = sub.get("enabled", False)
            if enabled is True:
                m.set("precision", precision, f"{section}.enabled")
            elif enabled not in (False, "auto"):
                raise InputError(f"{name}: {section}.enabled must be true, false or \"auto\"; got {enabled!r}")
            # "auto": filled from the TrainingArguments' bf16/fp16 (they set precision themselves)
    zero = m.get("zero_optimization", dict)
    if zero is not None:
        z = Mapper(zero, f"{name}: zero_optimization")
        stage = z.get("stage", int)
        if stage is not None:
            if stage not in (0, 1, 2, 3):
                raise InputError(f"{name}: zero_optimization.stage must be 0-3; got {stage}")
            z.set("zero", stage, "stage")
        opt = z.get("offload_optimizer", dict) or {}
        par = z.get("offload_param", dict) or {}
        devices = (opt.get("device", "none"), par.get("device", "none"))
        for device in devices:
            if device not in ("none", "cpu", "nvme", None):
                raise InputError(f"{name}: offload device must be none, cpu or nvme; got {device!r}")
        if devices[1] in ("cpu", "nvme"):
            z.set("offload", "optimizer+params", "offload_param.device")
        elif devices[0] in ("cpu", "nvme"):
            z.set("offload", "optimizer", "offload_optimizer.device")
        if "nvme" in devices:
            z.reading.unmodelled.append(f"{name}: offload to nvme (modelled as host memory offload)")
        for key in _AUTO_SIZED:
            value = z.get(key, (int, float, str))
            if value is not None and value != "auto":
                z.reading.unmodelled.append(f"{name}: zero_optimization.{key} = {value!r} (the estimate uses "
                                            f"the HF integration's \"auto\" size from the hidden size)")
        z.quiet("overlap_comm", "contiguous_gradients", "allgather_partitions", "reduce_scatter",
                "round_robin_gradients", "sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save")
        _merge(m.reading, z.finish())
    for key, field_name in (("train_micro_batch_size_per_gpu", "batch"), ("gradient_accumulation_steps", "grad_accum")):
        value = m.get(key, (int, str))
        if isinstance(value, int):
            m.set(field_name, value, key)
        elif value is not None and value != "auto":
            raise InputError(f"{name}: {key} must be an integer or \"auto\"; got {value!r}")
    m.quiet("train_batch_size",
            "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "optimizer", "scheduler",
            "zero_allow_untested_optimizer")
    return m.finish()


def _merge(into: Reading, sub: Reading) -> None:
    into.fields.update(sub.fields)
    into.origin.update(sub.origin)
    into.unmodelled += sub.unmodelled
    into.ignored += sub.ignored
