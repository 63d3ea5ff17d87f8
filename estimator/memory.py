"""Per-GPU memory of a Workload as a named breakdown in bytes, and the three peaks.

Phases of a training step (steady state, HF Trainer semantics: the outputs but the loss are
dropped before the backward, gradients set to None after each optimizer step). The assembly is
`peak_allocated_bytes` = persistent states + the larger of two working sets:
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
Inference: weights + KV cache + the larger of a prefill layer's working set and the logits.
Every moment was checked against fake-tensor traces of the real step (profiler.trace;
tests/test_estimator_vs_trace.py, scripts/bench_tracer.py).

Regimes (DESIGN.md section 3): torch without ZeRO keeps weights, gradients and optimizer states in
the parameter dtype (AMP: fp32 everywhere; pure bf16: 2+2+4 B); DeepSpeed (ZeRO >= 1) with bf16/fp16
keeps half weights and gradients plus fp32 master weights and fp32 Adam states, and casts the half
gradients to an fp32 partition for the update while both are live (2+2+4+4+8 = 20 B before
partitioning, DeepSpeed's own estimator figure). A quantized base (QLoRA, LoRA on int8) goes
through peft's kbit preparation, which upcasts every non-quantized parameter to fp32.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from estimator import activations as act
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


def _local_sizes(w: Workload, p: ParamCounts) -> _Sizes:
    """Model elements on the busiest GPU: layers split over pipeline stages, all over tensor ranks."""
    spec = w.model
    layers = math.ceil(spec.num_layers / w.pp)
    frac = layers / spec.num_layers / w.tp
    embed = (p.embedding + p.positions) / w.tp
    head = (p.lm_head + p.lm_head_bias) / w.tp
    if w.pp > 1:  # embedding on the first stage, lm_head on the last: the busier one counts
        embed, head = (embed, 0.0) if embed >= head else (0.0, head)
    return _Sizes(p.linear_weights * frac, p.linear_biases * frac, (p.norms + p.router) * frac,
                  embed, head, layers)


def lora_params(w: Workload, p: ParamCounts) -> int:
    """Adapter parameters: r x (d_in + d_out) per targeted linear (fused MoE experts excluded,
    as peft targets only nn.Linear modules in transformers 5)."""
    return sum(w.lora_rank * (lin.d_in + lin.d_out) * lin.count
               for lin in p.linears if lin.role in w.lora_targets and not lin.expert)


def _base_dtype_bytes(w: Workload) -> int:
    """Bytes per element of the model as loaded: fp32 for fp32 and AMP, else 2."""
    return 4 if w.precision == "fp32" or w.amp else 2


def _quantized_linear_bytes(w: Workload, n: float, rows: float) -> float:
    """bitsandbytes storage of `n` linear weights with `rows` output rows in total."""
    if w.quant == "int8":
        return n + 4 * rows  # int8 values + one fp32 scale per output row (LLM.int8)
    block = overhead("bnb_blocksize_4bit")
    if w.double_quant:  # 8-bit absmax per block, fp32 absmax per 256 blocks
        return n * 0.5 + n / block + 4 * n / (block * overhead("bnb_blocksize_4bit_second"))
    return n * 0.5 + 4 * n / block


def weights_bytes(w: Workload, p: ParamCounts, s: _Sizes) -> float:
    """Base weights on one GPU (adapters excluded).

    bitsandbytes replaces nn.Linear modules only: transformers 5 stores MoE experts as fused 3-D
    parameters, which stay unquantized. Training on a quantized base goes through peft's
    prepare_model_for_kbit_training, which upcasts every non-quantized parameter (embeddings,
    norms, lm_head, experts) to fp32 whatever the precision; inference keeps them as loaded.
    """
    base = _base_dtype_bytes(w)
    if w.quant == "none":
        return s.total * base
    frac = s.linear_w / max(p.linear_weights, 1)
    dense = [lin for lin in p.linears if not lin.expert]
    quantized = sum(lin.weight_params for lin in dense) * frac
    rows = sum(lin.d_out * lin.count for lin in dense) * frac
    other = 4 if w.training else base
    return _quantized_linear_bytes(w, quantized, rows) + (s.total - quantized) * other


@dataclass(frozen=True)
class _Training:
    trainable: float       # trainable elements on this GPU before ZeRO partitioning
    param_bytes: int       # bytes per trainable element as stored
    state_bytes: int       # bytes per element of optimizer state dtype
    deepspeed_half: bool   # DeepSpeed mixed precision: fp32 master + fp32 gradient partition


def _training(w: Workload, p: ParamCounts, s: _Sizes) -> _Training:
    if w.method == "full":
        pb = _base_dtype_bytes(w)
        ds_half = w.zero >= 1 and pb == 2
        return _Training(s.total, pb, 4 if ds_half else pb, ds_half)
    # peft keeps adapters in fp32 (autocast_adapter_dtype=True) whatever the base dtype
    return _Training(lora_params(w, p) / (w.tp * w.pp), 4, 4, False)


def _trainable_tensors(w: Workload, p: ParamCounts) -> list[tuple[int, int]]:
    """(elements, how many) of every trainable tensor: the granularity of 8-bit optimizers."""
    spec = w.model
    if w.method != "full":
        return [t for lin in p.linears if lin.role in w.lora_targets and not lin.expert
                for t in ((w.lora_rank * lin.d_in, lin.count), (w.lora_rank * lin.d_out, lin.count))]
    out = [(lin.d_in * lin.d_out, lin.count) for lin in p.linears]
    out += [(lin.d_out, lin.count) for lin in p.linears if lin.bias]
    per_norm = 2 if spec.norm == "layer" else 1
    out.append((spec.hidden_size, per_norm * (spec.norms_per_layer * spec.num_layers + int(spec.final_norm))))
    if spec.qk_norm:
        out.append((spec.head_dim, per_norm * 2 * spec.num_layers))
    if spec.embed_norm:
        out.append((spec.embed_dim, per_norm))
    out += [(n, 1) for n in (p.embedding, p.lm_head, p.lm_head_bias, p.positions) if n]
    if p.router:
        out.append((p.router // max(spec.num_moe_layers, 1), max(spec.num_moe_layers, 1)))
    return out


def _bnb_8bit_state_bytes(w: Workload, p: ParamCounts) -> float:
    """bitsandbytes 8-bit Adam: two uint8 states + one fp32 absmax per block per state; tensors
    under min_8bit_size keep two fp32 states (8 B per element)."""
    limit, block = overhead("bnb_min_8bit_size"), overhead("bnb_blocksize_8bit_optimizer")
    total = 0
    for n, count in _trainable_tensors(w, p):
        total += count * (8 * n if n < limit else 2 * n + 8 * math.ceil(n / block))
    return total


def _optimizer_bytes_per_param(w: Workload, state_bytes: int) -> float:
    if w.optimizer in ("adamw", "paged-adamw"):
        return 2 * state_bytes
    if w.optimizer == "sgd":
        return state_bytes
    return 0.0  # adafactor: counted from matrix shapes


def _adafactor_state(w: Workload, p: ParamCounts) -> float:
    """Adafactor (no first moment) keeps fp32 row and column second moments per matrix."""
    if w.method != "full":
        return sum(4 * (w.lora_rank + lin.d_in + w.lora_rank + lin.d_out) * lin.count
                   for lin in p.linears if lin.role in w.lora_targets and not lin.expert)
    spec = w.model
    total = sum(4 * (lin.d_in + lin.d_out) * lin.count for lin in p.linears)
    total += 4 * (spec.vocab_size + spec.embed_dim) * (1 if spec.tied_embeddings else 2)
    return total + 4 * (p.norms + p.router + p.linear_biases)


def _optimizer_temporaries(w: Workload, t: _Training, p: ParamCounts) -> float:
    """Extra memory inside optimizer.step() (torch implementations; DeepSpeed's are fused)."""
    if w.zero >= 1 or w.optimizer not in ("adamw", "sgd", "adafactor"):
        return 0.0
    largest = p.largest_layer if w.method == "full" else max(
        (w.lora_rank * max(lin.d_in, lin.d_out) for lin in p.linears
         if lin.role in w.lora_targets and not lin.expert), default=0)
    if w.optimizer == "adafactor":  # update and its factored estimate in fp32; half parameters
        return (2 + (2 if t.param_bytes == 2 else 0)) * 4 * largest   # add fp32 grad and param copies
    if w.optimizer == "sgd" or w.adamw_impl == "fused":
        return 0.0
    if w.adamw_impl == "foreach":
        return t.trainable * t.state_bytes  # one intermediate list the size of all params
    return 2 * largest * t.state_bytes     # single-tensor loop: two temporaries, largest param


@dataclass(frozen=True)
class _States:
    weights: float
    gradients: float
    optimizer: float
    master: float
    temporaries: float
    zero_buffers: float
    paged: float
    host: float


_STATES_CACHE: dict = {}


def _states(w: Workload, p: ParamCounts, s: _Sizes) -> _States:
    """Weights, gradients, optimizer states and master weights per GPU, after ZeRO and offload.

    They do not depend on batch or sequence, so planners that sweep those reuse them (cached).
    """
    key = (w.model, w.method, w.precision, w.optimizer, w.adamw_impl, w.lora_rank, w.lora_targets,
           w.quant, w.double_quant, w.gpus, w.nodes, w.zero, w.offload, w.tp, w.pp)
    hit = _STATES_CACHE.get(key)
    if hit is None:
        if len(_STATES_CACHE) > 4096:
            _STATES_CACHE.clear()
        hit = _STATES_CACHE[key] = _compute_states(w, p, s)
    return hit


def _compute_states(w: Workload, p: ParamCounts, s: _Sizes) -> _States:
    base_weights = weights_bytes(w, p, s)
    if not w.training:
        return _States(base_weights, 0, 0, 0, 0, 0, 0, 0)
    t = _training(w, p, s)
    dp, z = w.dp, w.zero
    adapters = t.trainable * 4 if w.method != "full" else 0.0
    weights = base_weights + adapters
    grads = t.trainable * t.param_bytes
    per_param = _optimizer_bytes_per_param(w, t.state_bytes)
    if w.optimizer == "adafactor":
        opt = _adafactor_state(w, p) / (w.tp * w.pp)
    elif w.optimizer.endswith("8bit"):
        opt = _bnb_8bit_state_bytes(w, p) / (w.tp * w.pp)
    else:
        opt = t.trainable * per_param
    master = t.trainable * 4 if t.deepspeed_half else 0.0
    fp32_grad = t.trainable * 4 if t.deepspeed_half else 0.0
    temps = _optimizer_temporaries(w, t, p)
    buffers = 0.0
    if z >= 1:
        opt, master, fp32_grad = opt / dp, master / dp, fp32_grad / dp
    if z == 3 and w.offload == "none":  # stage 3 makes fp32 gradients one sub-group at a time
        limit = overhead("zero3_sub_group_elements") + p.largest_layer / dp
        fp32_grad = min(fp32_grad, 4 * limit) if t.deepspeed_half else fp32_grad
    if z >= 1:  # DeepSpeed allocates its reduce bucket at every stage, whatever the model size
        buffers = overhead("zero_reduce_bucket_elements") * t.param_bytes
    if z >= 2:
        grads = grads / dp
    if z == 3:
        weights = weights / dp
        buffers += (p.largest_layer / (w.tp * w.pp)) * 2 * t.param_bytes  # DeepSpeed: params + grads
        buffers += overhead("zero3_prefetch_bucket_elements") * t.param_bytes
    if z == 0 and dp > 1:
        buffers = grads  # DDP copies gradients into its own buckets (gradient_as_bucket_view=False)
    host = 0.0
    if w.offload != "none":
        host = opt + master + fp32_grad
        opt, master, fp32_grad = 0.0, 0.0, 0.0
        if z >= 2:  # the half gradient partition lives on the CPU too (DeepSpeed offload path)
            host, grads = host + grads, 0.0
        if z in (1, 2):  # stage_1_and_2.py: bf16 staging copy of the partition and a bf16 buffer
            host += t.trainable / dp * t.param_bytes + 2 * p.largest_layer  # of the largest param
    if w.offload == "optimizer+params":
        host += weights
        weights = 0.0
    paged = 0.0
    if w.optimizer.startswith("paged"):
        paged, opt = opt, 0.0
    # DeepSpeed casts the half gradient partition to fp32 before it frees the half gradients
    # (stage_1_and_2.py step()), so both are live at that moment: 2 + 2 + 4 + 4 + 8 = 20 B per
    # parameter at ZeRO-1 on one GPU, as DeepSpeed's own estimator counts (2P + 18P/N).
    return _States(weights, grads + fp32_grad, opt, master, temps, buffers, paged, host)


def _scale(w: Workload) -> float:
    """Activations on the busiest GPU per byte computed per token: pipeline stages keep up to pp
    micro-batches in flight (1F1B); tensor parallel splits them."""
    return w.batch * w.seq * w.pp / w.tp


@dataclass(frozen=True)
class _PerToken:
    """Bytes per token of the activation terms (activations.py), computed once per architecture,
    method, precision, kernel and sequence length."""

    layer: int         # one layer's saved tensors, eager scores included
    checkpoint: int    # one layer's checkpointed input
    outside: int       # final norm, lm_head input, ...
    top: int           # one layer at the peak of its backward
    logits_saved: int
    logits_forward: int
    logits_backward: int


_PER_TOKEN_CACHE: dict = {}


def _per_token(w: Workload) -> _PerToken:
    spec = w.model
    key = (spec, w.method, w.precision, w.attn, w.lora_targets, w.lora_rank, w.quant, w.grad_ckpt, w.seq)
    hit = _PER_TOKEN_CACHE.get(key)
    if hit is None:
        if len(_PER_TOKEN_CACHE) > 4096:
            _PER_TOKEN_CACHE.clear()
        layer = act.layer_bytes_per_token(spec, w) + act.score_bytes_per_token(spec, w, w.seq)
        top = layer - act.mlp_bytes_per_token(spec, w) + act.attention_backward_bytes_per_token(spec, w, w.seq)
        hit = _PER_TOKEN_CACHE[key] = _PerToken(
            layer, act.checkpoint_bytes_per_token(spec, w), act.outside_layers_bytes_per_token(spec, w), top,
            act.logits_saved_per_token(spec, w), act.logits_forward_per_token(spec, w),
            act.logits_backward_per_token(spec, w))
    return hit


def _layer_saved(w: Workload, spec: ModelSpec) -> int:
    """Bytes one decoder layer saves for backward per token (eager scores included)."""
    return _per_token(w).layer


def saved_activation_bytes(w: Workload) -> int:
    """What autograd holds when the backward starts, per GPU (bytes): the layers' saved tensors
    (with checkpointing, their inputs), the final norm and lm_head input, log_softmax's output and,
    under autocast, the half-precision weight casts the matmuls saved."""
    spec, p = w.model, count_params(w.model)
    s = _local_sizes(w, p)
    return int(_saved_per_token_total(w, spec, s.layers) * _scale(w) + _weight_casts(w, p, s, saved=True))


def _saved_per_token_total(w: Workload, spec: ModelSpec, layers: int) -> int:
    pt = _per_token(w)
    return layers * (pt.checkpoint if w.grad_ckpt else pt.layer) + pt.outside + pt.logits_saved


def _weight_casts(w: Workload, p: ParamCounts, s: _Sizes, saved: bool) -> float:
    """Half-precision weight casts alive under autocast (bytes per GPU).

    AMP: every linear weight fed to a matmul (decoder linears and the lm_head; experts run
    grouped_mm without autocast) is cast once per forward: trainable leaves are cached by autocast
    until the forward ends, frozen ones (LoRA) are cast at each use, and the matmul saves the cast
    for its input gradient either way. On a quantized base (QLoRA) only the fp32 lm_head is cast.
    With checkpointing the layers' casts are not saved (`saved`: alive when the backward starts).
    """
    if not (w.amp or (w.training and w.quant != "none")):
        return 0.0
    head = (s.head if s.head else s.embed) / (w.dp if w.zero == 3 else 1)
    if w.quant != "none":
        return 2 * head
    layers = 2 * s.linear_w * _dense_fraction(p) / (w.dp if w.zero == 3 else 1)
    cached = w.method == "full" and not saved    # the cache outlives checkpointed layers' forward
    if w.grad_ckpt and not cached:
        layers = 0.0
    return layers + 2 * head


_DENSE_CACHE: dict = {}


def _dense_fraction(p: ParamCounts) -> float:
    """Share of the linear weights outside MoE experts (cached per parameter count object)."""
    hit = _DENSE_CACHE.get(id(p))
    if hit is None or hit[0] is not p:
        dense = sum(lin.weight_params for lin in p.linears if not lin.expert) / max(p.linear_weights, 1)
        attention = sum(lin.d_in * lin.d_out for lin in p.linears
                        if lin.role in ("q_proj", "k_proj", "v_proj", "o_proj"))
        hit = _DENSE_CACHE[id(p)] = (p, dense, attention)
    return hit[1]


def _attention_weights(p: ParamCounts) -> int:
    """Attention projection weights of the whole model (elements)."""
    _dense_fraction(p)
    return _DENSE_CACHE[id(p)][2]


@dataclass(frozen=True)
class _ForwardBackward:
    """The forward/backward working set at its peak (bytes per GPU, persistent states excluded)."""

    activations: float    # saved activations (plus one recomputed layer with checkpointing)
    casts: float          # autocast weight casts alive at the peak
    total: float          # the whole working set at the peak (gradients accumulated excluded)


def _forward_backward(w: Workload, p: ParamCounts, s: _Sizes, t: "_Training") -> _ForwardBackward:
    """The largest of the moments that bound the forward/backward working set (`_moments`)."""
    pt, k = _per_token(w), _scale(w)
    acts = (s.layers * (pt.checkpoint if w.grad_ckpt else pt.layer) + pt.outside) * k
    total, casts = max(_moments(w, p, s, t, acts))
    if w.grad_ckpt:
        acts += pt.layer * k                  # the layer the backward recomputes
    return _ForwardBackward(acts, casts, total)


def _moments(w: Workload, p: ParamCounts, s: _Sizes, t: "_Training", acts: float) -> list:
    """(working set, weight casts alive) at each candidate moment, bytes per GPU:
    - forward, at the loss: saved activations + the loss's forward peak (logits, fp32 upcast,
      log_softmax output) + every autocast weight cast (the cache);
    - backward, at the loss: saved activations + 12 B x vocab per token of fp32 loss gradients;
    - backward, at the output layer (full fine-tune): the lm_head's weight gradient while the
      half-precision logits gradient is alive;
    - backward, in the first layer it reaches: that layer's attention backward (recomputed with
      checkpointing), the other layers' saved tensors and the lm_head's gradient (full).
    """
    pt, k = _per_token(w), _scale(w)
    casts_fwd, casts_bwd = _weight_casts(w, p, s, saved=False), _weight_casts(w, p, s, saved=True)
    moments = [(acts + casts_fwd + pt.logits_forward * k, casts_fwd),
               (acts + casts_bwd + pt.logits_backward * k, casts_bwd)]
    head_grad = 0.0
    if w.method == "full":
        head_grad = _head_grad_bytes(w, s, t)
        moments.append((acts + casts_bwd + _output_layer_backward(w, s, t), casts_bwd))
    below = acts - pt.outside * k                    # the layers' saved tensors
    if w.grad_ckpt:
        recompute_casts = (casts_fwd - casts_bwd) / max(s.layers, 1)
        top = below + pt.top * k + recompute_casts
    else:
        top = below - pt.layer * k + pt.top * k
    moments.append((top + casts_bwd + head_grad, casts_bwd))
    return moments


def _head_grad_bytes(w: Workload, s: _Sizes, t: "_Training") -> float:
    """The lm_head (or tied embedding) weight gradient, in the parameter dtype."""
    return (s.head if s.head else s.embed) * t.param_bytes


def _output_layer_backward(w: Workload, s: _Sizes, t: "_Training") -> float:
    """Backward through the lm_head: the half logits gradient and the weight gradient it makes
    (under AMP the half weight gradient and its fp32 cast are both alive for a moment)."""
    spec, a = w.model, w.activation_dtype_bytes
    head = s.head if s.head else s.embed
    logits_grad = a * spec.vocab_size * _scale(w)
    with_grad = logits_grad + head * a
    if t.param_bytes != a:
        with_grad = max(with_grad, head * (a + t.param_bytes))
    return with_grad


def _bottom_layer_backward(w: Workload, p: ParamCounts, s: _Sizes, t: "_Training") -> float:
    """Beyond the gradients during the last layer the backward reaches (full fine-tune, no ZeRO):
    that layer's attention backward (`_PerToken.top`) while every gradient exists but
    its attention's and, untied, the embedding's."""
    if w.method != "full" or w.zero:
        return 0.0
    spec = w.model
    working = _per_token(w).top * _scale(w)
    attention = _attention_weights(p) / (w.tp * w.pp)
    missing = (attention + (0 if spec.tied_embeddings else s.embed)) * t.param_bytes
    return max(0.0, working - missing)


def _end_of_backward(w: Workload, s: _Sizes, t: "_Training") -> float:
    """Beyond the gradients when the backward ends (full fine-tune, no ZeRO): the embedding's
    gradient made while a second one is alive, the lm_head's contribution to a tied embedding
    (summed in place by autograd) or the gradient accumulated from earlier micro-batches."""
    if w.method != "full" or w.zero:
        return 0.0
    spec = w.model
    copies = int(spec.tied_embeddings) + int(w.grad_accum > 1)
    return copies * s.embed * t.param_bytes


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


def _inference_working_set(w: Workload, spec: ModelSpec, p: ParamCounts) -> float:
    """Largest transient of the prefill (no_grad) besides the KV cache: the larger of one layer's
    attention (q, k, v, output; eager: scores while softmax runs, the 4-D mask) and its MLP, with
    the residual stream, or the last position's logits; under AMP plus the weight cast of the
    matmul running (not cached without gradients: the lm_head's is the largest)."""
    dt = act.dtypes(w)
    a, tokens, h = dt.a, w.batch * w.seq, spec.hidden_size
    attn = (act.inference_attention_bytes_per_token(spec, w, w.seq)) * tokens
    mlp = act.inference_mlp_bytes_per_token(spec, w) * tokens
    residual = act.inference_residual_bytes_per_token(spec, w) * tokens
    casts = 2 * max(lin.d_in * lin.d_out for lin in p.linears) if w.amp else 0
    layer = (max(mlp, attn) + residual + casts) / w.tp
    head = 2 * (p.lm_head or p.embedding) if w.amp else 0
    logits = (w.batch * spec.vocab_size * a + head + a * h * tokens) / w.tp
    return max(layer, logits)


def _quant_workspace(w: Workload, p: ParamCounts) -> float:
    """bitsandbytes dequantizes one weight to the compute dtype per matmul."""
    if w.quant == "none":
        return 0.0
    return 2 * max(lin.d_in * lin.d_out for lin in p.linears) / w.tp


def round_up(n_bytes: float, granule_bytes: int = ALLOC_GRANULE_BYTES) -> int:
    """`n_bytes` rounded up to a whole number of allocator blocks (bytes)."""
    return int(math.ceil(n_bytes / granule_bytes) * granule_bytes)


def estimate_memory(w: Workload, reserve_fraction: float, context_bytes: int) -> MemoryBreakdown:
    """The per-GPU breakdown; `reserve_fraction` and `context_bytes` come from the calibration."""
    spec = w.model
    p = count_params(spec)
    s = _local_sizes(w, p)
    st = _states(w, p, s)
    quant_ws = _quant_workspace(w, p)
    temps = st.temporaries
    if w.training:
        t = _training(w, p, s)
        fb = _forward_backward(w, p, s, t)
        acts, cache = fb.activations, fb.casts
        logits = max(0.0, fb.total - acts - cache - quant_ws)
        kv = 0
        accumulated = st.gradients if w.grad_accum > 1 else 0.0
        fwd_bwd = acts + logits + cache + quant_ws + accumulated
        # once the gradients are (nearly) complete: the optimizer's temporaries, or the end of the
        # backward when that is larger and sets the peak (see the module docstring)
        late = max(temps, _end_of_backward(w, s, t), _bottom_layer_backward(w, p, s, t))
        if st.gradients + late > fwd_bwd:
            temps = late
        step = st.gradients + temps
        phase = "forward/backward" if fwd_bwd >= step else "optimizer step"
        transient = max(fwd_bwd, step)
        persistent = st.weights + st.optimizer + st.master + st.zero_buffers
    else:
        acts = _inference_working_set(w, spec, p)
        logits = 0
        cache = 0
        kv = inference_kv_bytes(spec, w.batch, w.seq, w.new_tokens, kv_dtype_bytes(w), w.tp)
        kv_layer = kv / spec.num_layers  # DynamicCache grows by concatenation: one layer copied
        transient = max(acts, quant_ws) + kv_layer   # a dequantized weight lives only in its matmul
        phase = "prefill"
        persistent = st.weights + kv
    allocated = int(persistent + transient)
    reserved = round_up(allocated * (1.0 + reserve_fraction))
    nccl = overhead("nccl_buffers_bytes") if w.world_size > 1 else 0
    device_used = reserved + context_bytes + nccl + int(st.paged)
    return MemoryBreakdown(
        weights_bytes=int(st.weights), gradients_bytes=int(st.gradients),
        optimizer_states_bytes=int(st.optimizer), master_weights_bytes=int(st.master),
        activations_bytes=int(acts), logits_and_loss_bytes=int(logits), kv_cache_bytes=int(kv),
        optimizer_temporaries_bytes=int(temps), autocast_weight_cache_bytes=int(cache),
        quant_workspace_bytes=int(quant_ws), zero_buffers_bytes=int(st.zero_buffers),
        paged_optimizer_bytes=int(st.paged), cuda_context_bytes=int(context_bytes),
        nccl_buffers_bytes=int(nccl), allocator_reserve_bytes=reserved - allocated,
        peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
        device_used_bytes=int(device_used), host_bytes=int(st.host), peak_phase=phase,
    )
