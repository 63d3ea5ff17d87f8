"""Per-GPU memory of a Workload as a named breakdown in bytes, and the three peaks.

Phases of a training step (steady state, HF Trainer semantics: the outputs but the loss are
dropped before the backward, gradients set to None after each optimizer step). `components`
computes the named parts (`Components`) and `assemble` alone turns them into the peaks:
`peak_allocated_bytes` = persistent states + the larger of two working sets (`working_sets`):
- forward/backward = activations + logits_and_loss + autocast_weight_cache + quant_workspace
  (+ gradients already accumulated when grad_accum > 1). It is the largest of the moments that
  bound the forward and backward (`_forward_backward`): the loss in the forward, the loss in the
  backward (12 B x vocab per token of fp32 gradients), the lm_head's backward (full fine-tune),
  the first layer the backward reaches (its attention backward; with checkpointing, recomputed).
  `activations_bytes` is what autograd saved (plus one recomputed layer with checkpointing),
  `autocast_weight_cache_bytes` the half-precision weight casts alive then, and
  `logits_and_loss_bytes` the rest of that working set (mostly the loss's logits and gradients).
- optimizer step = gradients + optimizer_temporaries: what lives beyond the gradients once they
  are complete. That is the optimizer's temporaries, or, when it is larger and sets the peak, the
  end of the backward (full fine-tune): the last layer's attention backward while nearly every
  gradient exists, or the embedding's gradient beside a second one (tied lm_head, accumulation).
Inference: weights + KV cache + one layer's cache growth + the larger of the prefill working set
(a prefill layer's or the logits) and a dequantized weight (quantized base).
Every moment was checked against fake-tensor traces of the real step (profiler.trace;
tests/test_estimator_vs_trace.py, scripts/bench_tracer.py). A calibration table changes the
assembly only through `Corrections` (scales of three components, allocator reserve, constants);
the uncalibrated corrections are estimator.calibration.NONE's.

Regimes (docs/design.md section 3): torch without ZeRO keeps weights, gradients and optimizer states
in the parameter dtype (AMP: fp32 everywhere; pure bf16: 2+2+4 B); DeepSpeed (ZeRO >= 1) with bf16/fp16
keeps half weights and gradients plus fp32 master weights and fp32 Adam states, and casts the half
gradients to an fp32 partition for the update while both are live (2+2+4+4+8 = 20 B before
partitioning, DeepSpeed's own estimator figure). A quantized base (QLoRA, LoRA on int8) goes
through peft's kbit preparation, which upcasts every non-quantized parameter to fp32.

Memoised parts (model states, activation bytes per token) are functions of small key tuples
(`StatesKey`, estimator.activations.ActivationKey) built from the Workload in one place each:
the cached function sees nothing but its key, so it cannot depend on a field the key lacks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import NamedTuple

from estimator import activations as act
from estimator.activations import ActivationKey, activation_key
from estimator.defaults import overhead
from estimator.model import ModelSpec
from estimator.params import ParamCounts, count_params
from estimator.units import MiB
from estimator.workload import Workload

ALLOC_GRANULE_BYTES = 2 * MiB  # the caching allocator reserves in 2 MiB blocks (large segments)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU. The component fields add up to the peaks as the module docstring says."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_states_bytes: int
    master_weights_bytes: int
    activations_bytes: int
    logits_and_loss_bytes: int
    kv_cache_bytes: int
    optimizer_temporaries_bytes: int
    autocast_weight_cache_bytes: int
    quant_workspace_bytes: int
    zero_buffers_bytes: int
    paged_optimizer_bytes: int      # bitsandbytes paged states: unified memory, outside the allocator
    cuda_context_bytes: int
    nccl_buffers_bytes: int
    allocator_reserve_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_used_bytes: int
    host_bytes: int                 # CPU memory per GPU process for offloaded states
    peak_phase: str

    def to_dict(self) -> dict:
        return asdict(self)


# ---- the assembly of the peaks (the one place components become peaks) -----------------------

class Components(NamedTuple):
    """The named parts of the peaks, bytes per GPU, not yet rounded to whole bytes."""

    training: bool
    multi_gpu: bool                 # NCCL buffers exist (world size > 1)
    weights: float
    gradients: float
    optimizer_states: float
    master_weights: float
    zero_buffers: float
    paged_optimizer: float
    host: float
    activations: float              # saved activations (training) or the prefill working set
    logits_and_loss: float
    optimizer_temporaries: float
    autocast_weight_cache: float
    quant_workspace: float
    accumulated_gradients: float    # gradients alive in the forward/backward (grad_accum > 1)
    kv_cache: float
    kv_growth: float                # inference: one layer's cache copied while DynamicCache grows


class Corrections(NamedTuple):
    """What a calibration may change in the assembly (estimator.calibration.memory_corrections
    gives them; estimator.calibration.NONE's are the uncalibrated ones)."""

    reserve_fraction: float             # peak reserved = allocated x (1 + fraction) + bytes
    reserve_bytes: int
    cuda_context_bytes: int
    non_pytorch_bytes: int
    nccl_buffers_bytes: int             # per process, multi-GPU only
    allocated_constant_bytes: int
    activation_scale: float
    logits_scale: float
    optimizer_temporaries_scale: float


def working_sets(parts: Components, activation_scale: float = 1.0, logits_scale: float = 1.0,
                 temporaries_scale: float = 1.0) -> tuple[float, float, float]:
    """(persistent, first working set, second working set), bytes; the peak allocated is the
    persistent states plus the larger working set. Training: forward/backward and optimizer step;
    inference: the prefill's working set and a dequantized weight, each beside one layer's cache
    growth. The scales multiply their component where it lives."""
    if parts.training:
        persistent = parts.weights + parts.optimizer_states + parts.master_weights + parts.zero_buffers
        first = (parts.activations * activation_scale + parts.logits_and_loss * logits_scale
                 + parts.autocast_weight_cache + parts.quant_workspace + parts.accumulated_gradients)
        second = parts.gradients + parts.optimizer_temporaries * temporaries_scale
    else:
        persistent = parts.weights + parts.kv_cache
        first = parts.activations * activation_scale + parts.kv_growth
        second = parts.quant_workspace + parts.kv_growth   # a dequantized weight lives only in its matmul
    return persistent, first, second


def round_up(n_bytes: float, granule_bytes: int = ALLOC_GRANULE_BYTES) -> int:
    """`n_bytes` rounded up to a whole number of allocator blocks (bytes)."""
    return int(math.ceil(n_bytes / granule_bytes) * granule_bytes)


def assemble(parts: Components, corrections: Corrections) -> MemoryBreakdown:
    """The breakdown and the three peaks: allocated = persistent + the larger working set (the
    scales applied) + the constant; reserved = allocated x (1 + fraction) + bytes, rounded up to
    2 MiB; device used = reserved + CUDA context + NCCL (multi-GPU) + paged optimizer states +
    non-PyTorch bytes."""
    persistent, first, second = working_sets(parts, corrections.activation_scale, corrections.logits_scale,
                                             corrections.optimizer_temporaries_scale)
    if parts.training:
        phase = "forward/backward" if first >= second else "optimizer step"
    else:
        phase = "prefill"
    allocated = int(persistent + max(first, second)) + corrections.allocated_constant_bytes
    reserved = round_up(allocated * (1.0 + corrections.reserve_fraction) + corrections.reserve_bytes)
    nccl = corrections.nccl_buffers_bytes if parts.multi_gpu else 0
    device_used = (reserved + corrections.cuda_context_bytes + nccl + int(parts.paged_optimizer)
                   + corrections.non_pytorch_bytes)
    return MemoryBreakdown(
        weights_bytes=int(parts.weights), gradients_bytes=int(parts.gradients),
        optimizer_states_bytes=int(parts.optimizer_states), master_weights_bytes=int(parts.master_weights),
        activations_bytes=int(parts.activations * corrections.activation_scale),
        logits_and_loss_bytes=int(parts.logits_and_loss * corrections.logits_scale),
        kv_cache_bytes=int(parts.kv_cache),
        optimizer_temporaries_bytes=int(parts.optimizer_temporaries * corrections.optimizer_temporaries_scale),
        autocast_weight_cache_bytes=int(parts.autocast_weight_cache),
        quant_workspace_bytes=int(parts.quant_workspace), zero_buffers_bytes=int(parts.zero_buffers),
        paged_optimizer_bytes=int(parts.paged_optimizer), cuda_context_bytes=int(corrections.cuda_context_bytes),
        nccl_buffers_bytes=int(nccl), allocator_reserve_bytes=reserved - allocated,
        peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
        device_used_bytes=int(device_used), host_bytes=int(parts.host), peak_phase=phase,
    )


# ---- model states -----------------------------------------------------------------------------

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


def states_key(w: Workload) -> StatesKey:
    """The `StatesKey` of `w` (the one place a Workload becomes one)."""
    return StatesKey(w.model, w.method, w.precision, w.optimizer, w.adamw_impl, w.lora_rank, w.lora_targets,
                     w.quant, w.double_quant, w.zero, w.offload, w.tp, w.pp, w.dp, w.training, w.amp)


@dataclass(frozen=True)
class _Sizes:
    """Element counts held by one GPU after tensor/pipeline parallel division."""

    linear_w: float
    linear_b: float
    other: float     # norms, routers, positions
    embed: float
    head: float      # untied lm_head weight and bias
    layers: int      # decoder layers on the busiest pipeline stage

    @property
    def total(self) -> float:
        return self.linear_w + self.linear_b + self.other + self.embed + self.head


def _local_sizes(key: StatesKey | Workload, params: ParamCounts) -> _Sizes:
    """Model elements on the busiest GPU: layers split over pipeline stages, all over tensor ranks."""
    spec = key.model
    layers = math.ceil(spec.num_layers / key.pp)
    fraction = layers / spec.num_layers / key.tp
    embed = (params.embedding + params.positions) / key.tp
    head = (params.lm_head + params.lm_head_bias) / key.tp
    if key.pp > 1:  # embedding on the first stage, lm_head on the last: the busier one counts
        embed, head = (embed, 0.0) if embed >= head else (0.0, head)
    return _Sizes(params.linear_weights * fraction, params.linear_biases * fraction,
                  (params.norms + params.router) * fraction, embed, head, layers)


def lora_params(w: Workload | StatesKey, params: ParamCounts) -> int:
    """Adapter parameters: r x (d_in + d_out) per targeted linear (fused MoE experts excluded,
    as peft targets only nn.Linear modules in transformers 5)."""
    return sum(w.lora_rank * (lin.d_in + lin.d_out) * lin.count
               for lin in params.linears if lin.role in w.lora_targets and not lin.expert)


def _base_dtype_bytes(key: StatesKey) -> int:
    """Bytes per element of the model as loaded: fp32 for fp32 and AMP, else 2."""
    return 4 if key.precision == "fp32" or key.amp else 2


def _quantized_linear_bytes(key: StatesKey, elements: float, rows: float) -> float:
    """bitsandbytes storage of `elements` linear weights with `rows` output rows in total."""
    if key.quant == "int8":
        return elements + 4 * rows  # int8 values + one fp32 scale per output row (LLM.int8)
    block = overhead("bnb_blocksize_4bit")
    if key.double_quant:  # 8-bit absmax per block, fp32 absmax per 256 blocks
        return elements * 0.5 + elements / block + 4 * elements / (block * overhead("bnb_blocksize_4bit_second"))
    return elements * 0.5 + 4 * elements / block


def weights_bytes(key: StatesKey, params: ParamCounts, sizes: _Sizes) -> float:
    """Base weights on one GPU (adapters excluded).

    bitsandbytes replaces nn.Linear modules only: transformers 5 stores MoE experts as fused 3-D
    parameters, which stay unquantized. Training on a quantized base goes through peft's
    prepare_model_for_kbit_training, which upcasts every non-quantized parameter (embeddings,
    norms, lm_head, experts) to fp32 whatever the precision; inference keeps them as loaded.
    """
    base = _base_dtype_bytes(key)
    if key.quant == "none":
        return sizes.total * base
    fraction = sizes.linear_w / max(params.linear_weights, 1)
    dense = [lin for lin in params.linears if not lin.expert]
    quantized = sum(lin.weight_params for lin in dense) * fraction
    rows = sum(lin.d_out * lin.count for lin in dense) * fraction
    other = 4 if key.training else base
    return _quantized_linear_bytes(key, quantized, rows) + (sizes.total - quantized) * other


@dataclass(frozen=True)
class _Training:
    trainable: float       # trainable elements on this GPU before ZeRO partitioning
    param_bytes: int       # bytes per trainable element as stored
    state_bytes: int       # bytes per element of optimizer state dtype
    deepspeed_half: bool   # DeepSpeed mixed precision: fp32 master + fp32 gradient partition


def _training(key: StatesKey, params: ParamCounts, sizes: _Sizes) -> _Training:
    if key.method == "full":
        param_bytes = _base_dtype_bytes(key)
        deepspeed_half = key.zero >= 1 and param_bytes == 2
        return _Training(sizes.total, param_bytes, 4 if deepspeed_half else param_bytes, deepspeed_half)
    # peft keeps adapters in fp32 (autocast_adapter_dtype=True) whatever the base dtype
    return _Training(lora_params(key, params) / (key.tp * key.pp), 4, 4, False)


def _trainable_tensors(key: StatesKey, params: ParamCounts) -> list[tuple[int, int]]:
    """(elements, how many) of every trainable tensor: the granularity of 8-bit optimizers."""
    spec = key.model
    if key.method != "full":
        return [tensor for lin in params.linears if lin.role in key.lora_targets and not lin.expert
                for tensor in ((key.lora_rank * lin.d_in, lin.count), (key.lora_rank * lin.d_out, lin.count))]
    out = [(lin.d_in * lin.d_out, lin.count) for lin in params.linears]
    out += [(lin.d_out, lin.count) for lin in params.linears if lin.bias]
    per_norm = 2 if spec.norm == "layer" else 1
    out.append((spec.hidden_size, per_norm * (spec.norms_per_layer * spec.num_layers + int(spec.final_norm))))
    if spec.qk_norm:
        out.append((spec.head_dim, per_norm * 2 * spec.num_layers))
    if spec.embed_norm:
        out.append((spec.embed_dim, per_norm))
    out += [(elements, 1) for elements in (params.embedding, params.lm_head, params.lm_head_bias, params.positions)
            if elements]
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
    if key.method != "full":
        return sum(4 * (key.lora_rank + lin.d_in + key.lora_rank + lin.d_out) * lin.count
                   for lin in params.linears if lin.role in key.lora_targets and not lin.expert)
    spec = key.model
    total = sum(4 * (lin.d_in + lin.d_out) * lin.count for lin in params.linears)
    total += 4 * (spec.vocab_size + spec.embed_dim) * (1 if spec.tied_embeddings else 2)
    return total + 4 * (params.norms + params.router + params.linear_biases)


def _optimizer_temporaries(key: StatesKey, trained: _Training, params: ParamCounts) -> float:
    """Extra memory inside optimizer.step() (torch implementations; DeepSpeed's are fused)."""
    if key.zero >= 1 or key.optimizer not in ("adamw", "sgd", "adafactor"):
        return 0.0
    largest = params.largest_layer if key.method == "full" else max(
        (key.lora_rank * max(lin.d_in, lin.d_out) for lin in params.linears
         if lin.role in key.lora_targets and not lin.expert), default=0)
    if key.optimizer == "adafactor":  # update and its factored estimate in fp32; half parameters
        return (2 + (2 if trained.param_bytes == 2 else 0)) * 4 * largest   # add fp32 grad and param copies
    if key.optimizer == "sgd" or key.adamw_impl == "fused":
        return 0.0
    if key.adamw_impl == "foreach":
        return trained.trainable * trained.state_bytes  # one intermediate list the size of all params
    return 2 * largest * trained.state_bytes     # single-tensor loop: two temporaries, largest param


@dataclass(frozen=True)
class _States:
    sizes: _Sizes
    trained: _Training | None   # None for inference
    weights: float
    gradients: float
    optimizer: float
    master: float
    temporaries: float
    zero_buffers: float
    paged: float
    host: float


@lru_cache(maxsize=4096)
def _states(key: StatesKey) -> _States:
    """Weights, gradients, optimizer states and master weights per GPU, after ZeRO and offload,
    with the local sizes and the training precision plan they come from.

    They do not depend on batch or sequence, so planners that sweep those reuse them (cached on
    the key, which holds every field this reads).
    """
    params = count_params(key.model)
    sizes = _local_sizes(key, params)
    base_weights = weights_bytes(key, params, sizes)
    if not key.training:
        return _States(sizes, None, base_weights, 0, 0, 0, 0, 0, 0, 0)
    trained = _training(key, params, sizes)
    dp, stage = key.dp, key.zero
    adapters = trained.trainable * 4 if key.method != "full" else 0.0
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
    if stage >= 1:  # DeepSpeed allocates its reduce bucket at every stage, whatever the model size
        buffers = overhead("zero_reduce_bucket_elements") * trained.param_bytes
    if stage >= 2:
        grads = grads / dp
    if stage == 3:
        weights = weights / dp
        # DeepSpeed's gathered largest layer: params + grads
        buffers += (params.largest_layer / (key.tp * key.pp)) * 2 * trained.param_bytes
        buffers += overhead("zero3_prefetch_bucket_elements") * trained.param_bytes
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
    return _States(sizes, trained, weights, grads + fp32_grad, opt, master, temps, buffers, paged, host)


def _scale(w: Workload) -> float:
    """Activations on the busiest GPU per byte computed per token: pipeline stages keep up to pp
    micro-batches in flight (1F1B); tensor parallel splits them."""
    return w.batch * w.seq * w.pp / w.tp


@dataclass(frozen=True)
class _PerToken:
    """Bytes per token of the activation terms (activations.py), computed once per
    `ActivationKey` (architecture, method, precision, kernel, LoRA, checkpointing, sequence)."""

    layer: int         # one layer's saved tensors, eager scores included
    checkpoint: int    # one layer's checkpointed input
    outside: int       # final norm, lm_head input, ...
    top: int           # one layer at the peak of its backward
    logits_saved: int
    logits_forward: int
    logits_backward: int


@lru_cache(maxsize=4096)
def _per_token(key: ActivationKey) -> _PerToken:
    layer = act.layer_bytes_per_token(key) + act.score_bytes_per_token(key, key.seq)
    top = layer - act.mlp_bytes_per_token(key) + act.attention_backward_bytes_per_token(key, key.seq)
    return _PerToken(layer, act.checkpoint_bytes_per_token(key), act.outside_layers_bytes_per_token(key), top,
                     act.logits_saved_per_token(key), act.logits_forward_per_token(key),
                     act.logits_backward_per_token(key))


def saved_activation_bytes(w: Workload) -> int:
    """What autograd holds when the backward starts, per GPU (bytes): the layers' saved tensors
    (with checkpointing, their inputs), the final norm and lm_head input, log_softmax's output and,
    under autocast, the half-precision weight casts the matmuls saved."""
    params = count_params(w.model)
    sizes = _local_sizes(w, params)
    per_token = _per_token(activation_key(w))
    per_layer = per_token.checkpoint if w.grad_ckpt else per_token.layer
    total_per_token = sizes.layers * per_layer + per_token.outside + per_token.logits_saved
    return int(total_per_token * _scale(w) + _weight_casts(w, params, sizes, saved=True))


def _weight_casts(w: Workload, params: ParamCounts, sizes: _Sizes, saved: bool) -> float:
    """Half-precision weight casts alive under autocast (bytes per GPU).

    AMP: every linear weight fed to a matmul (decoder linears and the lm_head; experts run
    grouped_mm without autocast) is cast once per forward: trainable leaves are cached by autocast
    until the forward ends, frozen ones (LoRA) are cast at each use, and the matmul saves the cast
    for its input gradient either way. On a quantized base (QLoRA) only the fp32 lm_head is cast.
    With checkpointing the layers' casts are not saved (`saved`: alive when the backward starts).
    """
    if not (w.amp or (w.training and w.quant != "none")):
        return 0.0
    head = (sizes.head if sizes.head else sizes.embed) / (w.dp if w.zero == 3 else 1)
    if w.quant != "none":
        return 2 * head
    layers = 2 * sizes.linear_w * params.dense_fraction / (w.dp if w.zero == 3 else 1)
    cached = w.method == "full" and not saved    # the cache outlives checkpointed layers' forward
    if w.grad_ckpt and not cached:
        layers = 0.0
    return layers + 2 * head


@dataclass(frozen=True)
class _ForwardBackward:
    """The forward/backward working set at its peak (bytes per GPU, persistent states excluded)."""

    activations: float    # saved activations (plus one recomputed layer with checkpointing)
    casts: float          # autocast weight casts alive at the peak
    total: float          # the whole working set at the peak (gradients accumulated excluded)


def _forward_backward(w: Workload, per_token: _PerToken, params: ParamCounts, sizes: _Sizes,
                      trained: _Training) -> _ForwardBackward:
    """The largest of the moments that bound the forward/backward working set (`_moments`)."""
    tokens = _scale(w)
    acts = (sizes.layers * (per_token.checkpoint if w.grad_ckpt else per_token.layer) + per_token.outside) * tokens
    total, casts = max(_moments(w, per_token, params, sizes, trained, acts))
    if w.grad_ckpt:
        acts += per_token.layer * tokens           # the layer the backward recomputes
    return _ForwardBackward(acts, casts, total)


def _moments(w: Workload, per_token: _PerToken, params: ParamCounts, sizes: _Sizes, trained: _Training,
             acts: float) -> list:
    """(working set, weight casts alive) at each candidate moment, bytes per GPU:
    - forward, at the loss: saved activations + the loss's forward peak (logits, fp32 upcast,
      log_softmax output) + every autocast weight cast (the cache);
    - backward, at the loss: saved activations + 12 B x vocab per token of fp32 loss gradients;
    - backward, at the output layer (full fine-tune): the lm_head's weight gradient while the
      half-precision logits gradient is alive;
    - backward, in the first layer it reaches: that layer's attention backward (recomputed with
      checkpointing), the other layers' saved tensors and the lm_head's gradient (full).
    """
    tokens = _scale(w)
    casts_fwd = _weight_casts(w, params, sizes, saved=False)
    casts_bwd = _weight_casts(w, params, sizes, saved=True)
    moments = [(acts + casts_fwd + per_token.logits_forward * tokens, casts_fwd),
               (acts + casts_bwd + per_token.logits_backward * tokens, casts_bwd)]
    head_grad = 0.0
    if w.method == "full":
        head_grad = _head_grad_bytes(sizes, trained)
        moments.append((acts + casts_bwd + _output_layer_backward(w, sizes, trained), casts_bwd))
    below = acts - per_token.outside * tokens        # the layers' saved tensors
    if w.grad_ckpt:
        recompute_casts = (casts_fwd - casts_bwd) / max(sizes.layers, 1)
        top = below + per_token.top * tokens + recompute_casts
    else:
        top = below - per_token.layer * tokens + per_token.top * tokens
    moments.append((top + casts_bwd + head_grad, casts_bwd))
    return moments


def _head_grad_bytes(sizes: _Sizes, trained: _Training) -> float:
    """The lm_head (or tied embedding) weight gradient, in the parameter dtype."""
    return (sizes.head if sizes.head else sizes.embed) * trained.param_bytes


def _output_layer_backward(w: Workload, sizes: _Sizes, trained: _Training) -> float:
    """Backward through the lm_head: the half logits gradient and the weight gradient it makes
    (under AMP the half weight gradient and its fp32 cast are both alive for a moment)."""
    act_bytes = w.activation_dtype_bytes
    head = sizes.head if sizes.head else sizes.embed
    logits_grad = act_bytes * w.model.vocab_size * _scale(w)
    with_grad = logits_grad + head * act_bytes
    if trained.param_bytes != act_bytes:
        with_grad = max(with_grad, head * (act_bytes + trained.param_bytes))
    return with_grad


def _bottom_layer_backward(w: Workload, per_token: _PerToken, params: ParamCounts, sizes: _Sizes,
                           trained: _Training) -> float:
    """Beyond the gradients during the last layer the backward reaches (full fine-tune, no ZeRO):
    that layer's attention backward (`_PerToken.top`) while every gradient exists but
    its attention's and, untied, the embedding's."""
    if w.method != "full" or w.zero:
        return 0.0
    working = per_token.top * _scale(w)
    attention = params.attention_weights / (w.tp * w.pp)
    missing = (attention + (0 if w.model.tied_embeddings else sizes.embed)) * trained.param_bytes
    return max(0.0, working - missing)


def _end_of_backward(w: Workload, sizes: _Sizes, trained: _Training) -> float:
    """Beyond the gradients when the backward ends (full fine-tune, no ZeRO): the embedding's
    gradient made while a second one is alive, the lm_head's contribution to a tied embedding
    (summed in place by autograd) or the gradient accumulated from earlier micro-batches."""
    if w.method != "full" or w.zero:
        return 0.0
    copies = int(w.model.tied_embeddings) + int(w.grad_accum > 1)
    return copies * sizes.embed * trained.param_bytes


def kv_cache_bytes(spec: ModelSpec, batch: int, tokens: int, dtype_bytes: int, tp: int = 1) -> int:
    """2 (K and V) x layers x batch x cached tokens x kv heads x head_dim x bytes, per GPU.

    Sliding-window layers cache at most `sliding_window` tokens (transformers 5 DynamicCache).
    Tensor parallel splits kv heads; with more ranks than kv heads each rank keeps one whole head.
    """
    heads = spec.num_kv_heads // tp if spec.num_kv_heads >= tp else 1
    return 2 * batch * spec.attended_tokens(tokens) * spec.head_dim * heads * dtype_bytes


def inference_kv_bytes(spec: ModelSpec, batch: int, prompt: int, new_tokens: int, dtype_bytes: int,
                       tp: int = 1) -> int:
    """The largest KV cache held during generate: after the prefill, a sliding layer still holds
    the whole prompt (its window is a view of the prefill tensor until the first decode step)."""
    heads = spec.num_kv_heads // tp if spec.num_kv_heads >= tp else 1
    after_prefill = 2 * batch * spec.num_layers * prompt * spec.head_dim * heads * dtype_bytes
    return max(after_prefill, kv_cache_bytes(spec, batch, prompt + new_tokens, dtype_bytes, tp))


def kv_dtype_bytes(w: Workload) -> int:
    """Bytes per cached element. Under AMP rotary embeddings come out in fp32 (cos/sin follow the
    fp32 hidden states), so the cache, created in the key's dtype, holds fp32 keys and values."""
    spec = w.model
    rotary = spec.learned_positions == 0 and spec.model_type != "bloom"
    return 4 if (w.amp and rotary) else w.activation_dtype_bytes


def _inference_working_set(w: Workload, params: ParamCounts) -> float:
    """Largest transient of the prefill (no_grad) besides the KV cache: the larger of one layer's
    attention (q, k, v, output; eager: scores while softmax runs, the 4-D mask) and its MLP, with
    the residual stream, or the last position's logits; under AMP plus the weight cast of the
    matmul running (not cached without gradients: the lm_head's is the largest)."""
    key, spec = activation_key(w), w.model
    act_bytes, tokens = act.dtypes(key).compute, w.batch * w.seq
    attention = act.inference_attention_bytes_per_token(key, w.seq) * tokens
    mlp = act.inference_mlp_bytes_per_token(key) * tokens
    residual = act.inference_residual_bytes_per_token(key) * tokens
    casts = 2 * max(lin.d_in * lin.d_out for lin in params.linears) if w.amp else 0
    layer = (max(mlp, attention) + residual + casts) / w.tp
    head = 2 * (params.lm_head or params.embedding) if w.amp else 0
    logits = (w.batch * spec.vocab_size * act_bytes + head + act_bytes * spec.hidden_size * tokens) / w.tp
    return max(layer, logits)


def _quant_workspace(w: Workload, params: ParamCounts) -> float:
    """bitsandbytes dequantizes one weight to the compute dtype per matmul."""
    if w.quant == "none":
        return 0.0
    return 2 * max(lin.d_in * lin.d_out for lin in params.linears) / w.tp


def components(w: Workload) -> Components:
    """The named parts of `w`'s peaks, per GPU (bytes, unrounded); `assemble` makes the peaks."""
    spec, params = w.model, count_params(w.model)
    states = _states(states_key(w))
    sizes, trained = states.sizes, states.trained
    quant_workspace = _quant_workspace(w, params)
    temps = states.temporaries
    if not w.training:
        kv = inference_kv_bytes(spec, w.batch, w.seq, w.new_tokens, kv_dtype_bytes(w), w.tp)
        return Components(
            training=False, multi_gpu=w.world_size > 1, weights=states.weights, gradients=states.gradients,
            optimizer_states=states.optimizer, master_weights=states.master, zero_buffers=states.zero_buffers,
            paged_optimizer=states.paged, host=states.host, activations=_inference_working_set(w, params),
            logits_and_loss=0, optimizer_temporaries=temps, autocast_weight_cache=0,
            quant_workspace=quant_workspace, accumulated_gradients=0, kv_cache=kv,
            kv_growth=kv / spec.num_layers)  # DynamicCache grows by concatenation: one layer copied
    per_token = _per_token(activation_key(w))
    forward_backward = _forward_backward(w, per_token, params, sizes, trained)
    acts, casts = forward_backward.activations, forward_backward.casts
    logits = max(0.0, forward_backward.total - acts - casts - quant_workspace)
    accumulated = states.gradients if w.grad_accum > 1 else 0.0
    fwd_bwd = acts + logits + casts + quant_workspace + accumulated
    # once the gradients are (nearly) complete: the optimizer's temporaries, or the end of the
    # backward when that is larger and sets the peak (see the module docstring)
    late = max(temps, _end_of_backward(w, sizes, trained),
               _bottom_layer_backward(w, per_token, params, sizes, trained))
    if states.gradients + late > fwd_bwd:
        temps = late
    return Components(
        training=True, multi_gpu=w.world_size > 1, weights=states.weights, gradients=states.gradients,
        optimizer_states=states.optimizer, master_weights=states.master, zero_buffers=states.zero_buffers,
        paged_optimizer=states.paged, host=states.host, activations=acts, logits_and_loss=logits,
        optimizer_temporaries=temps, autocast_weight_cache=casts, quant_workspace=quant_workspace,
        accumulated_gradients=accumulated, kv_cache=0, kv_growth=0)


def estimate_memory(w: Workload, reserve_fraction: float, context_bytes: int) -> MemoryBreakdown:
    """The uncalibrated breakdown with the allocator's reserve fraction and the CUDA context given
    (every other correction at its uncalibrated value, estimator.calibration.NONE's)."""
    from estimator.calibration import NONE, memory_corrections  # calibration imports this module

    corrections = memory_corrections(NONE, w)[0]._replace(reserve_fraction=reserve_fraction,
                                                          cuda_context_bytes=context_bytes)
    return assemble(components(w), corrections)
