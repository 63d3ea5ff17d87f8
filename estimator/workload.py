"""`Workload`: the one noun every part of the product speaks about.

A frozen, hashable description of one job on one kind of GPU: model, method, precision,
optimizer, sizes, parallelism. `validate()` turns impossible combinations into InputError.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from estimator.errors import InputError
from estimator.limits import check_count, limit
from estimator.tables import dtype_bytes
from estimator.model import ModelSpec
from estimator.lora_targets import LINEAR_ROUTER, is_all_linear, matched, targets_from_text

METHODS = ("full", "lora", "qlora", "inference")
PRECISIONS = ("fp32", "fp16", "bf16", "amp-fp16", "amp-bf16", "fp8")
FP8_BACKENDS = ("torchao", "te")   # accelerate's AO and TE fp8 backends (estimator.fp8)
OPTIMIZERS = ("adamw", "adamw-8bit", "paged-adamw", "paged-adamw-8bit", "sgd", "adafactor")
ADAMW_IMPLS = ("fused", "foreach", "single")
ATTENTIONS = ("eager", "sdpa", "flash")
NO_SDPA = ("bloom", "gemma2", "gptj", "gpt_oss")   # model_types transformers 5.23 builds with eager or flash_attention_2 only (_supports_sdpa False: Gemma-2 sets it, sdpa cannot soft-cap; BLOOM and GPT-J never set it)


def loaded_attn(model_type: str) -> str:
    """The attention transformers 5.23 builds a model with when none is asked for: SDPA, or eager
    for the model types without SDPA (`NO_SDPA`). Where a workload leaves `attn` unstated (flags,
    imported or stored rows, sweep cases), this is its attention."""
    return "eager" if model_type in NO_SDPA else "sdpa"
QUANTS = ("none", "int8", "nf4", "fp4", "mxfp4", "gptq", "awq")
BNB_QUANTS = ("int8", "nf4", "fp4")   # bitsandbytes: nn.Linear replaced, weights dequantized per matmul
# GPTQ and AWQ int4 checkpoints (transformers' GPTQ and AWQ quantizers): the decoder's nn.Linear
# weights packed 8 per int32 with a scale and a zero per group of input rows (estimator.states
# `int4_linear_bytes`); inference, and LoRA on a GPTQ base (gptqmodel's trainable TorchLinear:
# estimator.activations `int4_dequantized_bytes_per_layer`)
INT4_QUANTS = ("gptq", "awq")
# MXFP4 (transformers 5.23 quantizers/quantizer_mxfp4.py, integrations/mxfp4.py): GPT-OSS's fused experts
# as shipped (4-bit blocks and an 8-bit scale per 32 elements), run by the triton matmul_ogs kernels
# from the `kernels` package on CUDA compute capability 7.5+; inference only (is_trainable is False)
MXFP4_MODEL_TYPES = ("gpt_oss",)
OFFLOADS = ("none", "optimizer", "optimizer+params")
ZERO_STAGES = (0, 1, 2, 3)
FSDP_MODES = ("none", "full", "grad-op", "hybrid")  # FSDP2 fully_shard: reshard after forward or not, HSDP
KBIT_PREPS = ("auto", "on", "off")
# hf: transformers' loss from `labels` (ForCausalLMLoss: the logits upcast to fp32); model-dtype: a
# training loop's own cross_entropy on the logits as the model returns them (no upcast), e.g.
# universal-llm-trainer's models/*.py. Either way only the loss outlives the forward.
# hf-legacy: transformers before 4.46, as a loop that keeps the model's output to the backward runs
# it (AnswerDotAI fsdp_qlora train.py: `output = model(...)`, `output.loss.backward()`): the model's
# own loss (e.g. 4.37 LlamaForCausalLM.forward) upcasts the logits to fp32, returns them, and
# cross-entropy reads a contiguous copy of the shifted fp32 logits (`logits[..., :-1, :].contiguous()`;
# ForCausalLMLoss kept that copy until 4.49, huggingface/transformers#35646).
LOSSES = ("hf", "model-dtype", "hf-legacy", "chunked")
CHUNKED_LOSS_CHUNKS = 8   # torchtune CEWithChunkedOutputLoss num_output_chunks default
# model types whose CausalLM transforms the logits after the lm_head (soft-capping, a logit scale):
# a loop's own chunked output projection would skip it, so --loss chunked is refused there
SCALED_LOGITS = ("cohere", "cohere2", "granite", "granitemoe")
# auto: what the HF stack does with the trained parameters (peft's fp32 adapters, accelerate's fp32
# FSDP shards, DeepSpeed's fp32 master); model: the loop keeps them, their gradients and optimizer
# states in the model's dtype (torchtune, LitGPT bf16-true, AnswerDotAI fsdp_qlora --precision bf16)
TRAINABLE_DTYPES = ("auto", "model")
DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")  # peft's default for Llama-style models
# model types whose liger-kernel 0.8.5 patch cannot be imported under transformers 5.23: its
# transformers/model/output_classes.py defines the Liger output class only when transformers'
# one imports, so apply_liger_kernel_to_qwen2_5_vl / _qwen3_vl raise ImportError (checked in this
# environment); the value is the missing transformers class
LIGER_UNIMPORTABLE = {"qwen2_5_vl": "Qwen2_5_VLCausalLMOutputWithPast", "qwen3_vl": "Qwen3VLCausalLMOutputWithPast"}


def lora_targets_from_text(text: str) -> tuple[str, ...]:
    """`lora_targets` from its text form: all-linear, one regular expression (peft's string form,
    matched against whole module names), or a comma list of module names (estimator.lora_targets)."""
    return targets_from_text(text)


def method_defaults(values: dict) -> dict:
    """Settings as given plus what the method implies when not given: qlora stores nf4 weights.
    (The command lines and sweep files share this convenience.)"""
    if values.get("method") == "qlora" and "quant" not in values:
        return {**values, "quant": "nf4"}
    return values


@dataclass(frozen=True)
class Workload:
    """One job. Sizes: `batch` is the micro-batch per GPU, `seq` tokens per sample (the prompt
    for inference), `new_tokens` generated tokens (inference), `gpus` GPUs per node."""

    # Each field's metadata is its command-line flag (estimator/flags.py builds the flags of
    # scripts/estimate.py and scripts/profile.py from it): help, and where needed choices, metavar
    # and `parse` (text -> value). A bool defaulting to True becomes --no-<name>.
    model: ModelSpec = field(metadata=dict(
        help="config.json path (or its folder), catalog name (llama-3.1-8b) or Hub id", metavar="MODEL"))
    method: str = field(default="full", metadata=dict(help="what the job does", choices=METHODS))
    precision: str = field(default="bf16", metadata=dict(
        help="weights and compute dtype (amp-*: fp32 weights under autocast; fp8: float8 training (--fp8-backend), "
             "bf16 weights and states with the decoder linears' GEMMs in fp8, full fine-tune on fp8 GPUs)",
        choices=PRECISIONS))
    optimizer: str = field(default="adamw", metadata=dict(help="optimizer", choices=OPTIMIZERS))
    # HF Trainer's default optim is adamw_torch_fused (torch >= 2.8)
    adamw_impl: str = field(default="fused", metadata=dict(
        help="torch AdamW implementation (HF Trainer default: fused)", choices=ADAMW_IMPLS))
    batch: int = field(default=1, metadata=dict(help="micro-batch per GPU", metavar="B"))
    seq: int = field(default=512, metadata=dict(help="tokens per sample (the prompt for inference)",
                                                metavar="S"))
    new_tokens: int = field(default=0, metadata=dict(help="generated tokens (inference)", metavar="N"))
    grad_accum: int = field(default=1, metadata=dict(help="gradient accumulation steps", metavar="K"))
    lora_rank: int = field(default=16, metadata=dict(help="LoRA rank", metavar="R"))
    lora_targets: tuple[str, ...] = field(default=DEFAULT_LORA_TARGETS, metadata=dict(
        help="module names (the model's own: q_proj,v_proj, c_attn, query_key_value, lm_head, embed_tokens), "
             "one regular expression matched against whole module names, or all-linear (peft's rules)",
        metavar="q_proj,v_proj|REGEX|all-linear",
        parse=lora_targets_from_text))
    dora: bool = field(default=False, metadata=dict(
        help="DoRA (peft use_dora=True, LoRA/QLoRA): a trained magnitude vector per adapted linear, the "
             "weight norm recomputed every forward, base and adapter outputs saved"))
    lora_dropout: bool = field(default=False, metadata=dict(
        help="LoRA/QLoRA with peft lora_dropout > 0 (any probability): each adapted linear keeps its own "
             "dropped-out copy of its input for lora_A and a 1-byte mask (peft's default is 0; ms-swift's and "
             "many recipes' 0.05)"))
    grad_ckpt: bool = field(default=False, metadata=dict(help="gradient checkpointing"))
    attn: str = field(default="sdpa", metadata=dict(help="attention implementation", choices=ATTENTIONS))
    quant: str = field(default="none", metadata=dict(
        help="quantized weights: bitsandbytes int8/nf4/fp4 (default: nf4 with --method qlora, else none), "
             "GPT-OSS's MXFP4 experts as shipped, or a GPTQ/AWQ int4 checkpoint (4 bits, group 128; inference, "
             "and LoRA on GPTQ with --method lora)",
        choices=QUANTS))
    double_quant: bool = field(default=True, metadata=dict(help="QLoRA without double quantization"))
    gpus: int = field(default=1, metadata=dict(help="GPUs per node", metavar="N"))
    nodes: int = field(default=1, metadata=dict(help="nodes", metavar="N"))
    zero: int = field(default=0, metadata=dict(help="DeepSpeed ZeRO stage", choices=ZERO_STAGES))
    offload: str = field(default="none", metadata=dict(help="ZeRO offload to the host", choices=OFFLOADS))
    tp: int = field(default=1, metadata=dict(help="tensor parallel degree", metavar="N"))
    pp: int = field(default=1, metadata=dict(help="pipeline parallel degree", metavar="N"))
    ep: int = field(default=1, metadata=dict(
        help="expert parallel degree (MoE): each GPU holds num_experts / N routed experts of every MoE layer "
             "(their weights, gradients and optimizer states); N divides the experts and the GPUs",
        metavar="N"))
    fp8_backend: str = field(default="torchao", metadata=dict(
        help="the library --precision fp8 trains with: torchao (float8 training, accelerate's first choice) or "
             "te (Transformer Engine: accelerate's convert_model to te.Linear under fp8_autocast, delayed scaling)",
        choices=FP8_BACKENDS))
    compiled: bool = field(default=False, metadata=dict(
        help="inference: static KV cache + torch.compile (gpt-fast/torchao style) instead of eager generate; "
             "fp8 training: torch.compile fuses torchao's fp8 casts (the rest of the step as eager)"))
    fsdp: str = field(default="none", metadata=dict(
        help="FSDP2 (accelerate fully_shard): full shard, shard-grad-op (no reshard after forward) or hybrid "
             "(shard within a node, replicate across nodes); --offload moves the shards to the host",
        choices=FSDP_MODES))
    kbit_prep: str = field(default="auto", metadata=dict(
        help="peft's prepare_model_for_kbit_training on a quantized base (fp32 upcast of the non-quantized "
             "parameters); auto: on with the HF Trainer on one GPU or DDP/ZeRO-1/2, off under FSDP and ZeRO-3 "
             "(TRL skips it there)", choices=KBIT_PREPS))
    liger: bool = field(default=False, metadata=dict(
        help="Liger Kernel (use_liger_kernel): fused linear cross-entropy (no logits), fused RMSNorm, SwiGLU, RoPE"))
    train_vision: bool = field(default=False, metadata=dict(
        help="a vision-language model's full fine-tune trains its vision tower too (gradients and optimizer "
             "states; its image activations are not modelled). Default: frozen, as LLaMA-Factory "
             "(freeze_vision_tower) and ms-swift (freeze_vit) leave it and as a text-only batch does"))
    activation_offload: bool = field(default=False, metadata=dict(
        help="offload saved activations to host memory (TRL/torchtune activation_offloading)"))
    loss: str = field(default="hf", metadata=dict(
        help="training loss: hf = transformers' loss from labels (fp32 upcast of the logits; HF Trainer, TRL); "
             "model-dtype = a loop's own cross_entropy on the model's logits (no fp32 upcast); "
             "hf-legacy = transformers before 4.46 in a loop that keeps the output to the backward "
             "(fp32 logits returned and kept, a shifted fp32 copy; fsdp_qlora's train.py); chunked = torchtune's "
             "CEWithChunkedOutputLoss: the output projection and the fp32 loss in 8 chunks of the sequence",
        choices=LOSSES))
    trainable_dtype: str = field(default="auto", metadata=dict(
        help="dtype of the trained parameters, their gradients and optimizer states: auto = the HF stack's "
             "(peft fp32 adapters, accelerate's fp32 FSDP shards); model = kept in the model's dtype, no fp32 "
             "copy and no kbit preparation (torchtune, LitGPT bf16-true, fsdp_qlora's train.py)",
        choices=TRAINABLE_DTYPES))
    padding_mask: bool = field(default=False, metadata=dict(
        help="training batches padded to --seq with their attention mask (zeros on the padding): transformers "
             "hands SDPA a 4D mask, so PyTorch runs its memory-efficient kernel over every key block (no "
             "FlashAttention, no causal skipping); every position still computes"))

    @property
    def training(self) -> bool:
        return self.method != "inference"

    @property
    def world_size(self) -> int:
        return self.gpus * self.nodes

    @property
    def dp(self) -> int:
        """Data-parallel degree: the GPUs left after tensor and pipeline parallel."""
        return self.world_size // (self.tp * self.pp)

    @property
    def amp(self) -> bool:
        """fp32 weights kept, matmuls run in half precision under autocast."""
        return self.precision.startswith("amp-")

    @property
    def fp8(self) -> bool:
        """torchao float8 training (estimator.fp8): a bf16 model whose decoder linears run fp8 GEMMs."""
        return self.precision == "fp8"

    @property
    def te_fp8(self) -> bool:
        """fp8 training through Transformer Engine (--fp8-backend te; estimator.fp8)."""
        return self.precision == "fp8" and self.fp8_backend == "te"

    @property
    def base_precision(self) -> str:
        """The precision of everything but the converted linears' GEMMs: fp8 training keeps the
        bf16 stack's weights, gradients, optimizer states and activations (estimator.fp8)."""
        return "bf16" if self.precision == "fp8" else self.precision

    @property
    def compute_dtype(self) -> str:
        return self.base_precision.removeprefix("amp-")

    @property
    def activation_dtype_bytes(self) -> int:
        """Bytes per element of activations, logits and KV cache (the matmul dtype)."""
        return int(dtype_bytes(self.compute_dtype))

    @property
    def id(self) -> str:
        """Stable string id: model name and architecture fingerprint, then every field that
        differs from the default (two configs in folders of the same name stay apart)."""
        parts = [f"{self.model.name}#{self.model.fingerprint}"]
        for f in fields(self):
            if f.name == "model":
                continue
            value = getattr(self, f.name)
            if value != f.default:
                shown = ",".join(value) if isinstance(value, tuple) else value
                parts.append(f"{f.name}={shown}")
        return "|".join(parts)

    def with_(self, **changes) -> "Workload":
        """A copy with some fields changed (validated)."""
        return replace(self, **changes).validate()

    def validate(self) -> "Workload":
        """Return self, or raise InputError for the first impossible setting."""
        if self.__dict__.get("_valid"):  # frozen: once valid, always valid
            return self
        _check_choices(self)
        _check_sizes(self)
        _check_method(self)
        _check_parallel(self)
        _check_experts(self)
        _check_fp8(self)
        _check_vision(self)
        object.__setattr__(self, "_valid", True)
        return self


def _check_choices(w: Workload) -> None:
    for name, allowed in (("method", METHODS), ("precision", PRECISIONS), ("optimizer", OPTIMIZERS),
                          ("adamw_impl", ADAMW_IMPLS), ("attn", ATTENTIONS), ("quant", QUANTS),
                          ("offload", OFFLOADS), ("zero", ZERO_STAGES), ("fsdp", FSDP_MODES),
                          ("kbit_prep", KBIT_PREPS), ("loss", LOSSES), ("trainable_dtype", TRAINABLE_DTYPES),
                          ("fp8_backend", FP8_BACKENDS)):
        if getattr(w, name) not in allowed:
            raise InputError(f"{name} must be one of {', '.join(map(str, allowed))}; got {getattr(w, name)!r}")
    if not w.lora_targets or not all(isinstance(t, str) and t for t in w.lora_targets):
        raise InputError("LoRA targets must be module names, one regular expression or all-linear; got none")
    if w.method in ("lora", "qlora"):
        _check_wrappable(w)


def _check_vision(w: Workload) -> None:
    if w.train_vision and not w.model.vision_params:
        raise InputError(f"--train-vision: {w.model.name} has no vision tower")
    if w.train_vision and w.method != "full":
        raise InputError("--train-vision applies to a full fine-tune (with LoRA, --lora-targets decides which "
                         "vision linears get adapters)")


def _check_wrappable(w: Workload) -> None:
    """peft must match the targets (InputError when nothing matches, as peft raises) and its LoRA
    layer must be able to run each matched module. Llama-4's router (transformers 5.23
    Llama4Router) is an nn.Linear whose forward returns (scores, logits): peft 0.21.2 wraps it
    (all-linear or a pattern reach it), and its lora.Linear.forward then fails on the tuple
    (`result.dtype`), so the step never runs."""
    found = matched(w.model, w.lora_targets)
    if any(s.kind == "linear" and "router" in s.roles for s in found) and w.model.model_type in LINEAR_ROUTER:
        named = "all-linear" if is_all_linear(w.lora_targets) else ",".join(w.lora_targets)
        raise InputError(f"LoRA targets {named} reach {w.model.model_type}'s router "
                         "(Llama4Router, an nn.Linear returning (scores, logits)), whose peft LoRA layer fails on "
                         "the tuple at the first forward: leave it out with a pattern, e.g. "
                         "--lora-targets '.*\\.(q|k|v|o|gate|up|down)_proj'")


def _check_sizes(w: Workload) -> None:
    for name in ("batch", "seq", "grad_accum", "lora_rank", "gpus", "nodes", "tp", "pp", "ep"):
        check_count(name, getattr(w, name))       # positive and within estimator/data/limits.csv
    check_count("new_tokens", w.new_tokens, low=0)
    if w.seq + w.new_tokens > limit("seq"):
        raise InputError(f"seq + new_tokens = {w.seq + w.new_tokens:,} tokens exceeds {limit('seq'):,.0f}")


def _check_experts(w: Workload) -> None:
    """transformers 5.23 runs fused MoE experts through grouped_mm (integrations/moe.py), which
    takes bf16 only: experts in fp32 (an fp32 or AMP model, or kbit preparation's upcast of the
    unquantized fused experts under QLoRA) or fp16 fail in the real step (issue 16 item 9)."""
    # Llama4TextExperts: torch.bmm, any dtype; a config whose layers are all dense builds no experts
    if not w.model.is_moe or not w.model.num_moe_layers or w.model.model_type == "llama4_text":
        return
    from estimator.regimes import kbit_preparation_runs

    if w.precision in ("fp32", "amp-fp16", "amp-bf16", "fp16"):
        dtype = "fp16" if w.precision == "fp16" else "fp32"
        why = f"--precision {w.precision} keeps them in {dtype}"
    elif w.training and kbit_preparation_runs(w):
        why = "kbit preparation upcasts the unquantized fused experts to fp32 (--kbit-prep off keeps them bf16)"
    else:
        return
    raise InputError(f"{w.model.model_type} experts run through transformers 5.23's grouped_mm (on A100, H100 and newer: "
                     f"compute capability 8.0+), which takes bf16 "
                     f"only, and {why}: the step would fail; use bf16 experts")


def _check_method(w: Workload) -> None:
    if w.quant == "mxfp4":
        _check_mxfp4(w)
    if w.quant in INT4_QUANTS:
        _check_int4(w)
    if w.method == "qlora":
        if w.quant not in ("nf4", "fp4"):
            raise InputError("QLoRA stores the base weights in 4 bits: quant must be nf4 or fp4")
        if w.precision == "fp32":
            raise InputError(
                "QLoRA with fp32 base weights is impossible: the base is 4-bit; choose bf16 or fp16 as "
                "compute dtype (amp-bf16/amp-fp16 keep the non-quantized layers in fp32)")
    elif w.method == "full" and w.quant != "none":
        raise InputError("a full fine-tune cannot train quantized weights; use --method lora or qlora")
    elif w.method == "lora" and w.quant in ("nf4", "fp4"):
        raise InputError("LoRA on a 4-bit base is QLoRA: use --method qlora")
    if w.method == "inference" and (w.zero or w.offload != "none" or w.fsdp != "none"):
        raise InputError("ZeRO, FSDP and offload apply to training; inference takes --gpus with --tp or --pp instead")
    if not w.training and (w.liger or w.activation_offload or w.loss != "hf"):
        raise InputError("--liger, --activation-offload and --loss apply to training")
    if w.padding_mask and not w.training:
        raise InputError("--padding-mask applies to training (padded batches with their attention mask)")
    if w.padding_mask and w.attn == "flash":
        raise InputError("--padding-mask with --attn flash: transformers' FlashAttention unpads the batch and runs "
                         "the real tokens only; give those as --seq without --padding-mask")
    if w.trainable_dtype == "model" and not w.training:
        raise InputError("--trainable-dtype applies to training")
    if w.trainable_dtype == "model" and w.kbit_prep == "on":
        raise InputError("--kbit-prep on upcasts the non-quantized parameters to fp32: it contradicts "
                         "--trainable-dtype model (a loop that keeps the model's dtype skips it)")
    if w.trainable_dtype == "model" and w.zero:
        raise InputError("--trainable-dtype model with DeepSpeed ZeRO: ZeRO's bf16/fp16 sections keep fp32 master "
                         "weights whatever the loop does; drop --trainable-dtype")
    if w.loss == "chunked" and (w.model.logit_softcap or w.model.model_type in SCALED_LOGITS):
        raise InputError(f"--loss chunked: {w.model.model_type} transforms its logits after the lm_head (soft-capping "
                         "or a logit scale), which a loop's own chunked output projection would leave out: not modelled")
    if w.liger and w.loss != "hf":
        raise InputError("--liger replaces the loss with its fused linear cross-entropy: drop --loss")
    if w.liger and w.model.model_type in LIGER_UNIMPORTABLE:
        raise InputError(f"--liger: liger-kernel 0.8.5's patch for {w.model.model_type} fails to import under "
                         f"transformers 5.23 (its output class subclasses {LIGER_UNIMPORTABLE[w.model.model_type]}, "
                         "which transformers no longer defines), so use_liger_kernel=True stops there: drop --liger")
    if w.kbit_prep == "on" and (w.quant == "none" or not w.training):
        raise InputError("--kbit-prep on prepares a quantized base for training: use it with --method qlora "
                         "or --method lora --quant int8")
    if w.dora:
        _check_dora(w)
    if w.lora_dropout:
        _check_lora_dropout(w)
    if w.method != "inference" and w.new_tokens:
        raise InputError("--new-tokens applies to inference only")
    if w.method != "inference" and w.compiled and not w.fp8:
        raise InputError("--compiled applies to inference only (compiled decode with a static cache), and to "
                         "--precision fp8 training (torch.compile fusing torchao's fp8 casts)")
    if w.attn == "sdpa" and w.model.model_type in NO_SDPA:
        raise InputError(f"{w.model.model_type} has no SDPA attention in transformers 5.23 (the model refuses "
                         f"attn_implementation='sdpa'; loaded without one it runs eager): use --attn eager or flash")
    if w.attn == "flash" and w.compute_dtype == "fp32":
        raise InputError("FlashAttention runs in fp16/bf16 only; use sdpa or eager with fp32")
    if w.quant != "none" and w.compute_dtype == "fp32" and w.method == "inference":
        raise InputError("quantized inference computes in fp16/bf16; choose --precision bf16 or fp16")


def _check_mxfp4(w: Workload) -> None:
    if w.model.model_type not in MXFP4_MODEL_TYPES:
        raise InputError(f"MXFP4 replaces GPT-OSS's experts only (transformers 5.23 Mxfp4GptOssExperts); "
                         f"{w.model.model_type} has none: use --quant none, int8, nf4 or fp4")
    if w.training:
        raise InputError("MXFP4 weights do not train in transformers 5.23 (Mxfp4HfQuantizer.is_trainable is False): "
                         "load with Mxfp4Config(dequantize=True), whose experts are bf16: --quant none")


def _check_int4(w: Workload) -> None:
    name = w.quant.upper()
    if w.training:
        _check_int4_training(w)
    if w.model.is_moe:
        raise InputError(f"{name} on a MoE model is not modelled: transformers 5's fused experts are not the "
                         "nn.Linear modules GPTQ/AWQ checkpoints quantize")
    if w.model.vision_params:
        raise InputError(f"{name} on a vision-language model is not modelled (transformers' GPTQ quantizer takes "
                         "pure text models)")
    if w.model.model_type == "gpt2":
        raise InputError(f"{name} quantizes nn.Linear: GPT-2's Conv1D layers are not modelled")


def _check_int4_training(w: Workload) -> None:
    """LoRA on a GPTQ base as peft 0.21.2 runs it (tuners/lora/gptq.py GPTQLoraLinear over gptqmodel's
    QuantLinear). Training needs a trainable kernel (gptqmodel BaseQuantLinear.train refuses the others:
    GPTQConfig(backend="auto_trainable") picks TritonV2Linear or TorchLinear, which dequantize in
    every forward, estimator.activations `int4_dequantized_bytes_per_layer`); the rest is refused here."""
    name = w.quant.upper()
    if w.quant == "awq":
        raise InputError("LoRA on AWQ bases is not modelled (gptqmodel's AwqGEMMLinear saves its input and "
                         "repeats the dequantized weight per sequence in its backward); use --method inference, "
                         "--quant gptq, or --method qlora for a bitsandbytes base")
    if w.method != "lora":
        raise InputError(f"a {name} base trains through LoRA adapters: use --method lora --quant {w.quant}")
    if w.precision not in ("bf16", "fp16"):
        raise InputError(f"a {name} model trains in the half dtype it loads in (transformers 5 loads the "
                         "checkpoint's dtype; gptqmodel's kernels take fp16 or bf16), so TrainingArguments fp16=True "
                         "or bf16=True runs it in that dtype: choose --precision fp16 or bf16 (fp32 weights are not "
                         "modelled)")
    # ZeRO-1/2 partition what trains (the adapters' states); ZeRO-3 and FSDP shard parameters, and
    # the packed int4 weights are buffers, which they leave whole: not modelled
    for on, flag in ((w.zero == 3, "--zero 3"), (w.fsdp != "none", "--fsdp"),
                     (w.activation_offload, "--activation-offload"), (w.dora, "--dora"),
                     (w.tp > 1 or w.pp > 1, "--tp/--pp")):
        if on:
            why = {"--dora": "peft's GPTQLoraLinear refuses DoRA",
                   "--zero 3": "ZeRO-3 partitions parameters, not the packed int4 buffers",
                   "--fsdp": "FSDP shards parameters, not the packed int4 buffers"}.get(
                flag, "the saved dequantized weights are not modelled there")
            raise InputError(f"LoRA on a {name} base with {flag} is not modelled ({why})")


def _check_dora(w: Workload) -> None:
    """DoRA is a LoRA variant (peft `LoraConfig(use_dora=True)`): LoRA/QLoRA only, on linear modules.
    peft 0.21.2 refuses it on parameter targets (`ParamWrapper`: the fused MoE experts and routers it
    converts); DoRA on the embedding or lm_head (DoraEmbeddingLayer, a vocabulary-wide norm) is not
    modelled."""
    if w.method not in ("lora", "qlora"):
        raise InputError(f"--dora is a LoRA variant: use it with --method lora or qlora (got --method {w.method})")
    kinds = {s.kind for s in matched(w.model, w.lora_targets)}
    if kinds & {"router", "experts"}:
        raise InputError("peft 0.21 refuses DoRA on parameter targets (the fused MoE experts and router its "
                         "conversion targets): drop --dora or target the attention projections only")
    if kinds & {"embedding", "head"}:
        raise InputError("DoRA on the embedding or lm_head is not modelled: drop --dora or those targets")


def _check_lora_dropout(w: Workload) -> None:
    """peft applies lora_dropout in its Linear adapters (tuners/lora/layer.py Linear.forward:
    `lora_B(lora_A(dropout(x)))`); peft 0.21.2 refuses it on parameter targets (ParamWrapper
    `update_layer`: 'does not work with lora_dropout != 0'); DoRA with dropout recomputes the base
    output on the dropped-out input, which is not modelled."""
    if w.method not in ("lora", "qlora"):
        raise InputError(f"--lora-dropout applies to LoRA/QLoRA adapters (got --method {w.method})")
    if w.dora:
        raise InputError("DoRA with lora_dropout recomputes the base output on the dropped-out input: not "
                         "modelled; drop --lora-dropout or --dora")
    kinds = {s.kind for s in matched(w.model, w.lora_targets)}
    if kinds & {"router", "experts"}:
        raise InputError("peft 0.21 refuses lora_dropout on parameter targets (ParamWrapper: the fused MoE "
                         "experts and router): drop --lora-dropout or target the attention projections only")


def _check_fp8(w: Workload) -> None:
    """fp8 is torchao float8 *training* of full-precision nn.Linear weights (estimator.fp8 says what
    each library supports); anything else is refused in one line."""
    if not w.fp8:
        if w.fp8_backend != "torchao":
            raise InputError(f"--fp8-backend {w.fp8_backend} applies to --precision fp8")
        return
    from estimator.fp8 import refusal

    why = refusal(w)
    if why:
        raise InputError(why)


def _check_parallel(w: Workload) -> None:
    if w.world_size % (w.tp * w.pp):
        raise InputError(f"tp x pp = {w.tp * w.pp} must divide the {w.world_size} GPUs")
    if w.model.num_heads % w.tp or w.model.num_kv_heads % w.tp and w.tp % w.model.num_kv_heads:
        raise InputError(f"tensor parallel {w.tp} must divide the {w.model.num_heads} attention heads")
    if w.pp > w.model.num_layers:
        raise InputError(f"pipeline parallel {w.pp} exceeds the {w.model.num_layers} layers")
    if w.ep > 1:
        _check_expert_parallel(w)
    if w.fsdp != "none":
        if w.zero:
            raise InputError("FSDP and DeepSpeed ZeRO are alternatives: give --fsdp or --zero, not both")
        if w.pp > 1:
            raise InputError("FSDP shards data-parallel ranks: --pp is not modelled with --fsdp")
        if w.quant == "int8":
            raise InputError("bitsandbytes int8 weights do not shard under FSDP; use --method qlora (4-bit "
                             "weights stored as bf16 shard) or --zero")
    if w.offload != "none" and w.zero == 0 and w.fsdp == "none":
        raise InputError("offload needs ZeRO or FSDP: optimizer offload with --zero 1, 2 or 3, or --fsdp with --offload")
    if w.offload == "optimizer+params" and w.zero != 3 and w.fsdp == "none":
        raise InputError("parameter offload needs ZeRO stage 3 (--zero 3)")


def _check_expert_parallel(w: Workload) -> None:
    """Expert parallel splits the routed experts of every MoE layer over `ep` data-parallel ranks
    (DeepSpeed-MoE's ep_size, Megatron's expert-model-parallel-size): the model must be MoE, `ep`
    must divide its experts and the GPUs (the data-parallel ones, after tensor and pipeline
    parallel); ZeRO/FSDP sharding of the expert shards is not modelled."""
    spec = w.model
    if not spec.is_moe:
        raise InputError(f"--ep {w.ep} splits MoE experts, but {spec.name} ({spec.model_type}) has none")
    if spec.num_experts % w.ep:
        raise InputError(f"--ep {w.ep} must divide the {spec.num_experts} experts of {spec.name}")
    if w.world_size % w.ep or w.dp % w.ep:
        raise InputError(f"--ep {w.ep} must divide the {w.world_size} GPUs"
                         + (f" ({w.dp} data-parallel after tp x pp)" if w.dp != w.world_size else ""))
    if w.zero or w.fsdp != "none":
        raise InputError("--ep is modelled without ZeRO or FSDP (their sharding of the expert shards is not): "
                         "give --zero 0 and --fsdp none")
