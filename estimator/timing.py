"""Step time, throughput, communication, job time and cost.

Step time = hardware FLOPs / (dense peak FLOP/s x achieved fraction) + the part of the
data-parallel communication not hidden behind compute. Communication volumes per step (ring
collectives, bytes each GPU sends): all-reduce of gradients 2(n-1)/n x G (DDP and ZeRO 1/2, whose
reduce-scatter + all-gather move the same), ZeRO-3 3(n-1)/n x parameter bytes (all-gather in
forward and backward, reduce-scatter of gradients). Decode is bound by bytes read from HBM per
generated token (weights + KV cache) over achieved memory bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from estimator import tables
from estimator.flops import decode_flops_per_token, prefill_flops, training_flops
from estimator.memory import MemoryBreakdown, kv_cache_bytes
from estimator.states import lora_params
from estimator.params import count_params
from estimator.units import TFLOPS
from estimator.workload import Workload


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds per optimizer step (training: grad_accum micro-batches) or per generate call."""

    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    tokens_per_s: float          # all GPUs together
    tokens_per_s_per_gpu: float
    mfu: float                   # achieved model FLOPs / peak, as assumed or calibrated
    peak_tflops: float
    model_flops_per_step: float
    prefill_s: float = 0.0
    decode_s_per_token: float = 0.0

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


def comm_seconds(w: Workload, gpu: tables.GpuSpec, inter_node: str) -> float:
    """Data-parallel communication per optimizer step (training) over the slowest link."""
    n = w.dp
    if not w.training or n == 1:
        return 0.0
    p = count_params(w.model)
    trainable = p.total if w.method == "full" else lora_params(w, p)
    grad_bytes = trainable / (w.tp * w.pp) * (2 if w.compute_dtype != "fp32" else 4)
    ring = (n - 1) / n
    volume = (3.0 if w.zero == 3 else 2.0) * ring * grad_bytes
    link = _link(w, gpu, inter_node)
    latency = 2 * (n - 1) * link.latency_s
    return volume / link.bandwidth_bytes_per_s + latency


def train_time(w: Workload, gpu: tables.GpuSpec, mfu: float, overlap: float,
               inter_node: str) -> TimeBreakdown:
    flops = training_flops(w)
    peak = peak_flops(gpu, w)
    compute = w.grad_accum * flops.hardware_flops / (peak * mfu)
    comm = comm_seconds(w, gpu, inter_node)
    exposed = comm * (1.0 - overlap)
    step = compute + exposed
    tokens = w.batch * w.seq * w.grad_accum
    model_flops = w.grad_accum * flops.model_flops
    return TimeBreakdown(step, compute, comm, exposed, tokens * w.dp / step, tokens / (step * w.tp * w.pp),
                         model_flops / (step * peak), peak / TFLOPS, model_flops)


def inference_time(w: Workload, gpu: tables.GpuSpec, mfu: float, bandwidth_fraction: float,
                   memory: MemoryBreakdown) -> TimeBreakdown:
    """Prefill is compute-bound; each decode step reads the weights and the KV cache once."""
    peak = peak_flops(gpu, w)
    prefill_work = prefill_flops(w)
    prefill = prefill_work / (peak * mfu)
    bandwidth = gpu.memory_bandwidth_bytes_per_s * bandwidth_fraction
    decode_total = 0.0
    a = w.activation_dtype_bytes
    if w.new_tokens:
        mid = w.seq + w.new_tokens // 2  # the cache grows linearly: its mean size is read per step
        kv = kv_cache_bytes(w.model, w.batch, mid, a, w.tp)
        per_token_bytes = memory.weights_bytes + kv
        per_token = max(per_token_bytes / bandwidth, decode_flops_per_token(w, mid) / (peak * mfu))
        decode_total = per_token * w.new_tokens
    step = prefill + decode_total
    generated = w.batch * w.new_tokens
    tokens = generated if generated else w.batch * w.seq
    busy = decode_total if generated else prefill
    model_flops = prefill_work + (decode_flops_per_token(w, w.seq + w.new_tokens // 2) * w.new_tokens)
    return TimeBreakdown(step, prefill, 0.0, 0.0, tokens * w.dp / busy, tokens / busy, model_flops / (step * peak),
                         peak / TFLOPS, model_flops, prefill, decode_total / w.new_tokens if w.new_tokens else 0.0)


@dataclass(frozen=True)
class JobCost:
    """A whole job: steps from samples, global batch and epochs; cost from a per-GPU-hour price."""

    samples: int
    epochs: float
    global_batch: int
    steps: int
    job_s: float
    gpu_hours: float
    usd_per_gpu_hour: float
    cost_usd: float
    price_source: str
    retry_factor: float

    def to_dict(self) -> dict:
        return asdict(self)


def job_cost(w: Workload, step_s: float, samples: int, epochs: float, retry_factor: float,
             price: tables.Price) -> JobCost:
    global_batch = w.batch * w.grad_accum * w.dp
    steps = math.ceil(samples * epochs / global_batch)
    job_s = steps * step_s * retry_factor
    gpu_hours = job_s / 3600.0 * w.world_size
    return JobCost(samples, epochs, global_batch, steps, job_s, gpu_hours, price.usd_per_gpu_hour,
                   gpu_hours * price.usd_per_gpu_hour,
                   f"{price.provider} {price.pricing}, {price.source} ({price.date})", retry_factor)
