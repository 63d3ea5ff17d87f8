"""Step time, throughput, communication, job time and cost (docs/design.md section 4).

Convention: the achieved fraction the tables hold (`mfu.csv`, calibration `mfu`) is HFU, the
fraction of the dense peak the GEMMs reach on the FLOPs the GPU executes (activation recomputation
included), so a checkpointed run pays its recompute once. Compute time of a micro-batch is the sum
of roofline terms of `estimator.compute_time` (GEMMs by size, attention, elementwise, LoRA
adapters, dequantization). The `mfu` reported is model FLOPs (no recompute) / (step x peak).

Training step = compute + exposed communication + optimizer step + gradient clipping (the HF
Trainer's max_grad_norm, `clip_seconds`) + fixed per-step overhead, where
compute = grad_accum x max(roofline of the micro-batch, its launch floor: operators dispatched
(estimator.ops) x host seconds per operator; none under torch.compile):
- communication per step (ring collectives, bytes each GPU sends over the slowest link it
  crosses, the inter-node link when nodes > 1): DDP all-reduces the gradients once per step
  (2(n-1)/n x G; no_sync under accumulation); ZeRO 1/2 reduce-scatter the gradients every
  micro-batch ((n-1)/n x G) and all-gather the updated weights after the step; ZeRO-3 all-gathers
  every weight in the forward and again in the backward of every micro-batch (2(n-1)/n x P, the
  frozen base of LoRA/QLoRA included, in its stored dtype) and reduce-scatters the gradients;
- prefetch hides the overlappable traffic behind compute, each collective within the compute
  it can overlap: the gathers (and the parameter-offload copies) behind the whole step's compute,
  a gradient reduction only behind the backward of its micro-batch (DDP's all-reduce and FSDP's
  reduce-scatter under no_sync run once, in the last micro-batch's backward; DeepSpeed reduces in
  every micro-batch's). exposed = max(what the link carries beyond the step's compute, what the
  reductions carry beyond their backward windows) + the tail (`comm_tail_layers` layers'
  traffic) + what runs after the backward (ZeRO 1/2's weight all-gather);
- optimizer step: bytes of weights, gradients, optimizer states and master weights it reads and
  writes, over achieved memory bandwidth (elementwise, memory-bound); the clipping before it reads
  the gradients for their norm and scales them in place (3 x gradient bytes, same bandwidth).
Inference = prefill (compute-bound, never under the launch floor) + new_tokens decode steps; a
decode step is max(bytes of weights and KV cache / achieved bandwidth, launch floor) with
floor = layers x host seconds per layer (eager generate; 0 compiled), plus for eager attention the
K/V bytes expanded to the query heads at its own achieved fraction, plus 2 all-reduces per layer
under tensor parallel; bitsandbytes weights multiply the half-precision step by their measured
slowdown. Each constant is a row of `data/time_constants.csv` with its source.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from estimator import tables
from estimator.compute_time import compute_parts, gemm_passes
from estimator.defaults import time_constant
from estimator.fp8 import converted_weights
from estimator.flops import attention_flops_per_token, decode_flops_per_token, prefill_flops, training_flops
from estimator.memory import MemoryBreakdown, activation_offload_copy_bytes, kv_cache_bytes
from estimator.ops import micro_batch_ops
from estimator.params import count_params
from estimator.regimes import regime
from estimator.states import local_sizes, lora_params, states_key, weights_bytes
from estimator.units import TFLOPS
from estimator.workload import BNB_QUANTS, Workload


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds per optimizer step (training: grad_accum micro-batches) or per generate call."""

    step_s: float
    compute_s: float
    comm_s: float                # all data-parallel traffic of the step, hidden or not
    exposed_comm_s: float        # the part that adds to the step (not hidden behind compute)
    tokens_per_s: float          # all GPUs together; inference: generated tokens / (prefill + decode)
    tokens_per_s_per_gpu: float
    mfu: float                   # achieved model FLOPs / peak (recompute excluded)
    peak_tflops: float
    model_flops_per_step: float
    prefill_s: float = 0.0
    decode_s_per_token: float = 0.0
    optimizer_s: float = 0.0     # the optimizer step (memory-bound)
    overhead_s: float = 0.0      # fixed host work per step (data loading, scheduler, logging)
    clip_s: float = 0.0          # the HF Trainer's gradient clipping before each optimizer step
    hfu: float = 0.0             # the achieved fraction on hardware FLOPs used for compute_s
    decode_tokens_per_s: float = 0.0      # batch / decode_s_per_token (prefill excluded)
    decode_floor_s_per_token: float = 0.0  # launch/host floor of one decode step
    comm_bound: bool = False     # overlappable traffic longer than compute: the step waits on the link
    compute_parts: dict | None = None  # one micro-batch (or the prefill) by bound (estimator.compute_time)
    launch_floor_s: float = 0.0  # training: operators dispatched x host seconds each, per step (estimator.ops)
    launch_bound: bool = False   # the floor, not the roofline, sets compute_s
    microbatch_s: float = 0.0    # training: one micro-batch's compute (compute_s / grad_accum)
    reduction_exposed_s: float = 0.0   # several GPUs: what one gradient reduction adds to its micro-batch
    activation_offload_s: float = 0.0  # training, per step: offloading's host copies compute does not hide

    def to_dict(self) -> dict:
        return asdict(self)


def peak_flops(gpu: tables.GpuSpec, w: Workload) -> float:
    """Dense peak FLOP/s for the workload's matmul dtype (fp32 matmuls do not use TF32 in
    PyTorch unless asked: torch.backends.cuda.matmul.allow_tf32 defaults to False)."""
    return gpu.peak_flops(w.compute_dtype)


def _link(w: Workload, gpu: tables.GpuSpec, inter_node: str) -> tables.Interconnect:
    """The slowest link a collective crosses: inside a node, or between nodes."""
    intra = tables.interconnect(gpu.intra_node_interconnect)
    if w.nodes == 1:
        return intra
    inter = tables.interconnect(inter_node)
    # assumes one NIC per GPU (DGX/HGX style): each GPU gets the whole inter-node bandwidth
    return inter if inter.bandwidth_bytes_per_s < intra.bandwidth_bytes_per_s else intra


@dataclass(frozen=True)
class Comm:
    """Data-parallel traffic of one optimizer step, in seconds on the link."""

    overlappable_s: float   # can hide behind compute (prefetched gathers, bucketed reductions)
    tail_s: float           # cannot: the first gather and the last reduction
    after_s: float          # runs after the backward (ZeRO 1/2 weight all-gather)
    reduce_s: float = 0.0   # of overlappable_s: one gradient reduction, hidden only in a backward
    reduces: int = 0        # gradient reductions per step (1 under no_sync, grad_accum for DeepSpeed)
    reduce_tail_s: float = 0.0   # of tail_s: one reduction's share (its last layers' buckets)

    def last_reduction_exposed_s(self, backward_s: float) -> float:
        """What one gradient reduction adds to its micro-batch (the profiler's `sync_microbatch_s`
        minus `nosync_microbatch_s`): its part beyond the backward window, plus its tail."""
        return max(0.0, self.reduce_s - backward_s) + self.reduce_tail_s

    @property
    def total_s(self) -> float:
        return self.overlappable_s + self.tail_s + self.after_s

    def exposed_s(self, compute_s: float, backward_s: float | None = None) -> float:
        """Seconds not hidden: the link busy beyond the step's compute (`compute_s`), or the
        reductions beyond the backward of their micro-batch (`backward_s`; None: the whole
        compute), whichever is more, plus the tail and what runs after the backward."""
        link = max(0.0, self.overlappable_s - compute_s)
        window = compute_s if backward_s is None else backward_s
        reductions = self.reduces * max(0.0, self.reduce_s - window)
        return max(link, reductions) + self.tail_s + self.after_s


def _gathered_bytes(w: Workload) -> float:
    """Bytes of every weight one GPU holds before ZeRO-3 partitioning (frozen base in its stored
    dtype, adapters fp32): what ZeRO-3 all-gathers."""
    key = states_key(w)
    p = count_params(w.model)
    adapters = 4.0 * lora_params(w, p) / (w.tp * w.pp) if w.method != "full" else 0.0
    fp8_saved = 0.0
    if key.fp8_gather:   # torchao float8 all-gather: converted weights move in fp8, 1 B instead of 2
        fp8_saved = converted_weights(w.model, p) / (w.tp * w.pp)
    return weights_bytes(key, p, local_sizes(key, p)) + adapters - fp8_saved


def _sharded(w: Workload) -> bool:
    """Weights gathered per use: ZeRO-3, FSDP full shard and hybrid shard."""
    return w.zero == 3 or w.fsdp in ("full", "hybrid")


def host_link(gpu: tables.GpuSpec) -> tables.Interconnect:
    """The GPU's link to host memory: gpus.csv's host_interconnect (an SXM board: NVLink between
    GPUs, PCIe to the host), else its peer link when that is PCIe, else PCIe 4.0 x16 where the
    datasheet at hand does not say (the slower link: more copy time, not less)."""
    name = gpu.host_interconnect or gpu.intra_node_interconnect
    return tables.interconnect(name if name.startswith("pcie") else "pcie4-x16")


def communication(w: Workload, gpu: tables.GpuSpec, inter_node: str, off: frozenset = frozenset(),
                  link_fraction: float = 1.0) -> Comm:
    """The step's traffic per GPU (module docstring) over the slowest link; hybrid shard keeps the
    gathers and reduce-scatters inside the node and all-reduces the gradient shards across nodes;
    parameter offload adds the host-to-GPU copy of each shard per gather. `link_fraction`: the share
    of the links' bandwidth the collectives reach (a calibration's `comm_bandwidth_fraction`, fitted
    from measured reductions; 1: the interconnect table's per-direction peak)."""
    n = w.dp
    if not w.training:
        return Comm(0.0, 0.0, 0.0)
    copies = 0.0     # parameter offload: each shard copied from the host to the GPU per gather, one GPU too
    if w.offload == "optimizer+params" and "offload" not in off:
        copies = w.grad_accum * 2.0 * _gathered_bytes(w) / n / host_link(gpu).bandwidth_bytes_per_s
    if n == 1:
        tail = min(copies, copies / w.model.num_layers * time_constant("comm_tail_layers"))
        return Comm(copies - tail, tail, 0.0)
    p = count_params(w.model)
    trainable = p.total if w.method == "full" else lora_params(w, p)
    grad = trainable / (w.tp * w.pp) * (2 if w.compute_dtype != "fp32" else 4)
    k = w.grad_accum
    link = _link(w, gpu, inter_node)
    hybrid = w.fsdp == "hybrid" and w.nodes > 1 and "hybrid" not in off
    if hybrid:   # the shard group is one node: its collectives run on the intra-node link
        link = tables.interconnect(gpu.intra_node_interconnect)
        n = max(1, regime(w).fsdp_shard)
    ring = (n - 1) / n
    bw, hop = link.bandwidth_bytes_per_s * link_fraction, 2 * (n - 1) * link.latency_s
    after = gathered = 0.0
    if _sharded(w) or w.fsdp == "grad-op":
        gathers = 1.0 if w.fsdp == "grad-op" else 2.0    # grad-op keeps the forward's gather for the backward
        reduces = 1 if (w.fsdp != "none" and k > 1) else k   # accelerate's no_sync under FSDP
        gathered = k * gathers * ring * _gathered_bytes(w) / bw + k * 2 * hop
        one = ring * grad / bw + k * hop / reduces
    elif w.zero in (1, 2):
        reduces, one = k, ring * grad / bw + hop
        after = ring * grad / bw + hop      # the updated weights' all-gather, after the step
    else:
        reduces, one = 1, 2.0 * ring * grad / bw + hop     # DDP: one all-reduce (no_sync before it)
    if hybrid:   # replicas all-reduce their gradient shard over the inter-node link, after each reduce-scatter
        inter = tables.interconnect(inter_node)
        r = w.dp // n
        one += (2.0 * (r - 1) / r * grad / n / (inter.bandwidth_bytes_per_s * link_fraction)
                + 2 * (r - 1) * inter.latency_s / reduces)
    total = gathered + copies + reduces * one
    tail = min(total, total / w.model.num_layers * time_constant("comm_tail_layers"))
    keep = (total - tail) / total if total > 0 else 0.0     # the tail taken evenly from both
    return Comm(total - tail, tail, after, reduce_s=one * keep, reduces=reduces, reduce_tail_s=one * (1.0 - keep))


def comm_seconds(w: Workload, gpu: tables.GpuSpec, inter_node: str) -> float:
    """All data-parallel communication of one optimizer step (hidden or not)."""
    return communication(w, gpu, inter_node).total_s


def offload_seconds(w: Workload, gpu: tables.GpuSpec) -> float:
    """ZeRO-Offload / FSDP CPU offload optimizer step (Ren et al., "ZeRO-Offload", USENIX ATC 2021,
    section 4: gradients to the host, Adam on the CPU, updated half-precision weights back): the
    gradient copy (2 bytes per trainable parameter of this rank), the host Adam step (bytes of fp32
    weights, gradients and both moments read and written over host memory bandwidth) and the weights'
    copy back (2 bytes), none hidden behind compute (the delayed update is off by default)."""
    p = count_params(w.model)
    trainable = p.total if w.method == "full" else lora_params(w, p)
    local = trainable / (w.tp * w.pp) / w.dp
    pcie = host_link(gpu).bandwidth_bytes_per_s
    adam = local * time_constant("host_adam_bytes_per_param") / time_constant("host_adam_bytes_per_s")
    return 2.0 * local / pcie + adam + 2.0 * local / pcie


def optimizer_seconds(w: Workload, gpu: tables.GpuSpec, memory: MemoryBreakdown,
                      off: frozenset = frozenset()) -> float:
    """The optimizer step streams the trainable weights (read and written), their gradients, the
    optimizer states and master weights (read and written) once; offloaded states step on the host
    (`offload_seconds`)."""
    if w.offload != "none":
        return 0.0 if "offload" in off else offload_seconds(w, gpu)
    p = count_params(w.model)
    trainable = p.total if w.method == "full" else lora_params(w, p)
    local = trainable / (w.tp * w.pp) / (w.dp if (w.zero >= 1 or w.fsdp != "none") else 1)
    weight_bytes = 4 if (w.precision == "fp32" or w.amp or w.method != "full") else 2
    moved = (2 * local * weight_bytes + memory.gradients_bytes
             + 2 * (memory.optimizer_states_bytes + memory.master_weights_bytes))
    return moved / (gpu.memory_bandwidth_bytes_per_s * time_constant("optimizer_bandwidth_fraction"))


def clip_seconds(w: Workload, gpu: tables.GpuSpec, memory: MemoryBreakdown,
                 off: frozenset = frozenset()) -> float:
    """The HF Trainer clips the gradients before every optimizer step (TrainingArguments.max_grad_norm,
    1.0 by default; transformers 5.23 trainer.py `_clip_grad_norm`: accelerate's clip_grad_norm_,
    torch.nn.utils.clip_grad_norm_): the norm reads every gradient this GPU holds, the scaling reads
    and writes them again, memory-bound like the optimizer step. Under offload the gradients are
    clipped on the host with the optimizer step (`offload_seconds`); DeepSpeed clips its own fp32
    gradient partition (`gradient_clipping`, which the HF integration fills from max_grad_norm):
    the same bytes, counted in `memory.gradients_bytes`."""
    if not w.training or w.offload != "none" or "clip" in off:
        return 0.0
    return 3.0 * memory.gradients_bytes / (gpu.memory_bandwidth_bytes_per_s
                                           * time_constant("optimizer_bandwidth_fraction"))


def backward_share(w: Workload) -> float:
    """The share of a micro-batch's compute its backward takes (the window a gradient reduction
    can hide in): the GEMM passes after the forward over all of them (`compute_time.gemm_passes`:
    input and weight gradients of a trained GEMM, the input gradient of a frozen one, the
    recomputed forward under checkpointing, which runs inside the backward)."""
    trained, frozen = gemm_passes(w)
    passes = trained if w.method == "full" else frozen
    return (passes - 1.0) / passes


def train_time(w: Workload, gpu: tables.GpuSpec, hfu: float, memory: MemoryBreakdown,
               inter_node: str, off: frozenset = frozenset(), host_s_per_op: float | None = None,
               link_fraction: float = 1.0, step_overhead_s: float | None = None) -> TimeBreakdown:
    """`off`: mechanisms left out (estimator.compute_time names, "hybrid", "offload", "launch_floor",
    "clip"; the bench's ablation). `host_s_per_op`: a calibration's launch floor per operator (None:
    the time_constants.csv default). `link_fraction`: `communication`'s. `step_overhead_s`: a
    calibration's fixed host work per step (None: the time_constants.csv default)."""
    flops = training_flops(w)
    peak = peak_flops(gpu, w)
    parts = compute_parts(w, gpu, hfu, off)
    floor = 0.0 if "launch_floor" in off else launch_floor_seconds(w, host_s_per_op)
    micro_batch = max(parts.total_s, floor)
    compute = w.grad_accum * micro_batch
    comm = communication(w, gpu, inter_node, off, link_fraction)
    exposed = comm.exposed_s(compute, micro_batch * backward_share(w))
    opt = optimizer_seconds(w, gpu, memory, off)
    clip = clip_seconds(w, gpu, memory, off)
    overhead = time_constant("step_overhead_s") if step_overhead_s is None else step_overhead_s
    copies = w.grad_accum * activation_offload_seconds(w, gpu, micro_batch)
    step = compute + exposed + opt + clip + overhead + copies
    tokens = w.batch * w.seq * w.grad_accum
    model_flops = w.grad_accum * flops.model_flops
    return TimeBreakdown(step, compute, comm.total_s, exposed, tokens * w.dp / step, tokens / (step * w.tp * w.pp),
                         model_flops / (step * peak), peak / TFLOPS, model_flops, optimizer_s=opt,
                         overhead_s=overhead, clip_s=clip, hfu=hfu, comm_bound=comm.overlappable_s > compute,
                         compute_parts=parts.to_dict(), launch_floor_s=w.grad_accum * floor,
                         launch_bound=floor > parts.total_s, microbatch_s=micro_batch,
                         reduction_exposed_s=comm.last_reduction_exposed_s(micro_batch * backward_share(w)),
                         activation_offload_s=copies)


def activation_offload_seconds(w: Workload, gpu: tables.GpuSpec, micro_batch_s: float) -> float:
    """What activation offloading's copies add to one micro-batch (TRL's OffloadActivations,
    profiler/offload.py; memory.activation_offload_copy_bytes): the forward copies every offloaded save
    to pinned host memory and the backward copies them back, over the GPU's host link (`host_link`).
    TRL copies on a side stream, so each direction hides behind its pass's compute at best (the
    forward waits only on the copy five saves back; the backward's copy can run while the GPU works
    through what the host queued before): what takes longer than its pass shows."""
    out, back = activation_offload_copy_bytes(w)
    if not out:
        return 0.0
    link = host_link(gpu).bandwidth_bytes_per_s
    backward = micro_batch_s * backward_share(w)
    return max(0.0, out / link - (micro_batch_s - backward)) + max(0.0, back / link - backward)


def launch_floor_seconds(w: Workload, host_s_per_op: float | None = None) -> float:
    """Host floor of one eager training micro-batch: the operators it dispatches (estimator.ops,
    counted from the real code) x `training_host_s_per_op`. The GPU runs kernels as fast as the
    host issues them, so a step whose kernels are shorter than their dispatch waits on the host.
    torch.compile fuses the operators (its count is not modelled): no floor."""
    if w.compiled:
        return 0.0
    per_op = time_constant("training_host_s_per_op") if host_s_per_op is None else host_s_per_op
    return micro_batch_ops(w) * per_op


def _slowdown(w: Workload) -> float:
    """Measured decode slowdown of bitsandbytes weights against half precision (time ratio)."""
    if w.quant == "int8":
        return time_constant("bnb_int8_decode_slowdown")
    if w.quant in ("nf4", "fp4"):
        return time_constant("bnb_4bit_decode_slowdown")
    return 1.0


def decode_floor_seconds(w: Workload, host_s_per_layer: float | None = None) -> float:
    """Launch/host floor of one decode step: decoder layers x host seconds per layer (eager: the
    calibrated value when a table gives one, `host_s_per_layer`; compiled: none)."""
    if w.compiled:
        per_layer = time_constant("decode_host_s_per_layer_compiled")
    else:
        per_layer = time_constant("decode_host_s_per_layer_eager") if host_s_per_layer is None else host_s_per_layer
    return math.ceil(w.model.num_layers / w.pp) * per_layer


@dataclass(frozen=True)
class DecodeParts:
    """One decode step (whole batch): bytes streamed, the GPU time of eager attention over the
    expanded cache, the launch floor, the time after both (tensor-parallel all-reduces) and the
    quantized weights' slowdown.

    step = (max(moved / achieved bandwidth + attention, floor, flops bound) + extra) x slowdown.
    Eager PyTorch issues kernels asynchronously: the GPU streams the weights and runs the attention
    while the host is still issuing the step's later layers, so the GPU's work and the host's floor
    overlap and the slower of the two sets the step (the first H100 run, calibrations/measurements/
    h100-80gb/h100-first-contact-2026-11-27.csv: Llama-3.1-8B decode took 22.8 ms per step at batch 1
    and 23.3 ms at batch 8 with 8x the cache, at the 32-layer host floor both times)."""

    moved_bytes: float
    attention_s: float
    floor_s: float
    extra_s: float
    slowdown: float


def decode_parts(w: Workload, gpu: tables.GpuSpec, memory: MemoryBreakdown, cached: int,
                 host_s_per_layer: float | None = None) -> DecodeParts:
    a = w.activation_dtype_bytes
    weights = memory.weights_bytes
    if w.quant in BNB_QUANTS:   # the half-precision step, times the measured slowdown
        weights = count_params(w.model).total / (w.tp * w.pp) * a
    moved = weights + kv_cache_bytes(w.model, w.batch, cached, a, w.tp)
    attention = 0.0
    if not w.compiled:      # K and V broadcast to the query heads, once per layer
        expanded = attention_flops_per_token(w.model, cached) / 2 * a * w.batch / w.tp
        attention = expanded / (gpu.memory_bandwidth_bytes_per_s * time_constant("decode_attention_bandwidth_fraction_eager"))
    extra = 2 * w.model.num_layers / w.pp * time_constant("tp_allreduce_latency_s") if w.tp > 1 else 0.0
    return DecodeParts(moved, attention, decode_floor_seconds(w, host_s_per_layer), extra, _slowdown(w))


def decode_step_seconds(w: Workload, gpu: tables.GpuSpec, hfu: float, bandwidth_fraction: float,
                        memory: MemoryBreakdown, cached: int, host_s_per_layer: float | None = None) -> float:
    """One decode step for the whole batch with `cached` tokens in the cache (`DecodeParts`)."""
    d = decode_parts(w, gpu, memory, cached, host_s_per_layer)
    gpu_s = d.moved_bytes / (gpu.memory_bandwidth_bytes_per_s * bandwidth_fraction) + d.attention_s
    bound = max(gpu_s, d.floor_s, decode_flops_per_token(w, cached) / (peak_flops(gpu, w) * hfu))
    return (bound + d.extra_s) * d.slowdown


def inference_time(w: Workload, gpu: tables.GpuSpec, hfu: float, bandwidth_fraction: float,
                   memory: MemoryBreakdown, off: frozenset = frozenset(),
                   host_s_per_layer: float | None = None) -> TimeBreakdown:
    """Prefill is compute-bound (never under the launch floor); each decode step as
    `decode_step_seconds`, at the mean cache size (the cache grows linearly)."""
    peak = peak_flops(gpu, w)
    prefill_work = prefill_flops(w)
    parts = compute_parts(w, gpu, hfu, off)
    floor = decode_floor_seconds(w, host_s_per_layer)
    prefill = max(parts.total_s, floor)
    per_token = 0.0
    if w.new_tokens:
        per_token = decode_step_seconds(w, gpu, hfu, bandwidth_fraction, memory, w.seq + w.new_tokens // 2,
                                        host_s_per_layer)
    decode_total = per_token * w.new_tokens
    step = prefill + decode_total
    generated = w.batch * w.new_tokens
    tokens = generated if generated else w.batch * w.seq
    model_flops = prefill_work + (decode_flops_per_token(w, w.seq + w.new_tokens // 2) * w.new_tokens)
    decode_rate = w.batch / per_token if per_token else 0.0
    return TimeBreakdown(step, prefill, 0.0, 0.0, tokens * w.dp / step, tokens / step, model_flops / (step * peak),
                         peak / TFLOPS, model_flops, prefill, per_token, hfu=hfu,
                         decode_tokens_per_s=decode_rate, decode_floor_s_per_token=floor,
                         compute_parts=parts.to_dict())


@dataclass(frozen=True)
class JobCost:
    """A whole job: steps from samples, global batch and epochs; cost from a per-GPU-hour price."""

    samples: int
    epochs: float
    global_batch: int
    steps: int
    job_s: float
    gpu_hours: float
    usd_per_gpu_hour: float | None   # None: the price table marks the GPU as having no public price
    cost_usd: float | None           # None with it: no cost, never a zero
    price_source: str
    retry_factor: float
    price_row: str = ""       # the price table row used, in words (tables.Price.label), or "no price (...)"

    def to_dict(self) -> dict:
        return asdict(self)


def job_cost(w: Workload, step_s: float, samples: int, epochs: float, retry_factor: float,
             price: tables.Price | tables.Unpriced) -> JobCost:
    """Steps, time and GPU-hours of the job; its cost at `price`, or none (`usd_per_gpu_hour` and
    `cost_usd` None, `price_row` "no price (...)") when the table marks the GPU as unpriced."""
    global_batch = w.batch * w.grad_accum * w.dp
    steps = math.ceil(samples * epochs / global_batch)
    job_s = steps * step_s * retry_factor
    gpu_hours = job_s / 3600.0 * w.world_size
    if isinstance(price, tables.Unpriced):
        return JobCost(samples, epochs, global_batch, steps, job_s, gpu_hours, None, None,
                       f"{price.source} ({price.date})", retry_factor,
                       f"no price (no public on-demand price for {price.slug}, searched {price.date})")
    return JobCost(samples, epochs, global_batch, steps, job_s, gpu_hours, price.usd_per_gpu_hour,
                   gpu_hours * price.usd_per_gpu_hour,
                   f"{price.provider} {price.pricing}, {price.source} ({price.date})", retry_factor,
                   price.label() + ("" if w.nodes == 1 or price.multi_node == "yes"
                                    else f"; multi-node availability {price.multi_node}"))
