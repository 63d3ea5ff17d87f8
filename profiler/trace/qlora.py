"""A stand-in for bitsandbytes' `Linear4bit` that can live on `meta` and on fake tensors.

A `Params4bit` weight quantizes itself when it moves to a device, which fake tensors cannot do,
so the tracer builds this layer instead (profiler.build calls `stand_in_linear` on `meta`). It
holds exactly the storage a quantized bitsandbytes layer holds on the GPU:

- weight: packed 4-bit values, uint8, shape ((n + 1) // 2, 1) for n = out x in;
- absmax: one per 64-value block, fp32, or with double quantization uint8 plus, per 256 blocks,
  an fp32 second-level absmax, an fp32 offset scalar and the 256-entry fp32 dynamic code (shared
  by all layers, as bitsandbytes caches it per device);
- code: the 16-entry fp32 NF4/FP4 table (one per layer, as `get_4bit_type` makes it).

Its forward follows `bnb.nn.Linear4bit.forward` (input cast to the compute dtype, bias cast to
the compute dtype in place) and the CUDA `gemm_4bit` path for more than 4 tokens: dequantize the
absmax and the weight (to the dtype the weight was loaded in), then `F.linear`; the backward
dequantizes again and multiplies (bitsandbytes' MatMul4Bit.backward). The dequantization runs the
bitsandbytes ops, whose fake kernels give the shapes. It is a subclass of `bnb.nn.Linear4bit` so
that peft wraps it with its 4-bit LoRA layer, as it does the real one.
"""

from __future__ import annotations

import math

import torch

from estimator.workload import Workload

BLOCK = 64           # bitsandbytes 4-bit block size (transformers' default)
BLOCK2 = 256         # second-level block size of double quantization
FUSED_MAX_TOKENS = 4  # bitsandbytes CUDA gemm_4bit: fused kernel at or below 4 rows, else dequantize
_SHARED_CODE2: dict = {}


def _bnb():
    import bitsandbytes as bnb

    return bnb


def _matmul_class():
    """Built lazily: the autograd Function needs torch and bitsandbytes imported."""

    class DequantMatmul(torch.autograd.Function):
        """y = A @ dequant(B).T + bias; the backward dequantizes again for grad A (no grad B)."""

        @staticmethod
        def forward(ctx, A, B, bias, state):
            from bitsandbytes import functional as F

            ctx.state = state
            ctx.B = B
            weight = F.dequantize_4bit(B, state).to(A.dtype)
            return torch.nn.functional.linear(A, weight, bias)

        @staticmethod
        def backward(ctx, grad_output):
            from bitsandbytes import functional as F

            grad_a = None
            if ctx.needs_input_grad[0]:
                grad_a = torch.matmul(grad_output, F.dequantize_4bit(ctx.B, ctx.state).to(grad_output.dtype))
            grad_bias = grad_output.sum(tuple(range(grad_output.dim() - 1))) if ctx.needs_input_grad[2] else None
            return grad_a, None, grad_bias, None

    return DequantMatmul


_MATMUL = None


def _dequant_matmul(A, B, bias, state):
    global _MATMUL
    if _MATMUL is None:
        _MATMUL = _matmul_class()
    return _MATMUL.apply(A, B, bias, state)


def _class():
    bnb = _bnb()

    class TraceLinear4bit(bnb.nn.Linear4bit):
        """Quantized storage of a bitsandbytes 4-bit linear, without a Params4bit."""

        def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype,
                     weight_dtype, quant_type: str, double_quant: bool, device: str = "meta"):
            torch.nn.Module.__init__(self)
            self.in_features, self.out_features = in_features, out_features
            self.compute_dtype, self.compute_type_is_set = compute_dtype, True
            self.quant_state, self.quant_storage = None, torch.uint8
            self.support_avx512bf16_for_cpu = False
            self.weight_dtype, self.quant_type, self.double_quant = weight_dtype, quant_type, double_quant
            n = in_features * out_features
            blocks = math.ceil(n / BLOCK)
            weight = torch.nn.Parameter(torch.empty((n + 1) // 2, 1, dtype=torch.uint8, device=device),
                                        requires_grad=False)
            weight.compress_statistics, weight.quant_type = double_quant, quant_type  # peft reads these
            self.weight = weight
            self.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=weight_dtype, device=device))
                         if bias else None)
            self.register_buffer("code", torch.empty(16, dtype=torch.float32, device=device), persistent=False)
            if double_quant:
                self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=device), persistent=False)
                self.register_buffer("absmax2", torch.empty(math.ceil(blocks / BLOCK2), dtype=torch.float32,
                                                            device=device), persistent=False)
                self.register_buffer("offset", torch.empty((), dtype=torch.float32, device=device), persistent=False)
                self.register_buffer("code2", _shared_code2(device), persistent=False)
            else:
                self.register_buffer("absmax", torch.empty(blocks, dtype=torch.float32, device=device),
                                     persistent=False)

        def state(self):
            """The bitsandbytes QuantState over this layer's tensors."""
            from bitsandbytes.functional import QuantState

            state2 = None
            if self.double_quant:
                state2 = QuantState(absmax=self.absmax2, code=self.code2, blocksize=BLOCK2, dtype=torch.float32)
            return QuantState(absmax=self.absmax, shape=torch.Size([self.out_features, self.in_features]),
                              code=self.code, blocksize=BLOCK, quant_type=self.quant_type,
                              dtype=self.weight_dtype, offset=getattr(self, "offset", None), state2=state2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inp_dtype = x.dtype
            x = x.to(self.compute_dtype)
            bias = self.bias
            if bias is not None:
                if bias.dtype != x.dtype:  # bitsandbytes casts the bias in place on first use
                    bias.data = bias.data.to(x.dtype)
                bias = bias.to(self.compute_dtype)
            tokens = x.numel() // x.shape[-1]
            needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
            if tokens <= FUSED_MAX_TOKENS and not needs_grad:
                out = torch.ops.bitsandbytes.gemm_4bit.default(
                    x, self.weight, [self.out_features, self.in_features], self._absmax_arg(),
                    BLOCK, self.quant_type, bias=bias, **self._nested_args())
            else:
                out = _dequant_matmul(x, self.weight, bias, self.state())
            return out.to(inp_dtype)

        def _absmax_arg(self):
            return self.absmax2 if self.double_quant else self.absmax

        def _nested_args(self) -> dict:
            if not self.double_quant:
                return {}
            return {"absmax_8bit": self.absmax, "absmax_code": self.code2, "absmax_offset": self.offset}

    return TraceLinear4bit


def _shared_code2(device: str) -> torch.Tensor:
    """bitsandbytes keeps one dynamic-map code tensor per device for all second-level states;
    on meta one tensor is shared so that materialising the model keeps it shared."""
    if device != "meta":
        return torch.empty(256, dtype=torch.float32, device=device)
    if "meta" not in _SHARED_CODE2:
        _SHARED_CODE2["meta"] = torch.empty(256, dtype=torch.float32, device="meta")
    return _SHARED_CODE2["meta"]


_CLASS = None


def stand_in_class():
    """The stand-in layer class (a bnb.nn.Linear4bit subclass, built on first use)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _class()
        _dequantize_stand_ins_for_dora(_CLASS)
    return _CLASS


def _dequantize_stand_ins_for_dora(cls) -> None:
    """peft's DoRA (tuners/lora/dora.py) dequantizes the base weight with
    `peft.utils.integrations.dequantize_module_weight`, which knows a bitsandbytes layer by its
    `Params4bit` weight: `bnb.functional.dequantize_4bit(weight.data, weight.quant_state)`, an
    out x in tensor in the dtype the weight was loaded in. The stand-in holds a plain uint8
    Parameter, so DoRA's module gets a function that does the same for a stand-in (the same
    bitsandbytes op over the stand-in's QuantState) and defers to peft's for anything else."""
    from peft.tuners.lora import dora

    original = dora.dequantize_module_weight
    if getattr(original, "_stand_in_aware", False):
        return

    def dequantize_module_weight(module):
        if isinstance(module, cls):
            from bitsandbytes import functional as F

            return F.dequantize_4bit(module.weight.data, module.state())
        return original(module)

    dequantize_module_weight._stand_in_aware = True
    dora.dequantize_module_weight = dequantize_module_weight


def stand_in_linear(linear: torch.nn.Linear, w: Workload, compute_dtype):
    """The stand-in for `linear` quantized as `w.quant` (nf4/fp4), on `meta`."""
    if w.quant not in ("nf4", "fp4"):
        raise NotImplementedError(f"the tracer has a stand-in for 4-bit layers only, not {w.quant}")
    return stand_in_class()(linear.in_features, linear.out_features, linear.bias is not None,
                            compute_dtype, linear.weight.dtype, w.quant, w.double_quant)
