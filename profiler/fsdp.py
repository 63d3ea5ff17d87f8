"""FSDP2 (`torch.distributed.fsdp.fully_shard`) and activation offloading, built as the estimator
assumes the stack does it (estimator/fsdp.py, estimator/regimes.py):

- `shard(model, w, device)`: accelerate 1.15.0's `fsdp2_prepare_model` recipe (utils/fsdp_utils.py
  lines 813-885): under mixed precision the trainable parameters are upcast to fp32 unless the
  model holds `Params4bit`; `fully_shard` on every decoder layer, the untied input embedding, a
  tail group of the final norm and lm_head with `reshard_after_forward=False`, then the root;
  `MixedPrecisionPolicy(param_dtype=half, reduce_dtype=half)` as accelerate's `set_mixed_precision`
  sets it (utils/dataclasses.py line 2137) and as the estimator models it (reduce dtype = compute
  dtype in estimator/fsdp.py `_buffers`), not reduce_dtype=fp32; `reshard_after_forward=False` for
  grad-op; `CPUOffloadPolicy` for any --offload.
- `hybrid_refusal(w)`: hybrid shard needs ranks on >= 2 nodes; the profiler launches one node.
Activation offloading (TRL's OffloadActivations) is profiler/offload.py's.
"""

from __future__ import annotations


from estimator.regimes import regime
from estimator.workload import Workload


def hybrid_refusal(w: Workload) -> str | None:
    """Why a Workload cannot be built here (one line), or None."""
    if w.fsdp == "hybrid":
        return ("the profiler does not build fsdp hybrid: it needs ranks on >= 2 nodes and the "
                "profiler's launcher (torchrun --standalone) runs one node")
    return None


def _decoder_layers(base):
    inner = getattr(base, "model", base)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"no decoder layers found on {type(base).__name__} (model.layers) to wrap with fully_shard")
    return list(layers), inner


def shard(model, w: Workload, device: str):
    """`model` wrapped with fully_shard as accelerate does (see the module docstring); returns it."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    rg = regime(w)
    half = torch.bfloat16 if w.compute_dtype == "bf16" else torch.float16
    kwargs: dict = {}
    if rg.fsdp_mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=half)
        four_bit = any(type(p).__name__ == "Params4bit" for p in model.parameters())
        if not four_bit and w.trainable_dtype != "model":   # accelerate: the sharded master copy of what trains is fp32
            for p in model.parameters():
                if p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(torch.float32)
    if w.offload != "none":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.startswith("cuda"))
    reshard = w.fsdp != "grad-op"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers, inner = _decoder_layers(base)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    if not tied:
        fully_shard(embed, reshard_after_forward=reshard, **kwargs)
    tail = [m for m in (getattr(inner, "norm", None), head) if m is not None]
    if tail:
        fully_shard(tail, reshard_after_forward=False, **kwargs)
    fully_shard(model, reshard_after_forward=reshard, **kwargs)
    return model


def host_offload_bytes(model, optimizer) -> int:
    """CPUOffloadPolicy: bytes of this rank's shards on the host (parameters, their gradients and
    the optimizer's states; `step` counters excluded), each storage once. Read after the step, the
    gradients are gone (zero_grad(set_to_none=True)): the host peak holds them too."""
    import torch

    seen, total = set(), 0

    def add(t):
        nonlocal total
        if t is None or not isinstance(t, torch.Tensor):
            return
        t = t.to_local() if hasattr(t, "to_local") else t
        key = t.untyped_storage().data_ptr()
        if t.device.type == "cpu" and t.numel() and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for state in optimizer.state.values():
        for name, value in state.items():
            if name != "step":
                add(value)
    return total


