"""FSDP2 (`fully_shard`, as accelerate applies it) model states and buffers per GPU.

What torch 2.13 does (torch/distributed/fsdp/_fully_shard/, read in its code):
- every parameter is sharded on its first dimension: rank r holds chunk r of
  `torch.chunk(param, world)` padded to the size of chunk 0, i.e. ceil(dim0 / world) rows
  (`_fsdp_param.py` `_init_sharded_param`, lines 298-316). Rank 0 always holds full chunks: it is
  the busiest, and what this module counts;
- gradients reduce-scatter into one flat buffer per parameter group of the padded shard sizes, cast
  to the parameter's dtype (`_fsdp_collectives.py` `foreach_reduce`, lines 592-708); Adam's states
  are `zeros_like` the local shards;
- with a `MixedPrecisionPolicy(param_dtype=bf16)` a group's parameters are all-gathered into
  bf16 copies for its forward and backward; the next group's all-gather is prefetched (two
  groups' copies alive); `reshard_after_forward=False` (shard-grad-op) keeps every group's copy
  from its forward to its backward; the reduce-scatter input (the group's unsharded gradients in
  the reduce dtype) stays alive until the next group's reduce-scatter;
- accelerate wraps every decoder layer, the untied input embedding, and a tail group of the final
  norm and lm_head (the tied embedding with it) that is not resharded after the forward
  (accelerate 1.15.0 `utils/fsdp_utils.py` `fsdp2_prepare_model`, lines 850-885).
- `CPUOffloadPolicy`: the sharded parameters, gradients and optimizer states live in pinned host
  memory and the optimizer steps on the CPU; the device keeps the all-gathered copies only.

Shard sizes are tested against a 2-rank gloo run of `fully_shard` on CPU (tests/test_fsdp.py);
the all-gather and reduce-scatter buffers follow the code above and are not yet measured.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from estimator.defaults import overhead
from estimator.lora_targets import adapter_shapes
from estimator.model import ModelSpec
from estimator.params import ParamCounts


class Tensor(NamedTuple):
    """`count` parameter tensors of `rows` x `width` elements (rows: the dimension FSDP shards)."""

    rows: int
    width: int
    count: int
    kind: str        # "linear" (quantizable weight), "expert", "other" (embeddings, norms, biases)
    role: str = ""

    def shard(self, world: int) -> int:
        """Elements rank 0 holds, padding included."""
        return math.ceil(self.rows / world) * self.width * self.count


def model_tensors(spec: ModelSpec, params: ParamCounts) -> list[Tensor]:
    """Every parameter tensor of the model as transformers 5 builds it (sharded dimension first).
    MoE experts are fused 3-D tensors (experts x out x in), one per layer and projection."""
    out: list[Tensor] = []
    for lin in params.linears:
        if lin.expert:
            layers = max(spec.num_moe_layers, 1)
            out.append(Tensor(spec.num_experts, lin.d_in * lin.d_out, layers, "expert", lin.role))
            if lin.bias:
                out.append(Tensor(spec.num_experts, lin.d_out, layers, "expert", lin.role))
            continue
        out.append(Tensor(lin.d_out, lin.d_in, lin.count, "linear", lin.role))
        if lin.bias:
            out.append(Tensor(lin.d_out, 1, lin.count, "other", lin.role))
    per_norm = spec.norm_tensors
    norms = spec.norms_per_layer * spec.num_layers + int(spec.final_norm)
    out.append(Tensor(spec.hidden_size, 1, per_norm * norms, "other", "norm"))
    if spec.qk_norm:
        out.append(Tensor(spec.head_dim, 1, per_norm * 2 * spec.num_layers, "other", "norm"))
    if spec.embed_norm:
        out.append(Tensor(spec.embed_dim, 1, per_norm, "other", "norm"))
    out.append(Tensor(spec.vocab_size, spec.embed_dim, 1, "other", "embed"))
    if params.lm_head:
        out.append(Tensor(spec.vocab_size, spec.hidden_size, 1, "other", "lm_head"))
    if params.lm_head_bias:
        out.append(Tensor(spec.vocab_size, 1, 1, "other", "lm_head"))
    if params.positions:
        out.append(Tensor(spec.learned_positions, spec.hidden_size, 1, "other", "positions"))
    if params.router:
        layers = max(spec.num_moe_layers, 1)
        gate = spec.hidden_size * spec.num_experts * layers
        out.append(Tensor(spec.num_experts, spec.hidden_size, layers, "other", "router"))
        if params.router > gate:   # Qwen-MoE's shared expert gate: 1 x hidden per layer
            out.append(Tensor(1, spec.hidden_size, layers, "other", "router"))
    if spec.vision_params:   # a VL model's vision tower: its linears, the rest (patch embedding, norms) as one
        out += [Tensor(d_out, d_in, n, "linear", "vision") for _, d_in, d_out, n in spec.vision_linears]
        out.append(Tensor(spec.vision_other_params, 1, 1, "other", "vision"))
    return out


def adapter_tensors(spec: ModelSpec, rank: int, targets: tuple, dora: bool = False) -> list[Tensor]:
    """peft LoRA's lora_A (rank x d_in) and lora_B (d_out x rank) of every targeted module, and with
    DoRA its magnitude vector (d_out)."""
    out = []
    for d_in, d_out, n in adapter_shapes(spec, targets):
        out += [Tensor(rank, d_in, n, "adapter"), Tensor(d_out, rank, n, "adapter")]
        if dora:
            out.append(Tensor(d_out, 1, n, "adapter"))
    return out


def packed_4bit(t: Tensor) -> Tensor:
    """A quantized weight as bitsandbytes stores it with `bnb_4bit_quant_storage=bf16`: the packed
    nibbles in a ((n + 1) // 4) x 1 bf16 tensor per weight (4 values per element)."""
    return Tensor((t.rows * t.width + 1) // 4, 1, t.count, "packed", t.role)


class FsdpStates(NamedTuple):
    """Bytes per GPU (rank 0): sharded states, replicated quantization state, gathered buffers."""

    weights: float          # frozen and trainable shards (+ replicated absmax of 4-bit weights)
    trainable: float        # trainable elements this rank holds (padding included)
    gradients: float
    buffers: float          # all-gathered compute copies and reduce-scatter buffers at their peak
    host: float             # CPU offload: shards on the host


def quant_state_bytes(t: Tensor, double_quant: bool) -> float:
    """bitsandbytes absmax (and its second-level state) of one quantized weight: not a parameter,
    so FSDP replicates it."""
    n = t.rows * t.width * t.count
    block = overhead("bnb_blocksize_4bit")
    if double_quant:
        return n / block + 4 * n / (block * overhead("bnb_blocksize_4bit_second"))
    return 4 * n / block


def _layer_tensors(tensors: list[Tensor]) -> list[Tensor]:
    """The decoder layers' tensors (a VL model's vision tower: its own groups, gathered before the
    decoder runs, so not among them)."""
    return [t for t in tensors if (t.kind in ("linear", "expert", "adapter") and t.role != "vision")
            or (t.kind == "other" and t.role in ("norm", "router", "q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"))]


def fsdp_states(spec: ModelSpec, params: ParamCounts, *, full: bool, quant: str, double_quant: bool,
                adapters: list[Tensor], world: int, tp: int, frozen_bytes: int, trainable_bytes: int,
                compute_bytes: int, reshard_after_forward: bool, fp8_gather: bool = False,
                train_vision: bool = False) -> FsdpStates:
    """Sharded states on rank 0 and the peak of FSDP's gathered/reduce-scatter buffers (bytes per GPU).

    `full`: every parameter trains (a VL model's vision tower only with `train_vision`, else it is
    frozen, `frozen_bytes` per element); otherwise the base is frozen (`frozen_bytes` per element,
    4-bit linears packed when `quant` is nf4/fp4) and `adapters` train."""
    tensors = model_tensors(spec, params)
    four_bit = quant in ("nf4", "fp4")
    weights, replicated = 0.0, 0.0
    if full:
        frozen = [not train_vision and t.role == "vision" for t in tensors]
        trainable = sum(t.shard(world) for t, f in zip(tensors, frozen) if not f)
        weights += frozen_bytes * sum(t.shard(world) for t, f in zip(tensors, frozen) if f)
    else:
        for t in tensors:
            if four_bit and t.kind == "linear":
                weights += 2 * packed_4bit(t).shard(world)
                replicated += quant_state_bytes(t, double_quant)
            else:
                weights += frozen_bytes * t.shard(world)
        trainable = sum(t.shard(world) for t in adapters)
    weights += trainable * trainable_bytes
    buffers = _buffers(spec, params, tensors, adapters, full, four_bit, compute_bytes, reshard_after_forward,
                       fp8_gather)
    return FsdpStates((weights + replicated) / tp, trainable / tp, trainable * trainable_bytes / tp,
                      buffers / tp, 0.0)


def _buffers(spec: ModelSpec, params: ParamCounts, tensors: list[Tensor], adapters: list[Tensor], full: bool,
             four_bit: bool, cb: int, reshard_after_forward: bool, fp8_gather: bool = False) -> float:
    """The largest of FSDP's transient device buffers (bytes): all-gathered compute copies (the
    current and the prefetched layer; every layer with shard-grad-op), the tail group (final norm
    and lm_head, not resharded after the forward), and in the backward the unsharded gradients
    of a group with its reduce-scatter input and the previous group's (reduce dtype = `cb`).
    `fp8_gather`: torchao's float8 all-gather (`WeightWithDynamicFloat8CastTensor`, accelerate's
    default under FSDP2) gathers the converted linears' weights in fp8, 1 B per element."""
    layers = spec.num_layers
    gathered = 0.0
    for t in _layer_tensors(tensors) + adapters:
        elements = t.rows * t.width * t.count
        if four_bit and t.kind == "linear":
            gathered += elements / 2
        elif fp8_gather and t.kind == "linear" and t.rows % 16 == 0 and t.width % 16 == 0:
            gathered += elements
        else:
            gathered += elements * cb
    layer = gathered / layers
    layer_trainable = (sum(t.rows * t.width * t.count for t in (_layer_tensors(tensors) if full else adapters))
                       * cb / layers)
    head = (params.lm_head or params.embedding) + params.lm_head_bias
    tail, tail_trainable = head * cb, (head * cb if full else 0.0)
    kept = layers * layer if not reshard_after_forward else 2 * layer
    moments = [kept + tail + 2 * tail_trainable,                                   # lm_head's backward
               kept + 3 * layer_trainable + max(0.0, tail_trainable - layer_trainable)]  # a layer's backward
    if params.lm_head:   # untied embedding: its own group, gathered again for its backward
        embed = params.embedding * cb
        moments.append(embed + (2 * embed if full else 0.0) + layer_trainable)
    return max(moments)
