"""The training stack's own decisions, resolved once per Workload: which dtypes the parameters end up
in after the libraries' casts, whether peft's kbit preparation runs, how FSDP shards, and one line
saying why for every switch the estimator makes on its own (`Regime.notes`).

What each library does, read in its code (docs/design.md section 8):
- peft `prepare_model_for_kbit_training` (peft 0.21.2 utils/other.py lines 193-209): freezes the
  base and upcasts every fp16/bf16 parameter that is not a `Params4bit` to fp32. The HF Trainer
  recipe (peft's documentation) calls it; TRL skips it for "sharded QLoRA" (FSDP, ZeRO-3: the 4-bit
  weights live on cpu/meta when the trainer sees them) and its current SFTTrainer casts the
  adapters of a quantized model to bf16 (huggingface/trl f2cd577 trl/trainer/sft_trainer.py
  lines 1121-1130). `--kbit-prep auto` is on for the HF Trainer on one GPU or DDP/ZeRO-1/2, off
  under FSDP and ZeRO-3. For a GPTQ model (`is_gptq_quantized`) it skips the upcast: the
  non-quantized parameters stay as loaded whatever `--kbit-prep` says.
- DeepSpeed with a `bf16`/`fp16` section casts every floating parameter of the module to that
  dtype (deepspeed 0.19.8 runtime/engine.py `_cast_module_mixed_precision`, lines 1859-1862):
  LoRA adapters, kbit-prepared fp32 norms and the fp32 weights of an AMP model included; the
  ZeRO optimizer then keeps fp32 master weights of what trains.
- accelerate's FSDP2 (accelerate 1.15.0 utils/fsdp_utils.py `fsdp2_prepare_model`, lines 813-825):
  with mixed precision and no `Params4bit`, trainable parameters are upcast to fp32 (the sharded
  master copy); `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)` (utils/dataclasses.py
  `set_mixed_precision`, line 2137) all-gathers them in bf16 for compute and reduce-scatters bf16
  gradients into fp32 shards. QLoRA under FSDP needs `bnb_4bit_quant_storage=bf16` so the packed
  4-bit weights are floating and shard.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from estimator.workload import Workload

# model_types liger-kernel 0.8.5 patches (src/liger_kernel/transformers/monkey_patch.py
# MODEL_TYPE_TO_APPLY_LIGER_FN), among the architectures the estimator reads: what the HF Trainer
# does with use_liger_kernel=True, and so what the profiler builds
LIGER_PATCHED_TYPES = frozenset({
    "deepseek_v2", "deepseek_v3", "exaone4", "gemma", "gemma2", "gemma3_text", "glm4", "gpt_oss", "granite",
    "llama", "llama4_text", "mistral", "mixtral", "olmo2", "phi3", "qwen2", "qwen2_5_vl", "qwen3", "qwen3_moe",
    "qwen3_next", "qwen3_vl", "smollm3"})
# of those, the ones whose kernels the estimator models, each traced with the real kernels (Llama,
# Qwen2 and Gemma-2 in profiler/trace/grid.py `_liger`; Mistral, Qwen3, Gemma, Gemma-3, Phi-3,
# SmolLM3 and OLMo-2 (whose q/k norms Liger leaves as they are) at their catalog sizes, 2026-11-27;
# Mixtral, Qwen3-MoE, DeepSeek-V2/V3 and Qwen3-Next, whose experts Liger 0.8.5 replaces with its
# fused MoE kernel (ops/fused_moe.py; estimator.activations `_liger_moe`), and GPT-OSS (its RMSNorm
# and loss; its clamped-SwiGLU experts stay transformers'), 2026-11-27 too; GLM-4 (four RMSNorms per
# layer, Phi-3's fused SwiGLU) and EXAONE-4 (its q/k norms patched too) traced at hidden 1024,
# 2026-11-27; Llama-4 (RMSNorm, the dense and shared SwiGLUs, rope, fused loss; its experts stay
# transformers' bmm: tests/test_stacks.py at Scout's size, two layers) and Granite (its fused loss
# refuses Granite's scaled logits: Liger's cross_entropy on the materialised fp32 logits instead,
# `LIGER_UNFUSED_LOSS`), 2026-11-28. Qwen2.5-VL's and Qwen3-VL's patches do not import under
# transformers 5.23: --liger is refused there, estimator.workload LIGER_UNIMPORTABLE)
LIGER_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
                               "smollm3", "olmo2", "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3",
                               "qwen3_next", "gpt_oss", "glm4", "exaone4", "llama4_text", "granite"})
# of those, the ones whose loss Liger does not fuse with the lm_head: liger-kernel 0.8.5
# apply_liger_kernel_to_granite (fused_linear_cross_entropy refused, cross_entropy=True: it rebinds the
# torch.nn.functional.cross_entropy transformers' ForCausalLMLoss calls, ops/cross_entropy.py: the
# gradient written into the fp32 logits in place, which it saves)
LIGER_UNFUSED_LOSS = frozenset({"granite"})


def liger_fuses_loss(model_type: str) -> bool:
    """Whether Liger's patch for `model_type` replaces the loss with its fused linear cross-entropy."""
    return model_type not in LIGER_UNFUSED_LOSS


@dataclass(frozen=True)
class Regime:
    """Resolved stack decisions of one Workload (bytes per element where a dtype is meant)."""

    kbit_prep: bool          # peft's fp32 upcast of the non-quantized parameters ran
    deepspeed_half: bool     # DeepSpeed bf16/fp16 section: the whole module cast to half
    fsdp_shard: int          # ranks one FSDP shard group spans (1: no FSDP)
    fsdp_mixed: bool         # FSDP mixed precision: fp32 shards, half compute copies
    base_bytes: int          # non-quantized frozen (or fully trained) parameters as stored
    other_bytes: int         # non-quantized parameters of a quantized base (embeddings, norms, lm_head)
    adapter_bytes: int       # LoRA adapters as stored
    trainable_bytes: int     # trained parameters as stored (full: base after the stack's upcast)
    activation_precision: str  # the precision the activation formulas see (estimator.activations)
    activation_kbit: bool      # fp32 residual stream of a kbit-prepared model
    adapter_compute_bytes: int  # dtype adapters compute in (the fp32 cast peft makes, or none)
    liger: bool                 # Liger's kernels patch this model (--liger on a supported model_type)
    notes: tuple[str, ...]


def regime(w: Workload) -> Regime:
    """The `Regime` of `w` (cached on the fields it reads, and on the frozen Workload itself)."""
    cached = w.__dict__.get("_regime")
    if cached is not None:
        return cached
    cached = _regime(w.method, w.base_precision, w.quant, w.zero, w.fsdp, w.kbit_prep, w.offload,
                   w.gpus, w.nodes, w.tp, w.pp, w.liger, w.model.model_type, w.grad_accum > 1,
                   w.trainable_dtype == "model")
    if w.fp8:   # torchao float8: the bf16 stack's regime, plus what fp8 changes (estimator.fp8)
        from estimator.fp8 import notes

        cached = replace(cached, notes=cached.notes + notes(w))
    from estimator.states import frozen_vision   # states reads regimes: imported here

    if frozen_vision(w):
        cached = replace(cached, notes=cached.notes + (
            "vision tower frozen: a text-only batch gives it no gradient and LLaMA-Factory (freeze_vision_tower) "
            "and ms-swift (freeze_vit) freeze it by default, so it keeps no gradient or optimizer state "
            "(--train-vision to train it)",))
    object.__setattr__(w, "_regime", cached)
    return cached


def kbit_preparation_runs(w: Workload) -> bool:
    """Whether peft's prepare_model_for_kbit_training runs for `w` (the rule `--kbit-prep auto` follows)."""
    return _kbit_prep(w.method, w.quant, w.zero, w.fsdp, w.kbit_prep, w.trainable_dtype == "model")[0]


def _kbit_prep(method: str, quant: str, zero: int, fsdp: str, setting: str,
               model_dtype: bool = False) -> tuple[bool, str]:
    if method == "inference" or quant == "none":
        return False, ""
    if quant == "gptq":
        # peft 0.21.2 utils/other.py prepare_model_for_kbit_training: `is_gptq_quantized` skips the upcast
        return False, ("kbit preparation leaves a GPTQ model as loaded: peft's prepare_model_for_kbit_training "
                       "skips the fp32 upcast for GPTQ, so embeddings, norms and lm_head stay in the loaded dtype")
    if setting != "auto":
        return setting == "on", ""
    if model_dtype:
        return False, ("kbit preparation off: a loop that keeps the model's dtype (--trainable-dtype model) does "
                       "not run prepare_model_for_kbit_training")
    if fsdp != "none" or zero == 3:
        return False, ("kbit preparation off: TRL skips prepare_model_for_kbit_training for sharded QLoRA "
                       "(FSDP/ZeRO-3), so embeddings, norms and lm_head stay in the loaded dtype (--kbit-prep on "
                       "to force it)")
    return True, ("kbit preparation on: the HF Trainer + peft recipe upcasts embeddings, norms and lm_head "
                  "to fp32 and runs under autocast (--kbit-prep off for a stack that skips it)")


@lru_cache(maxsize=1024)
def _regime(method: str, precision: str, quant: str, zero: int, fsdp: str, kbit_setting: str, offload: str,
            gpus: int, nodes: int, tp: int, pp: int, liger_setting: bool, model_type: str,
            accumulating: bool = False, model_dtype: bool = False) -> Regime:
    notes: list[str] = []
    liger = liger_setting and model_type in LIGER_MODEL_TYPES
    if liger_setting and model_type not in LIGER_PATCHED_TYPES:
        notes.append(f"Liger Kernel has no kernels for model_type {model_type}: --liger changes nothing "
                     "(use_liger_kernel leaves the model as it is)")
    elif liger_setting and not liger:
        notes.append(f"Liger Kernel patches model_type {model_type}, but the estimator does not model its kernels "
                     "there: the memory shown is the model's without them")
    training = method != "inference"
    compute = precision.removeprefix("amp-")
    half = 2 if compute in ("bf16", "fp16") else 4
    loaded = 4 if (precision == "fp32" or precision.startswith("amp-")) else 2
    kbit, why = _kbit_prep(method, quant, zero, fsdp, kbit_setting, model_dtype)
    if why:
        notes.append(why)
    base, other, adapters = loaded, (4 if kbit else loaded), 4
    trainable = loaded if method == "full" else adapters
    act_precision, act_kbit, adapter_compute = precision, kbit, 4
    ds_half = training and zero >= 1 and half == 2
    fsdp_shard, fsdp_mixed = 1, False
    if ds_half:
        base = other = adapters = trainable = 2
        act_precision, act_kbit, adapter_compute = compute, False, 2
        notes.append(f"DeepSpeed {compute} section: the whole module is cast to {compute} (adapters and fp32 "
                     "layers included) and ZeRO keeps fp32 master weights and an fp32 gradient partition")
    if training and fsdp != "none":
        dp = gpus * nodes // (tp * pp)
        fsdp_shard = max(1, min(dp, gpus // tp)) if fsdp == "hybrid" else dp
        if fsdp == "hybrid" and nodes == 1:
            notes.append("hybrid shard on one node shards over all its GPUs: the same as full shard")
        fsdp_mixed = half == 2
        if fsdp_mixed:
            act_precision, act_kbit, adapter_compute = compute, False, 2
            if quant in ("nf4", "fp4"):
                adapters = 4 if kbit else 2
                trainable = adapters
                notes.append("FSDP QLoRA: 4-bit weights stored as bf16 (bnb_4bit_quant_storage) so they shard; no fp32 "
                             "upcast of the trainable parameters (accelerate skips it with Params4bit); adapters in "
                             f"{'fp32 (kbit preparation forced on)' if kbit else 'bf16 (TRL casts them)'}")
            elif not model_dtype:
                trainable = 4
                notes.append(f"FSDP mixed precision ({compute}): accelerate upcasts the trainable parameters to fp32 "
                             f"(sharded, with fp32 gradients and optimizer states); compute copies are all-gathered in "
                             f"{compute} and gradients reduce-scattered in {compute}")
        if accumulating:
            notes.append("FSDP with gradient accumulation: accelerate's no_sync keeps every unsharded gradient "
                         "between micro-batches (FSDP2 set_requires_gradient_sync(False))")
        if offload == "optimizer":
            notes.append("FSDP CPU offload (CPUOffloadPolicy) moves parameter, gradient and optimizer shards "
                         "together: --offload optimizer is modelled as optimizer+params")
    if training and model_dtype:
        # the loop keeps what trains in the model's dtype: adapters (or the weights), their gradients and
        # optimizer states; adapters compute in it (no fp32 cast of their inputs)
        adapters = trainable = loaded
        adapter_compute = loaded
        notes.append(f"trained parameters kept in the model's dtype ({'fp32' if loaded == 4 else compute}): "
                     "their gradients and optimizer states too, no fp32 copy (--trainable-dtype model)")
    return Regime(kbit, ds_half, fsdp_shard, fsdp_mixed, base, other, adapters, trainable, act_precision,
                  act_kbit, adapter_compute, liger, tuple(notes))
