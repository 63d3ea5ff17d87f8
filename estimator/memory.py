"""Per-GPU memory of a Workload as a named breakdown in bytes, and the three peaks.

Phases of a training step (steady state, HF Trainer semantics: gradients set to None after each
optimizer step):
- forward/backward: persistent states + saved activations + logits/loss + autocast weight casts
  (+ gradients already accumulated when grad_accum > 1);
- optimizer step: persistent states + gradients + optimizer temporaries.
`peak_allocated_bytes` is persistent + the larger phase. Inference: weights + KV cache + the
larger of the prefill working set and a decode step.

Regimes (DESIGN.md section 3): torch without ZeRO keeps weights, gradients and optimizer states in
the parameter dtype (AMP: fp32 everywhere; pure bf16: 2+2+4 B); DeepSpeed (ZeRO >= 1) with bf16/fp16
keeps half weights and gradients plus fp32 master weights and fp32 Adam states, and casts the half
gradients to an fp32 partition for the update while both are live (2+2+4+4+8 = 20 B before
partitioning, DeepSpeed's own estimator figure).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from estimator import activations as act
from estimator.defaults import overhead
from estimator.model import ModelSpec
from estimator.params import ParamCounts, count_params
from estimator.workload import Workload

_ALLOC_GRANULE = 2 * 2**20  # the caching allocator reserves in 2 MiB blocks (large segments)


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
    parameters, which stay unquantized. Under AMP the model is loaded in fp32 and peft's
    prepare_model_for_kbit_training upcasts every non-quantized parameter to fp32.
    """
    base = _base_dtype_bytes(w)
    if w.quant == "none":
        return s.total * base
    frac = s.linear_w / max(p.linear_weights, 1)
    dense = [lin for lin in p.linears if not lin.expert]
    quantized = sum(lin.weight_params for lin in dense) * frac
    rows = sum(lin.d_out * lin.count for lin in dense) * frac
    other = 4 if w.amp else 2
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
    if w.optimizer == "adafactor":
        return 2 * 4 * largest
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


def _activation_bytes(w: Workload, spec: ModelSpec, layers: int) -> float:
    """Saved activations of one micro-batch on the busiest GPU, plus one layer's backward work."""
    tokens = w.batch * w.seq
    per_layer = act.layer_bytes_per_token(spec, w) + act.score_bytes_per_token(spec, w, w.seq)
    if w.grad_ckpt:
        saved = layers * act.checkpoint_bytes_per_token(spec, w) + per_layer
    else:
        saved = layers * per_layer
    saved += act.outside_layers_bytes_per_token(spec, w)
    in_flight = w.pp  # 1F1B keeps up to pp micro-batches on the first stage
    return tokens * saved * in_flight / w.tp


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


def _inference_working_set(w: Workload, spec: ModelSpec) -> float:
    """Largest transient of the prefill: one layer's MLP or attention scores, plus the logits
    of the last position (generate asks for one position only)."""
    a = w.activation_dtype_bytes
    tokens = w.batch * w.seq
    width, blocks = act.mlp_width(spec)
    mlp = 3 * a * width * min(blocks, spec.experts_per_token or 1) * tokens
    attn = a * (spec.q_dim * 2 + 2 * spec.kv_dim) * tokens
    if w.attn == "eager":
        attn += (2 * a + 4) * spec.num_heads * w.seq * tokens
    residual = (2 * a + 8) * spec.hidden_size * tokens
    logits = w.batch * spec.vocab_size * (a + 4)
    return (max(mlp, attn) + residual) / w.tp + logits


def _quant_workspace(w: Workload, p: ParamCounts) -> float:
    """bitsandbytes dequantizes one weight to the compute dtype per matmul."""
    if w.quant == "none":
        return 0.0
    return 2 * max(lin.d_in * lin.d_out for lin in p.linears) / w.tp


def _autocast_cache(w: Workload, p: ParamCounts, s: _Sizes) -> float:
    """Autocast caches half casts of trainable leaf weights until the forward ends."""
    if not (w.amp and w.method == "full"):
        return 0.0
    head = s.head if s.head else s.embed
    return 2 * (s.linear_w + head) / (w.dp if w.zero == 3 else 1)


def _round_up(n: float, granule: int) -> int:
    return int(math.ceil(n / granule) * granule)


def estimate_memory(w: Workload, reserve_fraction: float, context_bytes: int) -> MemoryBreakdown:
    """The per-GPU breakdown; `reserve_fraction` and `context_bytes` come from the calibration."""
    spec = w.model
    p = count_params(spec)
    s = _local_sizes(w, p)
    st = _states(w, p, s)
    quant_ws = _quant_workspace(w, p)
    if w.training:
        acts = _activation_bytes(w, spec, s.layers)
        logits = act.logits_bytes_per_token(spec, w) * w.batch * w.seq / w.tp
        cache = _autocast_cache(w, p, s)
        kv = 0
        accumulated = st.gradients if w.grad_accum > 1 else 0.0
        fwd_bwd = acts + logits + cache + quant_ws + accumulated
        step = st.gradients + st.temporaries
        phase = "forward/backward" if fwd_bwd >= step else "optimizer step"
        transient = max(fwd_bwd, step)
        persistent = st.weights + st.optimizer + st.master + st.zero_buffers
    else:
        a = w.activation_dtype_bytes
        acts = _inference_working_set(w, spec)
        logits = 0
        cache = 0
        kv = inference_kv_bytes(spec, w.batch, w.seq, w.new_tokens, a, w.tp)
        kv_layer = kv / spec.num_layers  # DynamicCache grows by concatenation: one layer copied
        transient = acts + quant_ws + kv_layer
        phase = "prefill"
        persistent = st.weights + kv
    allocated = int(persistent + transient)
    reserved = _round_up(allocated * (1.0 + reserve_fraction), _ALLOC_GRANULE)
    nccl = overhead("nccl_buffers_bytes") if w.world_size > 1 else 0
    device_used = reserved + context_bytes + nccl + int(st.paged)
    return MemoryBreakdown(
        weights_bytes=int(st.weights), gradients_bytes=int(st.gradients),
        optimizer_states_bytes=int(st.optimizer), master_weights_bytes=int(st.master),
        activations_bytes=int(acts), logits_and_loss_bytes=int(logits), kv_cache_bytes=int(kv),
        optimizer_temporaries_bytes=int(st.temporaries), autocast_weight_cache_bytes=int(cache),
        quant_workspace_bytes=int(quant_ws), zero_buffers_bytes=int(st.zero_buffers),
        paged_optimizer_bytes=int(st.paged), cuda_context_bytes=int(context_bytes),
        nccl_buffers_bytes=int(nccl), allocator_reserve_bytes=reserved - allocated,
        peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
        device_used_bytes=int(device_used), host_bytes=int(st.host), peak_phase=phase,
    )
