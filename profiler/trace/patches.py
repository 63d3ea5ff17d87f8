"""What the tracer changes while a step runs on fake cpu tensors, so that the step allocates what
it allocates on a CUDA GPU. Each adjustment was found by a failing or differing run; all are
undone when the context exits.

- transformers 5 treats fake tensors as "tracing": `find_packed_sequence_indices` returns a mask
  instead of None, which makes every model build a full 4-D attention mask (and SDPA lose its
  `is_causal` fast path). Our batches are unpadded, unpacked sequences: it returns None, as it
  does on a GPU.
- Dropout: `at::dropout` on CUDA runs the fused `native_dropout`, which saves a 1-byte bool mask;
  on CPU it saves a mask in the input dtype (2-4 B). Training dropout runs `native_dropout` here.
- SDPA with `dropout_p > 0`: CUDA flash/efficient kernels keep only an RNG seed and offset; the CPU
  flash kernel refuses dropout and falls back to the math path (T x T scores). The trace calls it
  with `dropout_p=0`, which saves the same tensors as CUDA flash (minus two 8-byte RNG tensors).
- SDPA with narrower value heads than query/key heads (MLA): CUDA runs the memory-efficient
  kernel (q, k, v, output, an fp32 log-sum-exp), the CPU the math path; the trace calls the
  memory-efficient op.
- Autocast: CUDA runs the ops of its fp32 list (pow, exp, rsqrt, layer_norm, ...) in fp32 and gives
  softmax/log_softmax/sum/cumsum an fp32 result; CPU autocast has no such rule for them. Python
  kernels at the AutocastCPU key apply CUDA's policy (ATen autocast_mode.h, AT_FORALL_FP32 and
  AT_FORALL_FP32_SET_OPT_DTYPE).
- Liger Kernel (when the step's model was patched by it, `_liger_kernels`): its Triton kernels
  write into tensors that torch allocated around them, so a launch is skipped (on fake tensors
  there is nothing to compute; Triton finds no GPU driver here anyway) and the allocations stay
  exact. Its fused linear cross-entropy picks its path by asking the tensors' device: on CUDA it
  writes each logits chunk into one reused buffer (`torch.mm(out=)`), and a trainable lm_head's
  gradient is accumulated in place (`addmm(out=)`, compute capability 8 and newer) where the CPU
  path allocates a weight-sized temporary per chunk. The tracer answers "cuda" to that module's
  own device questions (its allocations stay fake cpu tensors), compute capability 9.0, and the
  CUDA autocast state is the CPU one; its `.item()` (the count of labelled tokens, a scale) is 1.
  Its plain cross-entropy (Granite's loss) counts the labelled tokens and asserts the labels are in
  range, data the fake tensors do not have: the count is 1 and the labels are taken as in range.

`kv_cache_tagging` is not an adjustment: it lets the tracker file the KV cache apart.
"""

from __future__ import annotations

import importlib
import logging
import sys
from contextlib import ExitStack, contextmanager

import torch

# CUDA autocast fp32 ops that CPU autocast leaves alone (checked with
# torch._C._dispatch_has_kernel_for_dispatch_key on torch 2.13).
_FP32_OPS = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
             "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
             "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "logsumexp")
# CUDA autocast gives these an fp32 result (dtype=float32) unless the caller passes a dtype.
_FP32_DTYPE_OPS = ("softmax.int", "log_softmax.int", "cumsum", "cumprod", "sum", "sum.dim_IntList")
_HALF = (torch.float16, torch.bfloat16)


@contextmanager
def tracing_patches():
    """All adjustments together, for the duration of a traced step."""
    with ExitStack() as stack:
        stack.enter_context(_unpacked_sequences())
        stack.enter_context(_cuda_dropout())
        stack.enter_context(_cuda_autocast_policy())
        if "liger_kernel" in sys.modules:   # profiler.build applied it to this step's model
            stack.enter_context(_liger_kernels())
        yield


@contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield old
    finally:
        setattr(obj, name, old)


@contextmanager
def _unpacked_sequences():
    """Unpadded, unpacked batches: no packed-sequence mask, SDPA keeps is_causal."""
    import transformers.masking_utils as masking

    with _patched(masking, "find_packed_sequence_indices", lambda position_ids: None):
        yield


@contextmanager
def _cuda_dropout():
    """Training dropout as CUDA runs it (native_dropout: bool mask); SDPA without dropout."""
    import torch.nn.functional as F

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        out = torch.native_dropout(input, p, True)[0]
        return input.copy_(out) if inplace else out

    sdpa = F.scaled_dot_product_attention

    def sdpa_without_dropout(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        if query.shape[-1] != value.shape[-1]:
            return _efficient_attention(query, key, value, attn_mask, *args, **kwargs)
        return sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

    with _patched(F, "dropout", dropout), _patched(F, "scaled_dot_product_attention", sdpa_without_dropout):
        yield


def _efficient_attention(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """SDPA with value heads narrower than query/key heads (multi-head latent attention): CUDA's
    flash kernel refuses unequal head dims and its memory-efficient kernel runs
    (torch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp `check_head_dim_size_flash`,
    `check_head_dim_size_mem_efficient`); the CPU flash kernel refuses them too and the CPU falls
    back to the math path (T x T scores). Call the memory-efficient op as CUDA's dispatcher does
    (attention.cpp: a boolean mask becomes an additive one in the query's dtype; the log-sum-exp
    only when a gradient is needed), on fake tensors its meta kernel."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        raise NotImplementedError("GQA with unequal q/v head dims is not traced")
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(attn_mask.logical_not(), float("-inf"))
    if torch.is_autocast_enabled("cpu"):     # F.scaled_dot_product_attention is on autocast's half list
        half = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(half) for t in (query, key, value))
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, lse, 0.0, is_causal, scale=scale)[0]


def _fp32_kernel(op):
    """AutocastCPU kernel of a CUDA fp32-list op: half inputs cast to fp32, then the op."""
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            args = [a.float() if isinstance(a, torch.Tensor) and a.dtype in _HALF else a for a in args]
            return op(*args, **kwargs)
    return kernel


def _fp32_dtype_kernel(op, dtype_pos: int):
    """AutocastCPU kernel of a CUDA fp32-result op: dtype=float32 for half inputs unless given."""
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            given = kwargs.get("dtype", args[dtype_pos] if len(args) > dtype_pos else None)
            if given is None and args[0].dtype in _HALF:
                if len(args) > dtype_pos:
                    args = list(args[:dtype_pos]) + [torch.float32] + list(args[dtype_pos + 1:])
                else:
                    kwargs["dtype"] = torch.float32
            return op(*args, **kwargs)
    return kernel


def _dtype_position(op) -> int:
    names = [a.name for a in op._schema.arguments]
    return names.index("dtype")


@contextmanager
def _cuda_autocast_policy():
    """Register the kernels above at the AutocastCPU key; removed on exit."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        for name in _FP32_OPS:
            lib.impl(name, _fp32_kernel(_overload(name)), "AutocastCPU")
        for name in _FP32_DTYPE_OPS:
            op = _overload(name)
            lib.impl(name, _fp32_dtype_kernel(op, _dtype_position(op)), "AutocastCPU")
        yield
    finally:
        lib._destroy()


def _overload(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


@contextmanager
def kv_cache_tagging():
    """While active, every KV-cache update recategorises the layer's cached keys and values as
    "KV cache" in each tracker appended to the yielded list (transformers' `Cache.update`)."""
    from transformers import cache_utils

    from profiler.trace.tracker import KV_CACHE

    trackers: list = []
    original = cache_utils.Cache.update

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = original(self, key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        for tracker in trackers:
            tracker.track(getattr(layer, "keys", None), KV_CACHE)
            tracker.track(getattr(layer, "values", None), KV_CACHE)
        return out

    with _patched(cache_utils.Cache, "update", update):
        yield trackers


# Liger's fused linear cross-entropy (liger-kernel 0.8.5 ops/fused_linear_cross_entropy.py): the
# module whose device questions get CUDA's answer, and the factories it calls with that device.
_FLCE = "liger_kernel.ops.fused_linear_cross_entropy"
_FUSED_MOE = "liger_kernel.ops.fused_moe"
_CE = "liger_kernel.ops.cross_entropy"
_FACTORIES = ("empty", "empty_like", "full", "tensor", "zeros", "zeros_like")


@contextmanager
def _liger_kernels():
    """Triton launches skipped; Liger's fused linear cross-entropy on its CUDA path (see the module
    docstring)."""
    import importlib

    from triton.runtime import jit

    flce = importlib.import_module(_FLCE)
    # Liger imports each op's backends at its first call and logs the ones that fail with their
    # exception, whose traceback holds the calling frames: a log handler that keeps records (pytest's)
    # would keep the step's tensors alive. Import them here, outside the step.
    # (the CuTe DSL, cuTile and Ascend backends fail here, as expected without those packages: quietly)
    registry = importlib.import_module("liger_kernel.backends.registry")
    log = logging.getLogger(registry.__name__)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        for op in tuple(getattr(registry, "_DISCOVERY_MAP", {})):
            registry.list_registered(op)
    finally:
        log.setLevel(level)
    with ExitStack() as stack:
        stack.enter_context(_patched(jit.KernelInterface, "__getitem__", lambda self, grid: _no_launch))
        forward = flce.fused_linear_cross_entropy_forward
        stack.enter_context(_patched(flce, "fused_linear_cross_entropy_forward", _on_cuda(forward)))
        backward = flce.fused_linear_cross_entropy_backward
        stack.enter_context(_patched(flce, "fused_linear_cross_entropy_backward", _unit_scale(backward)))
        moe = importlib.import_module(_FUSED_MOE)
        stack.enter_context(_patched(moe, "compute_routing_metadata", _tile_count(moe.compute_routing_metadata)))
        ce = importlib.import_module(_CE)
        stack.enter_context(_patched(ce, "cross_entropy_forward", _labelled(ce.cross_entropy_forward)))
        stack.enter_context(_patched(ce, "cross_entropy_backward", _unit_scale(ce.cross_entropy_backward)))
        yield


def _labelled(fn):
    """Liger's cross-entropy (liger-kernel 0.8.5 ops/cross_entropy.py, Granite's loss) counts the
    labelled tokens (`.item()`) and asserts the labels are in range (data the fake tensors do not
    have): a count of 1 scales its in-place gradient, and the labels are the batch's own, in range."""
    from torch._subclasses.fake_tensor import FakeTensor

    def run(*args, **kwargs):
        with _patched(FakeTensor, "item", lambda self: 1.0 if self.is_floating_point() else 1), \
                _patched(FakeTensor, "__bool__", lambda self: True):
            return fn(*args, **kwargs)
    return run


def _tile_count(fn):
    """Liger's fused MoE routing (liger-kernel 0.8.5 ops/fused_moe.py `compute_routing_metadata`)
    reads its tile count from the device (`.item()`, data the fake tensors do not have): the most
    it can be, one partial tile per expert beyond the full ones (its two int32 tile arrays)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def run(topk_indices, E, *args, **kwargs):
        block = kwargs.get("block_m_token", args[0] if args else importlib.import_module(_FUSED_MOE).BLOCK_M_TOKEN)
        tiles = -(-topk_indices.numel() // block) + E
        with _patched(FakeTensor, "item", lambda self: tiles):
            return fn(topk_indices, E, *args, **kwargs)
    return run


def _no_launch(*args, **kwargs):
    return None


def _on_cuda(fn):
    """`fn` run with CUDA's answers to its module's device questions."""
    from torch._subclasses.fake_tensor import FakeTensor

    device = FakeTensor.device

    def asked_from_liger(self):
        d = device.fget(self)
        if d.type == "cpu" and sys._getframe(1).f_globals.get("__name__") == _FLCE:
            return torch.device("cuda")
        return d

    def on_cpu(factory):
        def made(*args, **kwargs):
            if "device" in kwargs and kwargs["device"] is not None and torch.device(kwargs["device"]).type == "cuda":
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)
        return made

    autocast_enabled, autocast_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

    def run(*args, **kwargs):
        with ExitStack() as stack:
            stack.enter_context(_patched(FakeTensor, "device", property(asked_from_liger)))
            stack.enter_context(_patched(FakeTensor, "item", lambda self: 1.0 if self.is_floating_point() else 1))
            stack.enter_context(_patched(torch.cuda, "get_device_capability", lambda device=None: (9, 0)))
            stack.enter_context(_patched(torch, "is_autocast_enabled",
                                         lambda device_type=None: autocast_enabled(device_type or "cpu")))
            stack.enter_context(_patched(torch, "get_autocast_dtype",
                                         lambda device_type: autocast_dtype("cpu" if device_type == "cuda" else device_type)))
            for name in _FACTORIES:
                stack.enter_context(_patched(torch, name, on_cpu(getattr(torch, name))))
            return fn(*args, **kwargs)
    return run


def _unit_scale(fn):
    """Liger's backward asks whether the loss gradient is 1 (`torch.equal`, data the fake tensors
    do not have); either answer scales in place, allocating nothing."""
    def run(*args, **kwargs):
        with _patched(torch, "equal", lambda a, b: True):
            return fn(*args, **kwargs)
    return run
