"""DoRA (peft `LoraConfig(use_dora=True)`): what it adds to a LoRA/QLoRA step, from peft 0.21.2's code.

`DoraLinearVariant.forward` (tuners/lora/variants.py) and `DoraLinearLayer.forward`
(tuners/lora/dora.py), per adapted linear and forward pass, with lora_dropout 0 (the Workload's,
as profiler/build.py builds it: the base layer's output is reused as `base_result`):

1. `get_lora_weight`: `lora_B(lora_A(eye(d_in)))`, the identity in the adapters' dtype run through
   both adapters (autocast: cast to half first); lora_A saves the identity, lora_B the d_in x r
   product, the d_in x d_out result is `lora_weight` (its graph has no consumer: it is detached).
2. `lora_weight.to(x.dtype)`, then the base weight (a bitsandbytes base dequantized to the dtype it
   was loaded in) `.to(x.dtype)`: copies when the dtypes differ.
3. `get_weight_norm`: `scaling * lora_weight` and `weight + that` (d_out x d_in each), the row norm.
4. `mag_norm_scale = magnitude / norm` (d_out), `lora_result = lora_B(lora_A(x))`, then
   `(mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling`: three token x d_out
   temporaries in the magnitude's dtype; autograd keeps base_result and lora_result (token x d_out
   each) and three d_out vectors (the norm, mag_norm_scale, mag_norm_scale - 1).
Everything of 1-3 lives until the module's forward returns: a transient of d_in^2 + several d_out x
d_in matrices per adapted linear, largest on the widest d_in (down_proj). With gradient
checkpointing it comes back in the recomputation, once nearly every gradient exists (the bottom
layer). x is cast to the adapters' dtype before the variant runs (peft's `Linear.forward`; the 4-bit
layer skips the cast under autocast, so x keeps its own dtype there).

The trainable magnitude vectors (one d_out per adapted linear) are counted in
`estimator.states.lora_params`. Checked against fake-tensor traces of the real step (tests/test_dora.py,
profiler/trace/grid.py's DoRA cases).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from estimator.lora_targets import matched
from estimator.model import ModelSpec


class DoraDtypes(NamedTuple):
    """Bytes per element of what one DoRA module makes (see the module docstring)."""

    autocast: bool
    quantized: bool
    adapter: int      # the adapters as stored (the identity's dtype, the magnitude's)
    lora_weight: int  # the identity's product (half under autocast)
    weight: int       # the base weight as read (a 4-bit base: dequantized to its load dtype)
    compute: int
    linear_out: int   # the base layer's output (bitsandbytes: its input's dtype)


def dtypes_of(autocast: bool, quantized: bool, adapter: int, compute: int, linear_out: int, amp: bool) -> DoraDtypes:
    """The module's dtypes from the activation formulas' own (estimator.activations.Dtypes): the
    identity's product in half under autocast, else in the adapters' dtype; the base weight as
    loaded (fp32 under AMP; a 4-bit base dequantizes to that dtype)."""
    return DoraDtypes(autocast, quantized, adapter, compute if autocast else adapter, 4 if amp else compute,
                      compute, linear_out)


def x_bytes(dt: DoraDtypes, role: str) -> int:
    """x inside the variant: peft casts it to the adapters' dtype, except the 4-bit layer under
    autocast, whose x is its input as it comes (the fp32 stream of a kbit-prepared model; o_proj
    reads the attention output in the compute dtype)."""
    if dt.quantized and dt.autocast:
        return dt.compute if role == "o_proj" else dt.linear_out
    return dt.adapter


def saved_bytes_per_out(dt: DoraDtypes, role: str) -> int:
    """Bytes per token and output feature kept for the backward: base_result and lora_result."""
    base = dt.compute if (dt.quantized and dt.autocast and role == "o_proj") else dt.linear_out
    lora = dt.compute if dt.autocast else dt.adapter
    return base + lora


def module_transient(dt: DoraDtypes, d_in: int, d_out: int, rank: int, role: str, tokens: float) -> float:
    """The largest of one module's DoRA transients (bytes), beyond what it saves: inside
    get_lora_weight, at each cast, in get_weight_norm and at the token-wide arithmetic."""
    x = x_bytes(dt, role)
    lw = dt.lora_weight
    made = d_in * d_in * dt.adapter + (d_in * d_in * lw if dt.autocast else 0)
    m1 = made + d_in * rank * lw + d_in * d_out * lw                  # lora_B's output, the fp32 eye still alive
    base = d_in * d_in * lw + d_in * rank * lw                        # what lora_weight's graph keeps
    m2 = base + d_in * d_out * (lw + (x if x != lw else 0))           # lora_weight.to(x.dtype)
    lwf = d_in * d_out * x
    dequant = d_out * d_in * dt.weight if dt.quantized else 0        # bitsandbytes' dequantized weight
    cast = d_out * d_in * x if dt.weight != x else 0                  # weight.to(x.dtype)
    m3 = base + lwf + dequant + cast
    resident = cast or dequant
    m4 = base + lwf + resident + 2 * d_out * d_in * x                 # scaling * lora_weight, weight + it
    m5 = base + lwf + resident + 3 * dt.adapter * d_out * tokens      # (m - 1) * base, m * lora * s, their sum
    return float(max(m1, m2, m3, m4, m5))


@lru_cache(maxsize=1024)
def layer_modules(spec: ModelSpec, targets: tuple[str, ...]) -> tuple[tuple[int, int, str, int], ...]:
    """(d_in, d_out, role, how many) of the adapted linears in and around the decoder layers (a fused
    module holding several roles, GPT-2's c_attn, is one module)."""
    counts: dict[tuple[int, int, str], int] = {}
    for s in matched(spec, targets):
        if s.kind != "linear" or s.roles[0] == "vision":   # a VL tower's activations are not modelled
            continue
        role = s.roles[0] if len(s.roles) == 1 else "+".join(s.roles)
        counts[(s.d_in, s.d_out, role)] = counts.get((s.d_in, s.d_out, role), 0) + 1
    return tuple((d_in, d_out, role, n) for (d_in, d_out, role), n in counts.items())


def per_layer_outs(spec: ModelSpec, targets: tuple[str, ...]) -> tuple[float, float]:
    """(output features of the adapted linears per decoder layer, averaged over the layers; the
    o_proj share of them)."""
    total = o_proj = 0
    for _, d_out, role, n in layer_modules(spec, targets):
        total += d_out * n
        if role == "o_proj":
            o_proj += d_out * n
    layers = max(spec.num_layers, 1)
    return total / layers, o_proj / layers


def transient_bytes(spec: ModelSpec, targets: tuple[str, ...], rank: int, dt: DoraDtypes, tokens: float) -> float:
    """The largest module transient of the model (bytes; one module at a time)."""
    return max((module_transient(dt, d_in, d_out, rank, role, tokens)
                for d_in, d_out, role, _ in layer_modules(spec, targets)), default=0.0)


def forward_flops(spec: ModelSpec, targets: tuple[str, ...], rank: int) -> float:
    """DoRA's token-independent FLOPs of one forward pass: the identity through lora_A and lora_B
    (2 d_in^2 r + 2 d_in r d_out) and the weight norm (scale, add, square and sum: 4 d_out d_in)
    per adapted linear."""
    return float(sum(n * (2 * d_in * d_in * rank + 2 * d_in * rank * d_out + 4 * d_out * d_in)
                     for d_in, d_out, _, n in layer_modules(spec, targets)))


def forward_bytes(spec: ModelSpec, targets: tuple[str, ...], rank: int, dt: DoraDtypes) -> float:
    """Bytes DoRA's token-independent work of one forward pass moves (memory-bound: the thin
    matmuls of the identity have arithmetic intensity about r): the identity written and read, the
    d_in x d_out product written, cast and read, the base weight read (and cast), the scaled and
    summed matrices written and read, per adapted linear."""
    total = 0.0
    for d_in, d_out, role, n in layer_modules(spec, targets):
        x = x_bytes(dt, role)
        lw = dt.lora_weight
        eye = 2 * d_in * d_in * lw
        product = d_in * d_out * (lw + (lw + x if x != lw else 0))
        weight = d_out * d_in * (dt.weight + (x if dt.weight != x else 0))
        norm = d_out * d_in * x * 5      # read lora_weight, write scaled; read both, write the sum; read it
        total += n * (eye + product + weight + norm)
    return total


def token_bytes_per_out(dt: DoraDtypes) -> int:
    """Forward bytes per token and output feature of DoRA's arithmetic: (m - 1) * base (read base,
    write), m * lora (read, write), * scaling (read, write), the sum (read two, write), added to the
    result (read two, write) and cast back."""
    m = dt.adapter
    return dt.linear_out + m + dt.compute + m + 2 * m + 3 * m + dt.linear_out + m + m + dt.linear_out


def outs_all(spec: ModelSpec, targets: tuple[str, ...]) -> int:
    """Output features of every adapted decoder linear (the token-wide arithmetic's width)."""
    return sum(d_out * n for _, d_out, _, n in layer_modules(spec, targets))

