"""Operators one micro-batch dispatches: the count behind the launch floor of a step (issue 11).

Every operator PyTorch runs eagerly costs host time whatever its size (Python and C++ dispatch,
autograd's bookkeeping, the kernel launch), and the GPU cannot run ahead of the host that issues
its kernels: a small model's step is bound by how many operators it dispatches, not by its FLOPs
or bytes (estimator.timing: compute = max(roofline, operators x seconds per operator)).

The counts are data (estimator/data/op_counts.csv, counted from the real code by
scripts/count_ops.py): per decoder layer and outside the layers, per model type, for full
training and LoRA (with and without activation checkpointing) and the inference prefill. A count
is adjusted for what differs from the counted setup: LoRA adapters beyond (or short of) the ones
counted (peft's per-module path is the same code in every family: the `*` lora-adapter rows), and
autocast's casts per decoder linear (the `*` autocast-linear rows). QLoRA dispatches what LoRA
does: bitsandbytes 0.50's MatMul4Bit.forward is a view and one fused gemm_4bit operator
(bitsandbytes/autograd/_functions.py), no more than the linear it replaces. LoRA on GPTQ adds
TorchLinear's torch dequantization per quantized linear in each forward and recomputation
(time_constants.csv gptq_training_*, scripts/check_gptq_lora.py --ops). A model type that was
not counted takes Llama's counts (`counted_type` says which).
"""

from __future__ import annotations

from functools import lru_cache

from estimator import tables
from estimator.defaults import time_constant
from estimator.errors import InputError
from estimator.lora_targets import matched
from estimator.params import count_params
from estimator.workload import INT4_QUANTS, Workload

FALLBACK_TYPE = "llama"


def counted_type(model_type: str) -> str:
    """The model type whose counts stand for `model_type`: its own, else Llama's."""
    return model_type if any(k[0] == model_type for k in tables.op_counts()) else FALLBACK_TYPE


def _adapters(spec, targets: tuple[str, ...]) -> int | None:
    try:
        return len(matched(spec, targets))
    except InputError:
        return None


def _gptq_ops(spec, phase: str, grad_ckpt: bool) -> float:
    """LoRA on GPTQ: operators TorchLinear adds over nn.Linear in one phase (time_constants.csv
    gptq_training_*): its torch dequantization and separate bias add in each forward and each
    recomputation (checkpointing runs it in the backward), the bias add's backward."""
    linears = count_params(spec).dense_linears
    count = sum(lin.count for lin in linears)
    biased = sum(lin.count for lin in linears if lin.bias)
    dequant = count * time_constant("gptq_training_ops_per_linear")
    if phase == "forward":
        return dequant + biased * time_constant("gptq_training_ops_per_bias")
    backward = biased * time_constant("gptq_training_backward_ops_per_bias")
    if grad_ckpt:
        backward += dequant + biased * time_constant("gptq_training_recompute_ops_per_bias")
    return backward


@lru_cache(maxsize=4096)
def micro_batch_ops(w: Workload) -> float:
    """Operators one micro-batch dispatches on one GPU: forward + backward for training (the
    recomputed forward of checkpointed layers included), the prefill for inference; a pipeline
    stage runs its share of the layers."""
    spec = w.model
    table = tables.op_counts()
    mt = counted_type(spec.model_type)
    layers = spec.num_layers / w.pp
    if not w.training:
        row = table[(mt, "inference", False, "prefill")]
        return layers * row.per_layer + row.outside / w.pp
    method = "full" if w.method == "full" else "lora"
    total = 0.0
    for phase in ("forward", "backward"):
        row = table[(mt, method, w.grad_ckpt, phase)]
        n = layers * row.per_layer + row.outside / w.pp
        if method == "lora":
            counted = _adapters(spec, tuple(row.lora_targets.split(",")))
            user = _adapters(spec, w.lora_targets)
            if counted is not None and user is not None:   # checkpointed: the recompute runs them again
                per_adapter = table[("*", "lora-adapter", w.grad_ckpt, phase)].per_layer
                n += (user - counted) * per_adapter / w.pp
        if w.amp:
            linears = _adapters(spec, ("all-linear",)) or 0
            n += linears * table[("*", "autocast-linear", w.grad_ckpt, phase)].per_layer / w.pp
        if w.quant in INT4_QUANTS:
            n += _gptq_ops(spec, phase, w.grad_ckpt) / w.pp
        total += n
    return max(total, 0.0)
