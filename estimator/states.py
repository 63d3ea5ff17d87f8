"""Model states per GPU: weights, gradients, optimizer states, master weights, optimizer
temporaries, ZeRO/DDP buffers, paged states and host (offloaded) bytes, after tensor/pipeline
division, ZeRO partitioning and offload.

Regimes (docs/design.md section 3): torch without ZeRO keeps weights, gradients and optimizer states
in the parameter dtype (AMP: fp32 everywhere; pure bf16: 2+2+4 B); DeepSpeed (ZeRO >= 1) with bf16/fp16
keeps half weights and gradients plus fp32 master weights and fp32 Adam states, and casts the half
gradients to an fp32 partition for the update while both are live (2+2+4+4+8 = 20 B before
partitioning, DeepSpeed's own estimator figure). A quantized base (QLoRA, LoRA on int8) goes
through peft's kbit preparation, which upcasts every non-quantized parameter to fp32.

`model_states` is memoised on a `StatesKey`, built from the Workload in one place (`states_key`):
the cached function sees nothing but its key, so it cannot depend on a field the key lacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from estimator import fsdp
from estimator.defaults import overhead
from estimator.lora_targets import adapter_shapes
from estimator.model import ModelSpec
from estimator.params import ParamCounts, count_params
from estimator.regimes import Regime, regime
from estimator.workload import INT4_QUANTS, Workload


class StatesKey(NamedTuple):
    """The Workload fields the model states read, and nothing else (`states_key` builds it).
    `training`, `amp` and `dp` are the Workload's own derivations, carried so no rule is restated."""

    model: ModelSpec
    method: str
    precision: str
    optimizer: str
    adamw_impl: str
    lora_rank: int
    lora_targets: tuple
    quant: str
    double_quant: bool
    zero: int
    offload: str
    tp: int
    pp: int
    dp: int
    training: bool
    amp: bool
    fsdp: str
    regime: Regime      # the stack's resolved dtypes and sharding (estimator.regimes)
    ep: int = 1         # expert parallel: the routed experts split over ep ranks
    fp8_gather: bool = False   # torchao float8 under FSDP2: converted linears all-gathered in fp8 (estimator.fp8)
    dora: bool = False         # DoRA: a trained magnitude vector per adapted linear (`lora_params`)
    train_vision: bool = False  # a VL model's full fine-tune trains its vision tower (`trained_elements`)


def states_key(w: Workload) -> StatesKey:
    """The `StatesKey` of `w` (the one place a Workload becomes one)."""
    return StatesKey(w.model, w.method, w.base_precision, w.optimizer, w.adamw_impl, w.lora_rank, w.lora_targets,
                     w.quant, w.double_quant, w.zero, w.offload, w.tp, w.pp, w.dp, w.training, w.amp,
                     w.fsdp, regime(w), w.ep, w.fp8 and w.fsdp != "none", w.dora, w.train_vision)


@dataclass(frozen=True)
class Sizes:
    """Element counts held by one GPU after tensor/pipeline parallel division."""

    linear_w: float
    linear_b: float
    other: float     # norms, routers, positions
    embed: float
    head: float      # untied lm_head weight and bias
    layers: int      # decoder layers on the busiest pipeline stage
    expert_w: float = 0.0   # the routed experts' weights among `linear_w` (after expert parallel)

    @property
    def total(self) -> float:
        return self.linear_w + self.linear_b + self.other + self.embed + self.head


def _layer_fraction(key: StatesKey | Workload) -> float:
    """Share of the decoder layers' parameters on the busiest GPU (pipeline stages, tensor ranks)."""
    layers = math.ceil(key.model.num_layers / key.pp)
    return layers / key.model.num_layers / key.tp


def local_sizes(key: StatesKey | Workload, params: ParamCounts) -> Sizes:
    """Model elements on the busiest GPU: layers split over pipeline stages, all over tensor ranks;
    with expert parallel (`ep` > 1) each rank holds num_experts / ep of every MoE layer's routed
    experts (weights and biases), the rest (attention, shared experts, routers, norms, embeddings)
    replicated: DeepSpeed-MoE / Megatron expert parallelism."""
    spec = key.model
    layers = math.ceil(spec.num_layers / key.pp)
    fraction = _layer_fraction(key)
    embed = (params.embedding + params.positions) / key.tp
    head = (params.lm_head + params.lm_head_bias) / key.tp
    if key.pp > 1:  # embedding on the first stage, lm_head on the last: the busier one counts
        embed, head = (embed, 0.0) if embed >= head else (0.0, head)
    ep = getattr(key, "ep", 1)
    expert_w = params.expert_weights / ep
    expert_b = sum(lin.bias_params for lin in params.linears if lin.expert)
    linear_w = params.linear_weights - params.expert_weights + expert_w
    linear_b = params.linear_biases - expert_b + expert_b / ep
    return Sizes(linear_w * fraction, linear_b * fraction,
                 (params.norms + params.router) * fraction + params.vision, embed, head, layers,
                 expert_w * fraction)   # a VL model's vision tower: whole, on the first stage


def lora_params(w: Workload | StatesKey, params: ParamCounts) -> int:
    """Trainable adapter parameters: r x (d_in + d_out) per module peft targets (estimator.lora_targets:
    fused MoE experts are not nn.Linear modules in transformers 5 and are never targeted), plus with
    DoRA one magnitude vector of d_out per adapted linear (`dora_params`)."""
    adapters = sum(w.lora_rank * (d_in + d_out) * n for d_in, d_out, n in adapter_shapes(w.model, w.lora_targets))
    return adapters + dora_params(w)


def dora_params(w: Workload | StatesKey) -> int:
    """DoRA's magnitude vectors: peft 0.21.2 `DoraLinearLayer.update_layer` makes `weight` = the
    column norm of W + scaling x BA, one element per output feature of every adapted linear
    (`lora_magnitude_vector`, trained, in the adapters' dtype); 0 without DoRA."""
    if not getattr(w, "dora", False):
        return 0
    return sum(d_out * n for _, d_out, n in adapter_shapes(w.model, w.lora_targets))


def _base_dtype_bytes(key: StatesKey) -> int:
    """Bytes per element of the model's non-quantized parameters after the stack's casts: as loaded
    (fp32 for fp32 and AMP, else 2), or half where DeepSpeed casts the module (estimator.regimes)."""
    return key.regime.base_bytes


def _quantized_linear_bytes(key: StatesKey, elements: float, rows: float) -> float:
    """bitsandbytes storage of `elements` linear weights with `rows` output rows in total."""
    if key.quant == "int8":
        return elements + 4 * rows  # int8 values + one fp32 scale per output row (LLM.int8)
    block = overhead("bnb_blocksize_4bit")
    if key.double_quant:  # 8-bit absmax per block, fp32 absmax per 256 blocks
        return elements * 0.5 + elements / block + 4 * elements / (block * overhead("bnb_blocksize_4bit_second"))
    return elements * 0.5 + 4 * elements / block


def int4_linear_bytes(quant: str, d_in: int, d_out: int) -> float:
    """One GPTQ or AWQ int4 linear as its checkpoint stores it (4 bits, `int4_group_size` input rows
    per group): the weight packed 8 values per int32 (`qweight`, 0.5 B per element), per group an
    fp16 scale per output column (`scales`) and a 4-bit zero packed 8 per int32 (`qzeros`); GPTQ
    also keeps an int32 group index per input row (`g_idx`). Layouts: GPTQ (AutoGPTQ/GPTQModel
    QuantLinear: qweight [in/8, out], qzeros [in/g, out/8], scales [in/g, out], g_idx [in]); AWQ
    (AutoAWQ WQLinear_GEMM: qweight [in, out/8], qzeros [in/g, out/8], scales [in/g, out]). The
    bias, where the linear has one, stays fp16 (counted with the unquantized parameters)."""
    groups = math.ceil(d_in / overhead("int4_group_size"))
    packed = d_in * d_out / 2 + groups * d_out * 2 + groups * math.ceil(d_out / 8) * 4
    return packed + (4 * d_in if quant == "gptq" else 0)


def mxfp4_bytes_per_element() -> float:
    """MXFP4 storage per weight element: two FP4 (E2M1) values per uint8 `_blocks` byte and one E8M0
    uint8 `_scales` byte per block of 32 (OCP Microscaling Formats (MX) v1.0 section 5; transformers
    5.23 integrations/mxfp4.py `convert_moe_packed_tensors`); the triton swizzled layout's padding is
    not counted."""
    return 0.5 + 1.0 / overhead("mxfp4_block_elements")


def weights_bytes(key: StatesKey, params: ParamCounts, sizes: Sizes) -> float:
    """Base weights on one GPU (adapters excluded).

    MXFP4 (GPT-OSS inference) packs the routed experts only (`mxfp4_bytes_per_element`).
    bitsandbytes replaces nn.Linear modules only: transformers 5 stores MoE experts as fused 3-D
    parameters, which stay unquantized. Training on a quantized base through peft's
    prepare_model_for_kbit_training upcasts every non-quantized parameter (embeddings, norms,
    lm_head, experts) to fp32 whatever the precision; without it (and for inference) they stay
    as loaded (`Regime.other_bytes`). A vision tower's linears are quantized with the decoder's.
    """
    base = _base_dtype_bytes(key)
    if key.quant == "none":
        return sizes.total * base
    if key.quant == "mxfp4":   # the routed experts' weights packed (biases and the rest as loaded)
        return sizes.expert_w * mxfp4_bytes_per_element() + (sizes.total - sizes.expert_w) * base
    if key.quant in INT4_QUANTS:   # the decoder's linears packed (int4_linear_bytes), the rest as loaded
        fraction = _layer_fraction(key)
        packed = sum(lin.count * int4_linear_bytes(key.quant, lin.d_in, lin.d_out) for lin in params.linears)
        return packed * fraction + (sizes.total - sizes.linear_w) * base
    fraction = _layer_fraction(key)
    dense = params.dense_linears
    quantized = sum(lin.weight_params for lin in dense) * fraction
    rows = sum(lin.d_out * lin.count for lin in dense) * fraction
    # a vision-language model's vision tower: its nn.Linear modules are quantized too (transformers
    # 5.23 replace_with_bnb_linear leaves out only lm_head, tied and last parameters), whole on one GPU
    vision = key.model.vision_linears
    quantized += sum(d_in * d_out * n for _, d_in, d_out, n in vision)
    rows += sum(d_out * n for _, _, d_out, n in vision)
    other = key.regime.other_bytes
    return _quantized_linear_bytes(key, quantized, rows) + (sizes.total - quantized) * other


def frozen_vision(key: StatesKey | Workload) -> int:
    """Elements of a VL model's vision tower that a full fine-tune leaves frozen: all of them unless
    --train-vision. Text-only batches give the tower no gradient (torch's optimizers then keep no state
    for it), and the VL fine-tuning stacks freeze it by default: LLaMA-Factory's `freeze_vision_tower`
    (hiyouga/LLaMA-Factory src/llamafactory/hparams/finetuning_args.py, default True) and ms-swift's
    `freeze_vit` (modelscope/ms-swift swift/arguments/tuner_args.py, default True). The HF Trainer
    alone trains it when images are in the batch (--train-vision; the images' activations are not
    modelled). profiler/build.py freezes it as this says."""
    return 0 if (key.method != "full" or key.train_vision) else key.model.vision_params


def trained_elements(key: StatesKey | Workload, params: ParamCounts, sizes: Sizes) -> float:
    """Trained elements on one GPU before ZeRO partitioning: the whole local model in a full
    fine-tune (but a frozen vision tower), else the adapters."""
    if key.method == "full":
        return sizes.total - frozen_vision(key)
    return lora_params(key, params) / (key.tp * key.pp)


@dataclass(frozen=True)
class Training:
    trainable: float       # trainable elements on this GPU before ZeRO partitioning
    param_bytes: int       # bytes per trainable element as stored
    state_bytes: int       # bytes per element of optimizer state dtype
    deepspeed_half: bool   # DeepSpeed mixed precision: fp32 master + fp32 gradient partition


def _training(key: StatesKey, params: ParamCounts, sizes: Sizes) -> Training:
    """The trained elements and their dtypes. peft keeps adapters in fp32 (autocast_adapter_dtype=True)
    whatever the base dtype; DeepSpeed's bf16/fp16 section casts them (and an AMP model) to half and
    keeps fp32 masters; accelerate's FSDP2 upcasts what trains to fp32 (estimator.regimes)."""
    rg = key.regime
    trainable = trained_elements(key, params, sizes)
    param_bytes = rg.trainable_bytes
    return Training(trainable, param_bytes, 4 if rg.deepspeed_half else param_bytes, rg.deepspeed_half)


def _trainable_tensors(key: StatesKey, params: ParamCounts) -> list[tuple[int, int]]:
    """(elements, how many) of every trainable tensor: the granularity of 8-bit optimizers."""
    spec = key.model
    if key.method != "full":
        return [tensor for d_in, d_out, n in adapter_shapes(spec, key.lora_targets)
                for tensor in ((key.lora_rank * d_in, n), (key.lora_rank * d_out, n))
                + (((d_out, n),) if key.dora else ())]
    out = [(lin.d_in * lin.d_out, lin.count) for lin in params.linears]
    out += [(lin.d_out, lin.count) for lin in params.linears if lin.bias]
    per_norm = spec.norm_tensors
    out.append((spec.hidden_size, per_norm * (spec.norms_per_layer * spec.num_layers + int(spec.final_norm))))
    if spec.qk_norm:
        out.append((spec.head_dim, per_norm * 2 * spec.num_layers))
    if spec.embed_norm:
        out.append((spec.embed_dim, per_norm))
    out += [(elements, 1) for elements in (params.embedding, params.lm_head, params.lm_head_bias, params.positions)
            if elements]
    if key.train_vision:   # the tower's linears, and the rest of it (patch embedding, norms, biases) as one
        out += [(d_in * d_out, n) for _, d_in, d_out, n in spec.vision_linears] + [(spec.vision_other_params, 1)]
    if params.router:
        out.append((params.router // max(spec.num_moe_layers, 1), max(spec.num_moe_layers, 1)))
    return out


def _bnb_8bit_state_bytes(key: StatesKey, params: ParamCounts) -> float:
    """bitsandbytes 8-bit Adam: two uint8 states + one fp32 absmax per block per state; tensors
    under min_8bit_size keep two fp32 states (8 B per element)."""
    limit, block = overhead("bnb_min_8bit_size"), overhead("bnb_blocksize_8bit_optimizer")
    total = 0
    for elements, count in _trainable_tensors(key, params):
        total += count * (8 * elements if elements < limit else 2 * elements + 8 * math.ceil(elements / block))
    return total


def _optimizer_bytes_per_param(key: StatesKey, state_bytes: int) -> float:
    if key.optimizer in ("adamw", "paged-adamw"):
        return 2 * state_bytes
    if key.optimizer == "sgd":
        return state_bytes
    return 0.0  # adafactor: counted from matrix shapes


def _adafactor_state(key: StatesKey, params: ParamCounts) -> float:
    """Adafactor (no first moment) keeps fp32 row and column second moments per matrix."""
    if key.method != "full":   # a DoRA magnitude vector is 1-D: Adafactor keeps it unfactored (d_out)
        return sum(4 * (key.lora_rank + d_in + key.lora_rank + d_out + (d_out if key.dora else 0)) * n
                   for d_in, d_out, n in adapter_shapes(key.model, key.lora_targets))
    spec = key.model
    total = sum(4 * (lin.d_in + lin.d_out) * lin.count for lin in params.linears)
    total += 4 * (spec.vocab_size + spec.embed_dim) * (1 if spec.tied_embeddings else 2)
    return total + 4 * (params.norms + params.router + params.linear_biases)


def _optimizer_temporaries(key: StatesKey, trained: Training, params: ParamCounts) -> float:
    """Extra memory inside optimizer.step() (torch implementations; DeepSpeed's are fused)."""
    if key.zero >= 1 or key.optimizer not in ("adamw", "sgd", "adafactor"):
        return 0.0
    largest = params.largest_layer if key.method == "full" else max(
        (key.lora_rank * max(d_in, d_out) for d_in, d_out, _ in adapter_shapes(key.model, key.lora_targets)),
        default=0)
    if key.optimizer == "adafactor":  # update and its factored estimate in fp32; half parameters
        return (2 + (2 if trained.param_bytes == 2 else 0)) * 4 * largest   # add fp32 grad and param copies
    if key.optimizer == "sgd" or key.adamw_impl == "fused":
        return 0.0
    if key.adamw_impl == "foreach":
        return trained.trainable * trained.state_bytes  # one intermediate list the size of all params
    return 2 * largest * trained.state_bytes     # single-tensor loop: two temporaries, largest param


def deepspeed_buckets(hidden_size: int) -> tuple[int, int]:
    """(reduce bucket, stage-3 prefetch bucket) in elements, as the HF integration fills DeepSpeed's
    `"auto"` values from the model's hidden size (transformers 5.23 integrations/deepspeed.py
    `trainer_config_finalize`, lines 232-241: hidden^2 and int(0.9 hidden^2)); profiler/zero.py
    configures the same sizes. DeepSpeed's own defaults (5e8 and 5e7, overheads.csv) apply only to a
    config that sets neither."""
    return hidden_size * hidden_size, int(0.9 * hidden_size * hidden_size)


@dataclass(frozen=True)
class States:
    sizes: Sizes
    trained: Training | None   # None for inference
    weights: float
    gradients: float
    optimizer: float
    master: float
    temporaries: float
    zero_buffers: float
    paged: float
    host: float


@lru_cache(maxsize=4096)
def model_states(key: StatesKey) -> States:
    """Weights, gradients, optimizer states and master weights per GPU, after ZeRO and offload,
    with the local sizes and the training precision plan they come from.

    They do not depend on batch or sequence, so planners that sweep those reuse them (cached on
    the key, which holds every field this reads).
    """
    params = count_params(key.model)
    sizes = local_sizes(key, params)
    base_weights = weights_bytes(key, params, sizes)
    if not key.training:
        return States(sizes, None, base_weights, 0, 0, 0, 0, 0, 0, 0)
    trained = _training(key, params, sizes)
    if key.fsdp != "none":
        return _fsdp_model_states(key, params, sizes, trained)
    dp, stage = key.dp, key.zero
    adapters = trained.trainable * trained.param_bytes if key.method != "full" else 0.0
    weights = base_weights + adapters
    grads = trained.trainable * trained.param_bytes
    per_param = _optimizer_bytes_per_param(key, trained.state_bytes)
    if key.optimizer == "adafactor":
        opt = _adafactor_state(key, params) / (key.tp * key.pp)
    elif key.optimizer.endswith("8bit"):
        opt = _bnb_8bit_state_bytes(key, params) / (key.tp * key.pp)
    else:
        opt = trained.trainable * per_param
    master = trained.trainable * 4 if trained.deepspeed_half else 0.0
    fp32_grad = trained.trainable * 4 if trained.deepspeed_half else 0.0
    temps = _optimizer_temporaries(key, trained, params)
    buffers = 0.0
    if stage >= 1:
        opt, master, fp32_grad = opt / dp, master / dp, fp32_grad / dp
    if stage == 3 and key.offload == "none":  # stage 3 makes fp32 gradients one sub-group at a time
        limit = overhead("zero3_sub_group_elements") + params.largest_layer / dp
        fp32_grad = min(fp32_grad, 4 * limit) if trained.deepspeed_half else fp32_grad
    reduce_bucket, prefetch_bucket = deepspeed_buckets(key.model.hidden_size)
    if stage >= 1:  # DeepSpeed allocates its reduce bucket at every stage, whatever the model size
        buffers = reduce_bucket * trained.param_bytes
    if stage >= 2:
        grads = grads / dp
    if stage == 3:
        weights = weights / dp
        # DeepSpeed's gathered largest layer: params + grads; with a frozen base (LoRA) the largest
        # layer is a frozen tensor (usually the embedding): gathered, with no gradient
        per_element = 2 * trained.param_bytes if key.method == "full" else key.regime.base_bytes
        buffers += (params.largest_layer / (key.tp * key.pp)) * per_element
        buffers += prefetch_bucket * trained.param_bytes
    if stage == 0 and dp > 1:
        buffers = grads  # DDP copies gradients into its own buckets (gradient_as_bucket_view=False)
    host = 0.0
    if key.offload != "none":
        host = opt + master + fp32_grad
        opt, master, fp32_grad = 0.0, 0.0, 0.0
        if stage >= 2:  # the half gradient partition lives on the CPU too (DeepSpeed offload path)
            host, grads = host + grads, 0.0
        if stage in (1, 2):  # stage_1_and_2.py: bf16 staging copy of the partition and a bf16 buffer
            host += trained.trainable / dp * trained.param_bytes + 2 * params.largest_layer  # of the largest param
    if key.offload == "optimizer+params":
        host += weights
        weights = 0.0
    paged = 0.0
    if key.optimizer.startswith("paged"):
        paged, opt = opt, 0.0
    # DeepSpeed casts the half gradient partition to fp32 before it frees the half gradients
    # (stage_1_and_2.py step()), so both are live at that moment: 2 + 2 + 4 + 4 + 8 = 20 B per
    # parameter at ZeRO-1 on one GPU, as DeepSpeed's own estimator counts (2P + 18P/N).
    return States(sizes, trained, weights, grads + fp32_grad, opt, master, temps, buffers, paged, host)


def _fsdp_model_states(key: StatesKey, params: ParamCounts, sizes: Sizes, trained: Training) -> States:
    """FSDP2: every state sharded over the shard group (padded per tensor, estimator.fsdp), the
    optimizer on the shards; buffers are the all-gathered copies and reduce-scatter inputs; CPU
    offload puts parameter, gradient and optimizer shards on the host."""
    rg, world = key.regime, key.regime.fsdp_shard
    adapters = [] if key.method == "full" else fsdp.adapter_tensors(key.model, key.lora_rank, key.lora_targets, key.dora)
    frozen = rg.other_bytes if key.quant != "none" else rg.base_bytes
    compute = 2 if rg.fsdp_mixed else 4
    shards = fsdp.fsdp_states(key.model, params, full=key.method == "full", quant=key.quant,
                              double_quant=key.double_quant, adapters=adapters, world=world, tp=key.tp,
                              frozen_bytes=frozen, trainable_bytes=trained.param_bytes, compute_bytes=compute,
                              reshard_after_forward=key.fsdp != "grad-op", fp8_gather=key.fp8_gather,
                              train_vision=key.train_vision)
    local = Training(shards.trainable, trained.param_bytes, trained.state_bytes, False)
    spread = world * key.tp
    if key.optimizer == "adafactor":
        opt = _adafactor_state(key, params) / spread
    elif key.optimizer.endswith("8bit"):
        opt = _bnb_8bit_state_bytes(key, params) / spread
    else:
        opt = local.trainable * _optimizer_bytes_per_param(key, local.state_bytes)
    weights, grads, host = shards.weights, shards.gradients, 0.0
    temps = _optimizer_temporaries(key, local, params)
    if key.offload != "none":   # CPUOffloadPolicy: shards and the optimizer step on the host
        host, weights, grads, opt, temps = weights + grads + opt, 0.0, 0.0, 0.0, 0.0
    paged = 0.0
    if key.optimizer.startswith("paged"):
        paged, opt = opt, 0.0
    return States(sizes, local, weights, grads, opt, 0.0, temps, shards.buffers, paged, host)
