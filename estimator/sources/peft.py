"""peft `adapter_config.json` -> Workload fields (peft 0.21 `LoraConfig`)."""

from __future__ import annotations

from estimator.errors import InputError
from estimator.workload import lora_targets_from_text
from estimator.sources import Mapper, Reading, take_lora_dropout

QUIET = ("lora_alpha", "bias", "task_type", "base_model_name_or_path", "revision",
         "inference_mode", "fan_in_fan_out", "init_lora_weights", "use_rslora", "auto_mapping", "peft_version",
         "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "megatron_config",
         "megatron_core", "loftq_config", "layer_replication", "runtime_config", "lora_bias", "exclude_modules",
         "target_parameters", "trainable_token_indices", "eva_config", "corda_config", "qalora_group_size",
         "use_qalora", "alora_invocation_tokens", "arrow_config", "ensure_weight_tying")


def read(config: dict, name: str = "adapter config") -> Reading:
    m = Mapper(config, name)
    kind = m.get("peft_type", str)
    if kind is not None and kind.upper() != "LORA":
        raise InputError(f"{name}: peft_type {kind!r} is not modelled; only LORA adapters are")
    m.set("method", "lora", "peft_type" if kind else "(an adapter config)")
    m.take("r", "lora_rank", int)
    targets = m.get("target_modules", (str, list))
    if targets is not None:
        if isinstance(targets, list):
            if not all(isinstance(t, str) and t for t in targets):
                raise InputError(f"{name}: target_modules must be module names; got {targets!r}"[:200])
            text = ",".join(targets)
        else:                                  # peft: "all-linear", else one regex over whole names
            text = targets
        m.set("lora_targets", lora_targets_from_text(text), "target_modules")
    m.unmodelled("modules_to_save", "fully trained copies of these modules are not counted")
    m.take("use_dora", "dora", bool)
    take_lora_dropout(m, "lora_dropout", "use_dora")
    m.quiet(*QUIET)
    return m.finish()
