"""Per-GPU memory of a Workload as a named breakdown in bytes, and the three peaks.

Phases of a training step (steady state, HF Trainer semantics: the outputs but the loss are
dropped before the backward, gradients set to None after each optimizer step). `components`
computes the named parts (`Components`) and `assemble` alone turns them into the peaks:
`peak_allocated_bytes` = persistent states + the larger of two working sets (`working_sets`):
- forward/backward = activations + logits_and_loss + autocast_weight_cache + quant_workspace
  (bitsandbytes' dequantized weight, or torchao float8's casts of one linear: `fp8_workspace`)
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
  gradient exists, or the embedding's gradient beside others (tied lm_head: summed out of place;
  accumulation).
Inference: weights + KV cache + one layer's cache growth + the larger of the prefill working set
(a prefill layer's or the logits) and a dequantized weight (quantized base). The decode's own peak
(`decode_peak_allocated_bytes`: the whole cache, a step's transient, no prefill working set) is
what a measurement over the decode alone sees.
Every moment was checked against fake-tensor traces of the real step (profiler.trace;
tests/test_estimator_vs_trace.py, scripts/bench_tracer.py). A calibration table changes the
assembly only through `Corrections` (scales of three components, allocator reserve, constants);
the uncalibrated corrections are estimator.calibration.NONE's.

Model states (weights, gradients, optimizer, ZeRO, offload) are estimator.states'.

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
from estimator import dora, fp8
from estimator.activations import ActivationKey, activation_key
from estimator.defaults import overhead
from estimator.lora_targets import matched
from estimator.model import ModelSpec
from estimator.params import ParamCounts, count_params
from estimator.regimes import regime
from estimator.states import Sizes, Training, dora_params, local_sizes, lora_params, model_states, states_key
from estimator.units import MiB
from estimator.workload import BNB_QUANTS, CHUNKED_LOSS_CHUNKS, INT4_QUANTS, Workload

ALLOC_GRANULE_BYTES = 2 * MiB  # the caching allocator reserves in 2 MiB blocks (large segments)
# Activation offloading (TRL's OffloadActivations, from torchtune; huggingface/trl v1.9.0 @f2cd577
# trl/models/activation_offloading.py; profiler/offload.py does the same with memory): every saved
# tensor of 1 KiB or more but the lm_head's goes to pinned host memory, except a later save of a
# storage offloaded a few saves before, which stays on the device (`act.offload_kept_bytes_per_token`);
# the forward keeps the 5 most recent on the device and the backward holds what it brought back
# until the next node has run: about one layer's saved tensors. With checkpointing (one saved input
# per layer) two layers' stay. TRL 0.25.0-1.7.x kept more (`legacy_offload_share`); the safe bound
# counts every offloaded byte as uncertain (estimator.bounds).
OFFLOAD_LAYERS_ON_DEVICE = 2


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
    blas_workspace_bytes: int = 0   # cuBLAS workspaces from the caching allocator (0: no GPU named)
    # saved activations the estimate puts in host memory (--activation-offload): how many TRL keeps on
    # the device is uncertain (estimator.bounds counts them in the bound's uncertain part)
    offloaded_activations_bytes: int = 0
    # the part of activations_bytes that is saved copies of weights (LoRA on GPTQ: the dequantized
    # linears), exact bytes the calibration does not scale (Components.weight_copies)
    weight_copies_bytes: int = 0
    # inference: the peak allocated of the decode alone (persistent states, the whole cache and a
    # decode step's transient, without the prefill's working set), what a measurement taken over the
    # decode sees; None in training
    decode_peak_allocated_bytes: int | None = None

    def to_dict(self) -> dict:
        """The fields, less the decode's peak in training (it has none)."""
        return {k: v for k, v in asdict(self).items() if v is not None or k != "decode_peak_allocated_bytes"}


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
    kv_growth: float                # inference: a decode step's transient (`_decode_transient`)
    kv_generated: float = 0.0       # inference: the part of kv_cache the decode adds after the prefill
    blas_workspace: float = 0.0     # cuBLAS workspaces (`blas_workspace_bytes`: needs the GPU)
    offloaded_activations: float = 0.0   # saved activations put in host memory (--activation-offload)
    # the part of `activations` that is saved copies of weights (LoRA on GPTQ: the dequantized
    # linears, estimator.activations `int4_dequantized_bytes_per_layer`): exact bytes, which the calibrated
    # activation scale (measured / formula activations) leaves alone (`scaled_activations`)
    weight_copies: float = 0.0


def scaled_activations(parts: Components) -> float:
    """The part of `parts.activations` the calibrated activation scale multiplies: all of it but
    the saved weight copies."""
    return parts.activations - parts.weight_copies


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
    inference: the prefill's working set beside the prompt's cache, and the decode's: the generated
    tokens' cache, a decode step's transient and a dequantized weight. The scales multiply their
    component where it lives."""
    if parts.training:
        persistent = (parts.weights + parts.optimizer_states + parts.master_weights + parts.zero_buffers
                      + parts.blas_workspace)
        first = (_activations(parts, activation_scale) + parts.logits_and_loss * logits_scale
                 + parts.autocast_weight_cache + parts.quant_workspace + parts.accumulated_gradients)
        second = parts.gradients + parts.optimizer_temporaries * temporaries_scale
    else:
        # the prompt's cache: the generated tokens' part exists in the decode only
        persistent = parts.weights + parts.kv_cache - parts.kv_generated + parts.blas_workspace
        first = _activations(parts, activation_scale)
        # a dequantized weight lives only in its matmul
        second = parts.kv_generated + parts.kv_growth + parts.quant_workspace
    return persistent, first, second


def _activations(parts: Components, activation_scale: float) -> float:
    return scaled_activations(parts) * activation_scale + parts.weight_copies


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
        phase = "prefill" if first >= second else "decode"
    allocated = int(persistent + max(first, second)) + corrections.allocated_constant_bytes
    decode = None if parts.training else int(persistent + second) + corrections.allocated_constant_bytes
    reserved = round_up(allocated * (1.0 + corrections.reserve_fraction) + corrections.reserve_bytes)
    nccl = corrections.nccl_buffers_bytes if parts.multi_gpu else 0
    device_used = (reserved + corrections.cuda_context_bytes + nccl + int(parts.paged_optimizer)
                   + corrections.non_pytorch_bytes)
    return MemoryBreakdown(
        weights_bytes=int(parts.weights), gradients_bytes=int(parts.gradients),
        optimizer_states_bytes=int(parts.optimizer_states), master_weights_bytes=int(parts.master_weights),
        activations_bytes=int(_activations(parts, corrections.activation_scale)),
        logits_and_loss_bytes=int(parts.logits_and_loss * corrections.logits_scale),
        kv_cache_bytes=int(parts.kv_cache),
        optimizer_temporaries_bytes=int(parts.optimizer_temporaries * corrections.optimizer_temporaries_scale),
        autocast_weight_cache_bytes=int(parts.autocast_weight_cache),
        quant_workspace_bytes=int(parts.quant_workspace), zero_buffers_bytes=int(parts.zero_buffers),
        paged_optimizer_bytes=int(parts.paged_optimizer), cuda_context_bytes=int(corrections.cuda_context_bytes),
        nccl_buffers_bytes=int(nccl), allocator_reserve_bytes=reserved - allocated,
        peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
        device_used_bytes=int(device_used), host_bytes=int(parts.host), peak_phase=phase,
        blas_workspace_bytes=int(parts.blas_workspace),
        offloaded_activations_bytes=int(parts.offloaded_activations),
        weight_copies_bytes=int(parts.weight_copies), decode_peak_allocated_bytes=decode,
    )


def _activation_key(w: Workload) -> ActivationKey:
    """`activation_key(w)`, kept on the frozen Workload (several parts of one estimate read it)."""
    key = w.__dict__.get("_activation_key")
    if key is None:
        key = activation_key(w)
        object.__setattr__(w, "_activation_key", key)
    return key


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
    if getattr(key.model, "card_path", ""):   # structure card (estimator/cards.py): traced per regime
        from estimator.cards import per_token
        return _PerToken(*per_token(key))
    layer = act.layer_bytes_per_token(key) + act.score_bytes_per_token(key, key.seq)
    top = act.top_layer_backward_bytes_per_token(key, key.seq)
    return _PerToken(layer, act.checkpoint_bytes_per_token(key), act.outside_layers_bytes_per_token(key), top,
                     act.logits_saved_per_token(key), act.logits_forward_per_token(key),
                     act.logits_backward_per_token(key))


def legacy_offload_share() -> tuple[float, float]:
    """(lowest, highest) share of the offloaded bytes that TRL 0.25.0 to 1.7.x also kept on the
    device: it keyed an offloaded storage by its address to the end of the forward, so a tensor the
    caching allocator put where a freed offloaded one was counted as offloaded (huggingface/trl#6241
    fixed it in 1.8.0). What stays follows the allocator's layout, not a rule: the range traced and
    measured (estimator/data/overheads.csv activation_offload_address_reuse_min/_max)."""
    return overhead("activation_offload_address_reuse_min"), overhead("activation_offload_address_reuse_max")


def _layers_on_device(w: Workload, sizes: Sizes, per_layer: float) -> tuple[int, float]:
    """(decoder layers whose saved tensors are all on the device, bytes per token the other layers
    keep there), `per_layer` being one layer's saved bytes per token. Without activation offloading
    every layer's; with it (TRL) about one layer in flight plus the later saves of each offloaded
    storage, or two layers' checkpointed inputs."""
    if not w.activation_offload:
        return sizes.layers, 0.0
    if w.grad_ckpt:
        return min(sizes.layers, OFFLOAD_LAYERS_ON_DEVICE), 0.0
    on_device = min(sizes.layers, 1)
    return on_device, (sizes.layers - on_device) * act.offload_kept_bytes_per_token(_activation_key(w))


def saved_activation_bytes(w: Workload) -> int:
    """What autograd holds when the backward starts, per GPU (bytes): the layers' saved tensors
    (with checkpointing, their inputs), the final norm and lm_head input, log_softmax's output and,
    under autocast, the half-precision weight casts the matmuls saved; the fp32 logits a loop keeps
    to the backward's end (--loss hf-legacy)."""
    params = count_params(w.model)
    sizes = local_sizes(w, params)
    per_token = _per_token(_activation_key(w))
    per_layer = per_token.checkpoint if w.grad_ckpt else per_token.layer
    # offloading: the forward stash's last 5 tensors are in flight, counted as one layer (an upper bound)
    on_device, kept = _layers_on_device(w, sizes, per_layer)
    total_per_token = (on_device * per_layer + kept + per_token.outside + per_token.logits_saved
                       + act.logits_kept_per_token(_activation_key(w)))
    fixed = 0 if w.grad_ckpt else on_device * act.layer_fixed_bytes(_activation_key(w))
    liger = _liger_saved_head_grad(w, sizes, model_states(states_key(w)).trained)
    return int(total_per_token * _scale(w) + fixed + _weight_casts(w, params, sizes, saved=True) + liger)


def _weight_casts(w: Workload, params: ParamCounts, sizes: Sizes, saved: bool) -> float:
    """Half-precision weight casts alive under autocast (bytes per GPU).

    AMP: every linear weight fed to a matmul (decoder linears and the lm_head; experts run
    grouped_mm without autocast, but Llama-4's run torch.bmm, which autocast casts) is cast once per
    forward: trainable leaves are cached by autocast until the forward ends, frozen ones (LoRA) are
    cast at each use, and the matmul saves the cast for its input gradient either way. On a
    quantized base (QLoRA) only the fp32 lm_head is cast, and Llama-4's expert parameters, which
    bitsandbytes leaves unquantized (it replaces nn.Linear only) and kbit preparation makes fp32.
    With checkpointing the layers' casts are not saved (`saved`: alive when the backward starts).
    Liger's fused loss casts the lm_head per chunk and saves none of it (`_liger_loss_bytes`).
    """
    key = _activation_key(w)   # the precision after the stack's casts (FSDP, DeepSpeed: no autocast casts)
    if not (key.amp or (w.training and key.kbit_prep) or key.te):
        return 0.0
    head = _head_cast(w, sizes) / 2
    if act.liger_fused_loss(key) and saved:   # Liger's loss casts the lm_head inside its fused function, saves none
        head = 0.0
    layers = _layer_casts(w, sizes)
    cached = w.method == "full" and not saved    # the cache outlives checkpointed layers' forward
    if w.grad_ckpt and not cached:
        layers = 0.0
    return layers + 2 * head


def _layer_casts(w: Workload, sizes: Sizes) -> float:
    """The decoder layers' half-precision weight casts under autocast (bytes per GPU; 0 without
    autocast): every linear's but the quantized ones (a QLoRA base) and the grouped experts', and
    Llama-4's expert parameters, which its torch.bmm casts (bitsandbytes leaves them unquantized:
    it replaces nn.Linear only; kbit preparation makes them fp32). Transformer Engine: every
    te.Linear's fp8 weight copy, saved from its forward to its backward (estimator.fp8)."""
    key = _activation_key(w)
    if key.te:
        return fp8.TE_WEIGHT_COPY_BYTES * (sizes.linear_w - sizes.expert_w)
    if not (key.amp or (w.training and key.kbit_prep)):
        return 0.0
    experts = sizes.expert_w if act.dense_experts(key.model) else 0.0
    linears = sizes.linear_w - sizes.expert_w if w.quant == "none" else 0.0
    return 2 * (linears + experts) / (w.dp if w.zero == 3 else 1)


def _head_cast(w: Workload, sizes: Sizes) -> float:
    """The lm_head's half-precision autocast cast (bytes; 0 without autocast); Transformer Engine:
    its te.Linear's fp8 weight copy. A loop's chunked output projection (`--loss chunked`) calls a
    frozen lm_head once per chunk, and autocast caches no cast of a frozen weight: one saved cast
    per chunk."""
    key = _activation_key(w)
    if key.te:
        head = (sizes.head if sizes.head else sizes.embed) if fp8.te_head_converted(w.model) else 0.0
        return fp8.TE_WEIGHT_COPY_BYTES * head
    if not (key.amp or (w.training and key.kbit_prep)):
        return 0.0
    casts = CHUNKED_LOSS_CHUNKS if (w.training and w.loss == "chunked" and w.method != "full") else 1
    return casts * 2 * (sizes.head if sizes.head else sizes.embed) / (w.dp if w.zero == 3 else 1)


@dataclass(frozen=True)
class _ForwardBackward:
    """The forward/backward working set at its peak (bytes per GPU, persistent states excluded)."""

    activations: float    # saved activations (plus one recomputed layer with checkpointing)
    casts: float          # autocast weight casts alive at the peak
    total: float          # the whole working set at the peak (gradients accumulated excluded)
    offloaded: float = 0.0  # saved activations moved to host memory (--activation-offload)
    fp8_casts: float = 0.0  # torchao float8 casts alive at the peak (`fp8_workspace`, or 0)
    host: float = 0.0       # pinned host copies of the offloaded saves (`_offload_host_bytes`)


def _forward_backward(w: Workload, per_token: _PerToken, params: ParamCounts, sizes: Sizes,
                      trained: Training) -> _ForwardBackward:
    """The largest of the moments that bound the forward/backward working set (`_moments`)."""
    tokens = _scale(w)
    per_layer_token = per_token.checkpoint if w.grad_ckpt else per_token.layer
    per_layer = per_layer_token * tokens
    on_device, kept = _layers_on_device(w, sizes, per_layer_token)
    kept *= tokens
    acts = on_device * per_layer + per_token.outside * tokens + kept
    if not w.grad_ckpt:    # per-layer tensors of any token count (an fp32 router's weight cast)
        acts += on_device * act.layer_fixed_bytes(_activation_key(w))
    moments = _moments(w, per_token, params, sizes, trained, acts)
    total, casts = max(moments)
    # fp8: its casts are part of the working set only when their moment (the last) sets the peak
    fp8_alive = fp8_workspace(w) if (w.fp8 and w.training and moments[-1][0] >= total) else 0.0
    if w.grad_ckpt:
        # the layer the backward recomputes, as far as the peak's moment holds it: a forward moment
        # (Liger's loss beside the lm_head's autocast cast) has only the saved inputs
        acts = min(acts + per_token.layer * tokens, max(acts, total - casts))
    offloaded = max(0.0, (sizes.layers - on_device) * per_layer - kept) if w.activation_offload else 0.0
    host = _offload_host_bytes(w, per_token, sizes) if w.activation_offload else 0.0
    return _ForwardBackward(acts, casts, total, offloaded, fp8_alive, host)


def activation_offload_copy_bytes(w: Workload) -> tuple[float, float]:
    """(bytes TRL's offloading copies to the host in one micro-batch's forward, bytes it copies
    back in the backward), per GPU: a copy of every offloaded save (`_offload_host_bytes`); back,
    all but the loss's saved output, the last save, which the backward's first node takes from the
    forward stash (profiler/offload.py). (0, 0) without offloading."""
    if not (w.training and w.activation_offload):
        return 0.0, 0.0
    key = _activation_key(w)
    per_token = _per_token(key)
    out = _offload_host_bytes(w, per_token, local_sizes(w, count_params(w.model)))
    return out, max(0.0, out - per_token.logits_saved * _scale(w))


def _offload_host_bytes(w: Workload, per_token: _PerToken, sizes: Sizes) -> float:
    """Pinned host memory TRL's offloading holds when the forward ends (profiler/offload.py): a copy
    of every offloaded save, one per storage: every layer's saved tensors (the layer in flight and
    the storages a later save keeps on the device included: their first save was copied), or every
    checkpointed input; the final norm's and the loss's (log_softmax's output); not the output
    head's input (TRL leaves the head out). The backward frees each copy as it brings it back."""
    key = _activation_key(w)
    per_layer = per_token.checkpoint if w.grad_ckpt else per_token.layer
    fixed = 0 if w.grad_ckpt else act.layer_fixed_bytes(key)
    outside = per_token.outside - act.lm_head_input_bytes_per_token(key) + per_token.logits_saved
    return sizes.layers * (per_layer * _scale(w) + fixed) + outside * _scale(w)


def _moments(w: Workload, per_token: _PerToken, params: ParamCounts, sizes: Sizes, trained: Training,
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
    liger = _liger_loss_bytes(w, sizes, trained)
    loss_backward = per_token.logits_backward * tokens
    if w.activation_offload:
        # TRL empties its forward stash at the first backward node: a saved tensor the loss's
        # backward does not use (Gemma-2's soft-capping tanh output) is back on the host then
        loss_backward -= act.softcap_saved_per_token(_activation_key(w)) * tokens
    moments = [(acts + casts_fwd + per_token.logits_forward * tokens + liger, casts_fwd),
               (acts + casts_bwd + loss_backward, casts_bwd)]
    head_grad = 0.0
    if w.method == "full":
        # FSDP: the unsharded lm_head gradient is counted with its reduce-scatter buffers (zero_buffers)
        head_grad = 0.0 if w.fsdp != "none" else _head_grad_bytes(sizes, trained)
        # Transformer Engine's lm_head casts the logits' gradient row- and column-wise (estimator.fp8)
        te_grad_cast = fp8.te_head_grad_cast_bytes(w.model, tokens) / w.tp if w.te_fp8 else 0.0
        moments.append((acts + casts_bwd + _output_layer_backward(w, sizes, trained) + te_grad_cast, casts_bwd))
    key = _activation_key(w)
    below = acts - per_token.outside * tokens        # the layers' saved tensors
    kept = act.logits_kept_per_token(key) * tokens   # logits a loop keeps to the end
    # the first layer the backward reaches: the lm_head's backward has released its saved cast
    top_casts = casts_bwd - (0.0 if act.liger_fused_loss(key) else _head_cast(w, sizes))
    if w.grad_ckpt:
        # the recomputed layer casts its weights again under autocast (the forward's were freed)
        top_casts += _layer_casts(w, sizes) / max(sizes.layers, 1)
        # the recomputed layer's saved tensors of any token count too (W + delta of adapted experts,
        # an fp32 router's weight cast, DoRA's vectors)
        top = below + per_token.top * tokens + act.layer_fixed_bytes(key)
    else:
        top = below - per_token.layer * tokens + per_token.top * tokens
    # the expert weight gradients a MoE layer's backward makes: Liger's fused MoE both (frozen experts
    # too), a LoRA on fused expert parameters the W + delta gradient, Llama-4's trained experts'
    top += (act.liger_moe_weight_gradient_bytes(key) + act.expert_adapter_gradient_bytes(key)
            + act.dense_experts_weight_gradient_bytes(key) + kept)
    moments.append((top + top_casts + head_grad, top_casts))
    transient = dora_transient(w)
    if transient:
        # DoRA's weight-norm transient of the widest adapted linear (estimator.dora): in the forward of
        # the last layer with every layer's saved tensors, or (checkpointing) in the recomputation of
        # the first layer the backward reaches
        # the lm_head's autocast cast is made at the loss, after the layers
        layer_casts = casts_fwd - _head_cast(w, sizes)
        if w.grad_ckpt:   # the recomputed layer's own casts too
            layer_casts += _layer_casts(w, sizes) / max(sizes.layers, 1)
            moments.append((below + kept + per_token.layer * tokens + transient + layer_casts, layer_casts))
        else:   # autocast keeps the half casts of every adapter weight used so far (trainable leaves)
            adapter_casts = 2 * (lora_params(w, params) - dora_params(w)) / (w.tp * w.pp) if _head_cast(w, sizes) else 0.0
            moments.append((below + transient + layer_casts + adapter_casts, layer_casts))
    before_mlp, at_down = lora_transients(w)
    if before_mlp or at_down:
        # a LoRA path's output transient (`lora_transients`): in the forward of the last layer (with
        # checkpointing, the recomputation of the first layer the backward reaches), before that
        # layer's feed-forward block has saved anything, or at its down_proj, after
        layer_casts = casts_fwd - _head_cast(w, sizes)
        layer = below + (kept + per_token.layer * tokens if w.grad_ckpt else 0.0)
        unsaved = act.mlp_bytes_per_token(key) * tokens
        # Llama-4: the last layer's down_proj beside the routed experts' output (its shared expert's)
        at_down += act.dense_experts_routed_bytes_per_token(key) * tokens if at_down else 0.0
        moments.append((layer + max(before_mlp - unsaved, at_down) + layer_casts, layer_casts))
    if w.fp8 and w.training:
        # a converted linear's backward in the first layer the backward reaches: every layer's saved
        # tensors (that layer's recomputed with checkpointing) and its fp8 casts (estimator.fp8)
        in_layer = below + kept + (per_token.layer * tokens if w.grad_ckpt else 0.0)
        moments.append((in_layer + casts_bwd + head_grad + fp8_workspace(w), casts_bwd))
    return moments


def lora_transients(w: Workload) -> tuple[float, float]:
    """LoRA: the largest transient of one adapted decoder linear's forward, bytes per GPU, (before
    the feed-forward block has saved anything: the attention projections, gate and up; at down_proj,
    after it has); (0, 0) without adapters, and with DoRA, whose own transient `dora_transient` is.
    peft's Linear.forward (tuners/lora/layer.py) runs `result = result + lora_B(lora_A(dropout(x))) *
    scaling`: at the add the base output (the linears' output dtype), lora_B's output times scaling
    (the adapters' dtype; half under autocast) and their sum (the wider of the two: type promotion)
    are alive together, over the linear's output width (a fused gate_up_proj: twice the intermediate
    size). With Liger's loss (no logits) one of them can be the forward's peak."""
    if w.method not in ("lora", "qlora") or w.dora or not w.training or getattr(w.model, "card_path", ""):
        # (a structure card, estimator/cards.py, has no layer formulas: its traced moments stand)
        return 0.0, 0.0
    key = _activation_key(w)
    dt = act.dtypes(key)
    out, adapter = dt.linear_out, (dt.compute if dt.autocast else key.adapter_bytes)
    chain = out + adapter + max(out, adapter)
    # the linear's own input is alive too where no adapter keeps it (fp32 adapters keep their casts,
    # dropout its dropped-out copy)
    shared = adapter == out and not key.lora_dropout and not dt.autocast

    def moment(site) -> float:
        return chain * site.d_out + (0 if shared else out * site.d_in)

    sites = [s for s in matched(w.model, w.lora_targets) if s.kind == "linear"]
    down = max((moment(s) for s in sites if "down_proj" in s.roles), default=0.0)
    before = max((moment(s) for s in sites if "down_proj" not in s.roles), default=0.0)
    return before * _scale(w), down * _scale(w)


def dora_transient(w: Workload) -> float:
    """DoRA: the largest transient of one adapted linear's forward (bytes per GPU; 0 without DoRA):
    the identity through the adapters, the casts and the weight norm (estimator.dora)."""
    if not (w.dora and w.training):
        return 0.0
    key = _activation_key(w)
    return dora.transient_bytes(w.model, w.lora_targets, w.lora_rank, act.dora_dtypes(key), w.batch * w.seq) / w.tp


def _dora_bottom_layer(w: Workload, per_token: _PerToken, sizes: Sizes, trained: Training) -> float:
    """DoRA with checkpointing, beyond the gradients: the recomputation of the bottom layer, when
    every gradient but that layer's adapters' exists: its saved tensors, its checkpointed input, its
    weights' autocast casts and the DoRA transient."""
    if not (w.dora and w.grad_ckpt and w.training):
        return 0.0
    working = ((per_token.layer + per_token.checkpoint) * _scale(w) + dora_transient(w)
               + _layer_casts(w, sizes) / max(sizes.layers, 1))
    missing = trained.trainable * trained.param_bytes / max(sizes.layers, 1)
    return max(0.0, working - missing)


def fp8_workspace(w: Workload) -> float:
    """torchao float8 training: the eager fp8 casts alive in the worst moment of one converted
    linear of one micro-batch, beyond the bf16 matmul (bytes; estimator.fp8.linear_workspace_bytes).
    Reported as `quant_workspace_bytes` when that moment sets the forward/backward peak."""
    if not (w.fp8 and w.training):
        return 0.0
    if w.te_fp8:
        return fp8.te_workspace_bytes(w.model, w.batch * w.seq)
    return fp8.workspace_bytes(w.model, w.batch * w.seq, w.compiled, weight_cast=w.fsdp == "none")


def _liger_loss_bytes(w: Workload, sizes: Sizes, trained: Training) -> float:
    """Liger's fused linear cross-entropy at its forward peak, beyond its per-token terms and the
    one lm_head cast autocast makes at a time (bytes; liger-kernel 0.8.5
    ops/fused_linear_cross_entropy.py on CUDA, compute capability 8 and newer). The tokens go
    through in chunks (tokens / ceil(vocab / hidden), rounded up to a power of 2); each chunk's
    logits, in the compute dtype, become their own gradient in place: one buffer reused
    (`mm(out=)`) when the input, the weight and the compute dtype agree; otherwise, under
    autocast, the logits and the chunk's input gradient are half-precision products made per
    chunk. A trained lm_head's gradient is made in the forward (`zeros_like(weight)`) and each
    chunk is added into it in place (`addmm(out=)`); under autocast the trainable weight's half cast
    stays cached beside each chunk's own cast of its transpose, and the chunk's input is cast to half
    for the addmm."""
    key = _activation_key(w)
    if not act.liger_fused_loss(key):
        return 0.0
    spec, dt = w.model, act.dtypes(key)
    tokens = w.batch * w.seq
    chunk = min(tokens, 1 << max(0, math.ceil(math.log2(math.ceil(tokens / math.ceil(spec.vocab_size / spec.hidden_size))))))
    working = chunk * spec.vocab_size * dt.compute / w.tp
    if dt.autocast:
        working += chunk * spec.hidden_size * dt.compute
    if w.method == "full":
        head = sizes.head if sizes.head else sizes.embed
        working += head * trained.param_bytes
        if dt.autocast:
            working += head * dt.compute + chunk * spec.hidden_size * dt.compute
    return working


def _liger_saved_head_grad(w: Workload, sizes: Sizes, trained: Training) -> float:
    """Liger: a trained lm_head's gradient, made in the forward and saved for the backward (bytes)."""
    if not (act.liger_fused_loss(_activation_key(w)) and w.method == "full"):
        return 0.0
    return _head_grad_bytes(sizes, trained)


def _fsdp_unsharded_grads(w: Workload, trained: Training) -> float:
    """FSDP2 under gradient accumulation: accelerate's `no_sync` calls
    `set_requires_gradient_sync(False)` (accelerate 1.15.0 accelerator.py line 1167) and FSDP2 keeps
    each parameter's unsharded gradient (compute dtype) from one micro-batch to the next
    (torch fsdp/_fully_shard/_fsdp_param.py `accumulate_unsharded_grad_if_needed`): the whole
    model's trainable parameters, unsharded, in the forward/backward of every micro-batch but the first."""
    if w.fsdp == "none":
        return 0.0
    unsharded = trained.trainable * regime(w).fsdp_shard     # the shards times the shard group
    return unsharded * (2 if regime(w).fsdp_mixed else 4)


def _head_grad_bytes(sizes: Sizes, trained: Training) -> float:
    """The lm_head (or tied embedding) weight gradient, in the parameter dtype."""
    return (sizes.head if sizes.head else sizes.embed) * trained.param_bytes


def _output_layer_backward(w: Workload, sizes: Sizes, trained: Training) -> float:
    """Backward through the lm_head: the half logits gradient and the weight gradient it makes
    (under AMP the half weight gradient and its fp32 cast are both alive for a moment)."""
    act_bytes = w.activation_dtype_bytes
    head = sizes.head if sizes.head else sizes.embed
    if act.liger_fused_loss(_activation_key(w)):   # no logits: the weight gradient was made in the forward
        return head * trained.param_bytes + act.logits_backward_per_token(_activation_key(w)) * _scale(w)
    # the half logits' gradient, beside the fp32 logits a loop keeps (--loss hf-legacy)
    logits_grad = (act_bytes * w.model.vocab_size + act.logits_kept_per_token(_activation_key(w))) * _scale(w)
    if w.fsdp != "none":
        return logits_grad     # the weight gradient is in FSDP's buffers (estimator.fsdp)
    with_grad = logits_grad + head * act_bytes
    if w.loss == "chunked":
        # one lm_head matmul per chunk: autograd sums their weight gradients out of place, so from the
        # second chunk the sum so far, the new one and their sum are alive, beside the logits
        # gradients of the chunks not yet through the lm_head
        rest = (CHUNKED_LOSS_CHUNKS - 2) / CHUNKED_LOSS_CHUNKS
        with_grad = max(with_grad, logits_grad * rest + 3 * head * act_bytes)
    if trained.param_bytes != act_bytes:
        with_grad = max(with_grad, head * (act_bytes + trained.param_bytes))
    return with_grad


def _bottom_layer_backward(w: Workload, per_token: _PerToken, params: ParamCounts, sizes: Sizes,
                           trained: Training) -> float:
    """Beyond the gradients during the last layer the backward reaches (full fine-tune, no ZeRO):
    that layer's attention backward (`_PerToken.top`) while every gradient exists but
    its attention's and, untied, the embedding's."""
    if w.method != "full" or w.zero or w.fsdp != "none":
        return 0.0
    working = per_token.top * _scale(w)
    attention = params.attention_weights / (w.tp * w.pp)
    missing = (attention + (0 if w.model.tied_embeddings else sizes.embed)) * trained.param_bytes
    return max(0.0, working - missing)


def _end_of_backward(w: Workload, sizes: Sizes, trained: Training) -> float:
    """Beyond the gradients when the backward ends (full fine-tune, no ZeRO): the embedding's
    gradient made while a second one is alive. Untied, the one accumulated from earlier
    micro-batches. Tied, the lm_head's contribution beside the embedding's own: without autocast
    the lm_head's arrives as a view (the linear's TBackward) and the embedding's from
    embedding_dense_backward, neither of which autograd's InputBuffer may take, so it sums them out
    of place into a third tensor (profiler/trace/tracker.py; measured on the first H100 run); under
    autocast the lm_head's arrives from the weight cast's backward, a fresh tensor summed in place;
    Liger's is the gradient its fused loss saved, summed out of place either way.
    With accumulation, the earlier micro-batches' gradient beside them."""
    if w.method != "full" or w.zero or w.fsdp != "none":
        return 0.0
    in_place = w.amp and not act.liger_fused_loss(_activation_key(w))
    tied = (1 if in_place else 2) if w.model.tied_embeddings else 0
    copies = tied + int(w.grad_accum > 1)
    return copies * sizes.embed * trained.param_bytes


def kv_cache_bytes(spec: ModelSpec, batch: int, tokens: int, dtype_bytes: int, tp: int = 1) -> int:
    """Layers x batch x cached tokens x the cache width per token (`ModelSpec.kv_cache_width`:
    2 x kv heads x head_dim; MLA: the compressed latent and rotary key) x bytes, per GPU.

    Sliding-window layers cache at most `sliding_window` tokens (transformers 5 DynamicCache).
    Tensor parallel splits kv heads; with more ranks than kv heads each rank keeps one whole head.
    Linear-attention layers (Qwen3-Next) hold a conv and a recurrent state whatever `tokens` is
    (`ModelSpec.linear_state_bytes`; not split by tensor parallel here).
    """
    return (batch * spec.attended_tokens(tokens) * spec.kv_cache_width(tp) * dtype_bytes
            + spec.linear_state_bytes(batch, dtype_bytes))


def inference_kv_bytes(spec: ModelSpec, batch: int, prompt: int, new_tokens: int, dtype_bytes: int,
                       tp: int = 1) -> int:
    """The largest KV cache held during generate: after the prefill, a sliding layer still holds
    the whole prompt (its window is a view of the prefill tensor until the first decode step)."""
    after_prefill = (batch * spec.num_attention_layers * prompt * spec.kv_cache_width(tp) * dtype_bytes
                     + spec.linear_state_bytes(batch, dtype_bytes))
    return max(after_prefill, kv_cache_bytes(spec, batch, prompt + new_tokens, dtype_bytes, tp))


# CUDA compute capability majors whose default cuBLAS workspace is the large one (torch 2.13.0
# CublasHandlePool.cpp parseChosenWorkspaceSize: Hopper 9, Blackwell 10 and 12)
_LARGE_BLAS_WORKSPACE_MAJORS = (9, 10, 12)


def blas_workspace_bytes(w: Workload, compute_capability_major: int) -> int:
    """cuBLAS workspaces alive on one GPU: PyTorch takes one per (cuBLAS handle, stream) from its
    caching allocator at the first GEMM and keeps it (cuBLASLt shares it), and handles are per
    thread: the forward's thread, and in training the autograd engine's device thread too (two).
    The size per workspace is estimator/data/overheads.csv's for the GPU's compute capability."""
    large = compute_capability_major in _LARGE_BLAS_WORKSPACE_MAJORS
    size = int(overhead("cublas_workspace_bytes_large" if large else "cublas_workspace_bytes_default"))
    # Transformer Engine takes one of its own for its GEMMs (estimator.fp8)
    own = fp8.te_cublas_workspace_bytes(compute_capability_major) if w.te_fp8 and w.training else 0
    return size * (2 if w.training else 1) + own


def _decode_transient(w: Workload) -> float:
    """The largest transient of a decode step beside the cache, bytes per GPU, on a full-attention
    layer holding every token: DynamicLayer.update (transformers 5.23 cache_utils.py) concatenates
    the keys, then the values, so the larger of the two exists twice for a moment; eager attention
    then repeats the layer's keys and values to every query head (repeat_kv; SDPA takes GQA as it
    is for one query). MLA caches the latent as keys and the rotary key as values."""
    spec = w.model
    tokens = w.seq + w.new_tokens
    if spec.window_layers[0] == 0 and spec.sliding_window:   # every layer slides
        tokens = min(tokens, spec.sliding_window)
    per_token = w.batch * kv_dtype_bytes(w)
    if spec.is_mla:
        return per_token * tokens * max(spec.kv_lora_rank, spec.qk_rope_head_dim)
    width = spec.kv_cache_width(w.tp)          # keys and values of one layer, per token
    cat = per_token * tokens * width / 2
    if w.attn == "eager" and spec.num_kv_heads < spec.num_heads:
        heads = spec.num_heads // w.tp if spec.num_heads >= w.tp else 1
        return max(cat, per_token * tokens * 2 * heads * spec.head_dim)
    return cat


def kv_dtype_bytes(w: Workload) -> int:
    """Bytes per cached element. Under AMP rotary embeddings come out in fp32 (cos/sin follow the
    fp32 hidden states), so the cache, created in the key's dtype, holds fp32 keys and values."""
    spec = w.model
    rotary = spec.learned_positions == 0 and spec.model_type != "bloom"
    return 4 if (w.amp and rotary) else w.activation_dtype_bytes


def _inference_working_set(w: Workload, params: ParamCounts) -> float:
    """Largest transient of the prefill (no_grad) besides the KV cache: the larger of one layer's
    attention (q, k, v, output; eager: scores while softmax runs, the 4-D mask) and its MLP, with
    the residual stream, a post-norm's or an fp32 rotary's moment, or the last position's logits;
    under AMP plus the weight cast of the matmul running (not cached without gradients: the
    lm_head's is the largest). The attention's k and v stand for the layer's keys and values before
    DynamicCache's first `cat` copies them (the cache term holds the copy)."""
    key, spec = _activation_key(w), w.model
    act_bytes, tokens = act.dtypes(key).compute, w.batch * w.seq
    attention = act.inference_attention_bytes_per_token(key, w.seq) * tokens
    attention = max(attention, act.inference_linear_attention_bytes_per_token(key) * tokens)   # Qwen3-Next
    mlp = (act.inference_mlp_bytes_per_token(key) + act.inference_mlp_locals_bytes_per_token(key)) * tokens
    residual = act.inference_residual_bytes_per_token(key) * tokens
    post_norm = act.inference_post_norm_bytes_per_token(key) * tokens
    casts = 2 * max(lin.d_in * lin.d_out for lin in params.linears) if w.amp else 0
    # fp32 rotary (OLMo, Cohere): the last layer's keys are not cached yet at that point
    rotary = act.inference_rotary_bytes_per_token(key) * tokens
    if rotary:
        rotary -= inference_kv_bytes(spec, w.batch, w.seq, 0, kv_dtype_bytes(w), 1) / spec.num_layers
    layer = (max(max(mlp, attention) + residual, rotary, post_norm) + casts) / w.tp
    head = 2 * (params.lm_head or params.embedding) if w.amp else 0
    logits = (w.batch * spec.vocab_size * act_bytes + head + act_bytes * spec.hidden_size * tokens) / w.tp
    return max(layer, logits)


def _quant_workspace(w: Workload, params: ParamCounts) -> float:
    """bitsandbytes dequantizes one weight to the compute dtype per matmul (MXFP4's matmul_ogs reads
    the packed experts directly). GPTQ/AWQ: the kernels that dequantize for a large input (ExLlamaV2's
    `temp_dq` scratch, AutoAWQ's dequantize-then-matmul above its row threshold) hold the widest
    linear in fp16; Marlin needs none, so this is the upper bound the estimate keeps. LoRA on GPTQ:
    the trainable kernel's torch dequantization of the widest linear (`gptq_training_dequant_scratch_bytes`)."""
    if w.quant not in BNB_QUANTS + INT4_QUANTS:
        return 0.0
    widest = max(lin.d_in * lin.d_out for lin in params.linears)
    if w.quant in INT4_QUANTS and w.training:
        return gptq_training_dequant_scratch_bytes(w, widest)
    return 2 * widest / w.tp


def gptq_training_dequant_scratch_bytes(w: Workload, elements: int) -> float:
    """Bytes above the saved copy while gptqmodel's TorchLinear dequantizes a linear of `elements`
    weights in training mode (its Triton dequantization is for eval only, `_can_use_triton_dequant`;
    ModelCloud/GPTQModel f4c327a1 gptqmodel/nn_modules/qlinear/__init__.py `dequantize_weight`,
    `_dequantize_from_codes`): the codes shifted out of the int32 words (int32, 4 B per element) and
    cast to int8 (1 B), then, at the product `scales[g_idx] * (codes - zeros[g_idx])`, the int8 codes
    (1 B), the gathered half scales (2 B) and the int8 difference (1 B) beside the half result (2 B):
    5 B before the result exists, 6 B with it. Without checkpointing the result is the copy the matmul
    saves (estimator.activations `int4_dequantized_bytes_per_layer`), so 4 B above it; with checkpointing the
    forward frees it again, so 6 B."""
    return (6 if w.grad_ckpt else 4) * elements / w.tp


def components(w: Workload) -> Components:
    """The named parts of `w`'s peaks, per GPU (bytes, unrounded); `assemble` makes the peaks."""
    spec, params = w.model, count_params(w.model)
    states = model_states(states_key(w))
    sizes, trained = states.sizes, states.trained
    quant_workspace = _quant_workspace(w, params)
    temps = states.temporaries
    if not w.training:
        kv = inference_kv_bytes(spec, w.batch, w.seq, w.new_tokens, kv_dtype_bytes(w), w.tp)
        prompt_kv = inference_kv_bytes(spec, w.batch, w.seq, 0, kv_dtype_bytes(w), w.tp)
        stages = sizes.layers / spec.num_layers   # pipeline stages hold their own layers' cache
        kv, prompt_kv = kv * stages, prompt_kv * stages
        return Components(
            training=False, multi_gpu=w.world_size > 1, weights=states.weights, gradients=states.gradients,
            optimizer_states=states.optimizer, master_weights=states.master, zero_buffers=states.zero_buffers,
            paged_optimizer=states.paged, host=states.host, activations=_inference_working_set(w, params),
            logits_and_loss=0, optimizer_temporaries=temps, autocast_weight_cache=0,
            quant_workspace=quant_workspace, accumulated_gradients=0, kv_cache=kv,
            kv_growth=_decode_transient(w), kv_generated=kv - prompt_kv)
    per_token = _per_token(_activation_key(w))
    forward_backward = _forward_backward(w, per_token, params, sizes, trained)
    weights, gradients = states.weights, states.gradients
    if w.te_fp8:
        # Transformer Engine (estimator.fp8): each te.Linear's scaling state, and a tied lm_head
        # untied by convert_model: a second bf16 weight and its gradient
        untied = 2 * fp8.te_untied_head_elements(spec)
        weights, gradients = weights + untied + fp8.te_scaling_state_bytes(spec), gradients + untied
    acts, casts = forward_backward.activations, forward_backward.casts
    # GPTQ's saved dequantized copies: every layer's on this GPU, or with checkpointing the
    # recomputed layer's, as far as the peak's moment holds them
    copies = act.int4_dequantized_bytes_per_layer(_activation_key(w))
    copies = min(acts, copies * (1 if w.grad_ckpt else sizes.layers))
    # fp8 and bitsandbytes never go together; the casts' moment has freed the lm_head input and final
    # norm, so the components add up to that moment: the casts less what was freed, at most
    quant_workspace += min(forward_backward.fp8_casts, max(0.0, forward_backward.total - acts - casts))
    logits = max(0.0, forward_backward.total - acts - casts - quant_workspace)
    accumulated = gradients + _fsdp_unsharded_grads(w, trained) if w.grad_accum > 1 else 0.0
    fwd_bwd = acts + logits + casts + quant_workspace + accumulated
    # once the gradients are (nearly) complete: the optimizer's temporaries, or the end of the
    # backward when that is larger and sets the peak (see the module docstring)
    late = max(temps, _end_of_backward(w, sizes, trained),
               _bottom_layer_backward(w, per_token, params, sizes, trained),
               _dora_bottom_layer(w, per_token, sizes, trained))
    if gradients + late > fwd_bwd:
        temps = late
    return Components(
        training=True, multi_gpu=w.world_size > 1, weights=weights, gradients=gradients,
        optimizer_states=states.optimizer, master_weights=states.master, zero_buffers=states.zero_buffers,
        paged_optimizer=states.paged, host=states.host + forward_backward.host, activations=acts,
        logits_and_loss=logits,
        optimizer_temporaries=temps, autocast_weight_cache=casts, quant_workspace=quant_workspace,
        accumulated_gradients=accumulated, kv_cache=0, kv_growth=0,
        offloaded_activations=forward_backward.offloaded, weight_copies=copies)


def estimate_memory(w: Workload, reserve_fraction: float, context_bytes: int) -> MemoryBreakdown:
    """The uncalibrated breakdown with the allocator's reserve fraction and the CUDA context given
    (every other correction at its uncalibrated value, estimator.calibration.NONE's)."""
    from estimator.calibration import NONE, memory_corrections  # calibration imports this module

    corrections = memory_corrections(NONE, w)[0]._replace(reserve_fraction=reserve_fraction,
                                                          cuda_context_bytes=context_bytes)
    return assemble(components(w), corrections)
