"""Count the aten operators one micro-batch dispatches, per decoder layer and outside the layers
(issue 11: the launch floor of estimator.timing).

Every operator PyTorch dispatches costs host time (the Python and C++ dispatch, autograd's
bookkeeping, the kernel launch) whatever its size, so a small model's step is bound by how many
there are, not by its FLOPs or bytes. The count comes from the real code: the model is built by
profiler.build (transformers' modules, peft's LoRA path, checkpointing) with one and with two
decoder layers, on CPU with real tensors at a tiny batch, and the step of profiler.steps runs under
a TorchDispatchMode that counts each operator by phase (the backward is whatever runs inside
autograd's graph task). Per layer = count(2 layers) - count(1 layer); outside = count(1 layer) -
per layer (embedding, final norm, lm_head, loss). Views and in-place ops are counted too: they
cost dispatch time without a kernel.

`count(w, cfg)` -> {phase: (per_layer, outside)}; phases: training "forward", "backward"
(recomputation of a checkpointed layer included), inference "prefill".
"""

from __future__ import annotations

from dataclasses import replace

from estimator.workload import Workload

BATCH, SEQ = 1, 16   # the count does not depend on sizes; tiny keeps the real CPU step fast


def _counted_step(cfg: dict, w: Workload) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from profiler.build import build_model, make_batch
    from profiler.steps import forward_backward

    class _Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if w.training:
                phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            else:
                phase = "prefill"
            self.ops[phase] = self.ops.get(phase, 0) + 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = build_model(cfg, w, "cpu")
    text = cfg.get("text_config", cfg)
    batch = make_batch(w, text["vocab_size"], "cpu")
    counter = _Count()
    if w.training:
        forward_backward(model, batch, w, "cpu")     # warm: lazily built state (rotary caches, ...)
        model.zero_grad(set_to_none=True)
        with counter:
            forward_backward(model, batch, w, "cpu")
    else:
        with torch.no_grad():
            model(input_ids=batch.input_ids, use_cache=False)
            with counter:
                model(input_ids=batch.input_ids, use_cache=False)
    return counter.ops


def count(w: Workload, cfg: dict) -> dict:
    """{phase: (per_layer, outside)} of `w`'s model (its raw HF config `cfg`)."""
    from profiler.trace.layers import layer_kinds, reduced_config

    small = replace(w, batch=BATCH, seq=SEQ, grad_accum=1, new_tokens=1 if w.method == "inference" else 0,
                    gpus=1, zero=0, fsdp="none", offload="none", activation_offload=False).validate()
    kinds = layer_kinds(cfg, w)
    one = _counted_step(reduced_config(cfg, kinds[:1]), small)
    two = _counted_step(reduced_config(cfg, kinds[:2]), small)
    out = {}
    for phase in two:
        per_layer = two[phase] - one.get(phase, 0)
        out[phase] = (per_layer, one.get(phase, 0) - per_layer)
    return out
