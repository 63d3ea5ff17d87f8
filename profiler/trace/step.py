"""The tracer: the exact tensor memory of a real training or inference step, without a GPU.

The Workload's model is built by `profiler.build.build_model` on `meta` (the same code as the
CUDA path), materialised as fake **cpu** tensors under `FakeTensorMode`, and the same step
functions (`profiler.steps.train_step`, `inference_step`) run on it while `LiveBytes` counts every
live storage, rounded to 512 B as the CUDA caching allocator does. The result predicts
`torch.cuda.max_memory_allocated()` of that step after warm-up, by category and by phase.

Training first puts the model in the state a warm-up step leaves (optimizer states exist,
bitsandbytes biases are cast), then traces one step, as the CUDA measurement times steps after
warm-up. Inference traces one request: prefill (`logits_to_keep=1`) and `new_tokens - 1` decode
steps.

Speed: a few layers are traced and the result extrapolated linearly per layer kind
(`profiler.trace.layers`); `layers=n` traces the first n layers instead, with no extrapolation.
"""

from __future__ import annotations

import resource
import socket
import time
from dataclasses import asdict, dataclass, field, replace

from estimator.files import utc_now
from estimator.versions import library_versions
from estimator.workload import Workload
from profiler.build import build_model, make_batch, make_optimizer, undo_liger_patches
from profiler.env import cpu_name
from profiler.record import check_row, new_row
from profiler.steps import inference_step, train_step
from profiler.trace import layers as tl
from profiler.trace_scope import check_traceable

TRAIN_PHASES = ("forward", "backward", "optimizer")
INFERENCE_PHASES = ("prefill", "decode")
_REPORTED = TRAIN_PHASES + INFERENCE_PHASES  # "setup" (registration) and "after_step" are not


@dataclass(frozen=True)
class TraceResult:
    """Traced memory of one step of a Workload, in bytes (512-B rounded per tensor).

    `by_category` is the breakdown at the peak; `category_max` the largest value each category
    reached; `phases` the peak total within each phase (training: forward, backward, optimizer;
    inference: prefill, decode), `phase_categories` the breakdown at each phase's peak and
    `phase_start` the breakdown when the phase began (at the backward's start, "Activation" is
    what autograd saved for it: `saved_activations_bytes`). Categories are named as PyTorch's
    MemTracker names them (profiler.trace.tracker: "Parameter", "Gradient", "Optstate", ...).
    """

    workload_id: str
    peak_allocated_bytes: int
    peak_phase: str
    by_category: dict
    category_max: dict
    phases: dict
    phase_categories: dict
    phase_start: dict
    num_layers: int
    layers_traced: tuple
    extrapolated: bool
    trace_s: float
    rss_bytes: int
    notes: tuple = field(default_factory=tuple)
    # what torch.cuda.max_memory_reserved() would reach (trace(reserved=True): the allocator model
    # places every storage of a first step, optimizer states made in it as a real one makes them,
    # and of the traced second step; profiler/trace/allocator.py); None when not asked for
    peak_reserved_bytes: int | None = None

    @property
    def saved_activations_bytes(self) -> int | None:
        """Bytes made in the forward and still alive when the backward starts (training)."""
        start = self.phase_start.get("backward")
        from profiler.trace.tracker import ACTIVATION

        return None if start is None else start.get(ACTIVATION, 0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["saved_activations_bytes"] = self.saved_activations_bytes
        d["layers_traced"] = list(self.layers_traced)
        d["notes"] = list(self.notes)
        return d


@dataclass(frozen=True)
class _Measure:
    """One traced model: the peak of each part of each phase ("phase/part", see
    LiveBytes.watch_layers) with its breakdown, each phase's start, category maxima."""

    parts: dict             # "phase/part" -> total bytes at its peak
    part_categories: dict   # "phase/part" -> {category: bytes} at that peak
    phase_start: dict       # phase -> {category: bytes} when it began
    category_max: dict
    layers: int
    reserved: int | None = None   # the allocator model's peak reserved (two steps), or None


def trace(subject, cfg: dict | None = None, layers: int | None = None, repeats: int = 2,
          reserved: bool = False) -> TraceResult:
    """Trace one step of `subject`: a profiler.case.Case, or a Workload with its raw HF config
    dict `cfg`.

    `layers=None` traces small models (`repeats` layers of each kind, then one more of each) and
    extrapolates to the model's layer count; `layers=n` traces the first n layers only. Raises
    NotImplementedError for what cannot be traced (see profiler/trace_scope.py). `rss_bytes` is the
    peak resident memory of this process so far. `reserved=True` also gives `peak_reserved_bytes`:
    two steps are traced, the first as a real first step runs (the optimizer makes its states inside
    it, where the allocator finds room among the freed activations: the fragmentation a
    checkpointed run's reserved memory shows), the peaks are the second's.
    """
    start = time.perf_counter()
    w, cfg = _resolve(subject, cfg)
    check_traceable(w)
    if layers is None and (w.activation_offload or reserved):
        # where the allocator puts things (which offloaded addresses TRL sees again, how the
        # segments fragment) settles over the whole model, not linearly in its layer count:
        # reserved from 2- and 3-layer traces extrapolated came out 2-38% under the H100 rows
        layers = w.model.num_layers
    if layers is not None and layers >= w.model.num_layers:   # the whole model: nothing to reduce
        measures, weights, extrapolated = [_trace_once(dict(cfg), w, reserved)], (1.0,), False
    elif layers is not None:
        kinds = tl.layer_kinds(cfg, w)[:layers]
        measures, weights = [_trace_once(tl.reduced_config(cfg, kinds), w, reserved)], (1.0,)
        extrapolated = False
    else:
        p = tl.plan(tl.layer_kinds(cfg, w), repeats)
        measures = [_trace_once(tl.reduced_config(cfg, list(kinds)), w, reserved) for kinds in p.models]
        weights, extrapolated = p.weights, len(p.models) > 1
    return _result(w, measures, weights, extrapolated, time.perf_counter() - start)


def _resolve(subject, cfg):
    if isinstance(subject, Workload):
        if cfg is None:
            raise ValueError("trace(workload) needs the model's config dict (cfg)")
        return subject.validate(), cfg
    if not hasattr(subject, "workload"):
        raise TypeError("trace() takes a profiler.case.Case, or a Workload with its config dict")
    return subject.workload(), subject.config()


def _result(w: Workload, measures: list[_Measure], weights, extrapolated: bool, seconds: float) -> TraceResult:
    """Extrapolate every part's peak (each sits at the same point of the step whatever the layer
    count, so each is linear in it), then take each phase's largest part. A part that not every
    traced model has (the middle layers of a two-layer model) never holds a phase's peak: the
    peak over the layers of a linear profile sits at the top or bottom layer."""
    common = set.intersection(*(set(m.parts) for m in measures))  # `mid` needs three layers
    parts = tl.combine([{k: v for k, v in m.parts.items() if k in common} for m in measures], weights)
    part_categories = {key: _positive(tl.combine([m.part_categories.get(key, {}) for m in measures], weights))
                       for key in parts}
    phases, phase_categories = {}, {}
    for key, total in parts.items():
        phase = key.partition("/")[0]
        if phase not in phases or total > phases[phase]:
            phases[phase], phase_categories[phase] = total, part_categories[key]
    phase_start = {ph: _positive(tl.combine([m.phase_start.get(ph, {}) for m in measures], weights))
                   for ph in phases}
    peak_phase = max(phases, key=lambda ph: phases[ph])
    return TraceResult(
        workload_id=w.id, peak_allocated_bytes=phases[peak_phase], peak_phase=peak_phase,
        by_category=phase_categories[peak_phase],
        category_max=_positive(tl.combine([m.category_max for m in measures], weights)),
        phases=phases, phase_categories=phase_categories, phase_start=phase_start, num_layers=w.model.num_layers,
        layers_traced=tuple(m.layers for m in measures), extrapolated=extrapolated,
        trace_s=seconds, rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        notes=_notes(w),
        peak_reserved_bytes=(None if any(m.reserved is None for m in measures)
                             else round(sum(wt * m.reserved for wt, m in zip(weights, measures)))),
    )


def _positive(d: dict) -> dict:
    return {k: v for k, v in d.items() if v > 0}


def _notes(w: Workload) -> tuple:
    notes = []
    if w.attn == "flash":
        notes.append("flash_attention_2 is not traced on cpu: SDPA's flash kernel stands in (same saved tensors)")
    if w.quant in ("nf4", "fp4"):
        notes.append("bitsandbytes 4-bit layers traced through a stand-in with the same storage")
    return tuple(notes)


def _trace_once(cfg: dict, w: Workload, reserved: bool = False) -> _Measure:
    """Build the model with `cfg` (already reduced), run the step on fake cpu tensors, count.
    Two steps when the allocator's layout matters (`reserved`, activation offloading: TRL keys
    saved tensors by address), the first with the optimizer states made inside it."""
    layers = _layer_count(cfg)
    try:
        return _trace_built(build_model(cfg, _buildable(w), "meta"), cfg, w, layers, reserved)
    finally:
        undo_liger_patches()


def _trace_built(model, cfg: dict, w: Workload, layers: int, reserved: bool) -> _Measure:
    """`_trace_once` on the model built."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from profiler.offload import fake_addresses
    from profiler.trace.patches import kv_cache_tagging, tracing_patches
    from profiler.trace.tracker import LiveBytes

    with FakeTensorMode(allow_non_fake_inputs=True), tracing_patches(), kv_cache_tagging() as tag:
        _materialize(model, "cpu")
        optimizer = make_optimizer(model, w)
        batch = make_batch(w, cfg.get("text_config", cfg)["vocab_size"], "cpu")
        two_steps = reserved or w.activation_offload
        _warm_up(model, None if two_steps else optimizer, w)
        tracker = LiveBytes()
        _register(tracker, model, optimizer, batch)
        tracker.watch(model, optimizer)
        tracker.watch_layers(_decoder_layers(model, layers))
        tag.append(tracker)
        root = _step_root(model, w)
        handle = root.register_forward_pre_hook(_phase_hook(tracker, w))
        try:
            with tracker, fake_addresses(tracker.address_of):
                if two_steps:
                    _run(model, optimizer, batch, w)
                    tracker.restart()
                    handle.remove()    # the next forward is a prefill again
                    handle = root.register_forward_pre_hook(_phase_hook(tracker, w))
                _run(model, optimizer, batch, w)
        finally:
            handle.remove()
            tracker.close()
    starts = {ph: dict(v) for ph, v in tracker.phase_start.items() if ph in _REPORTED}
    parts = {k: pk for k, pk in tracker.part_peaks.items() if k.partition("/")[0] in _REPORTED}
    return _Measure({k: pk.total for k, pk in parts.items()}, {k: dict(pk.by_category) for k, pk in parts.items()},
                    starts, dict(tracker.category_max), layers,
                    tracker.allocator.peak_reserved_bytes if reserved else None)


def _decoder_layers(model, n: int):
    """The model's ModuleList of its n decoder layers."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"no list of {n} decoder layers found in {type(model).__name__}")


def _warm_up(model, optimizer, w: Workload) -> None:
    """The state a first step leaves behind, without running one: optimizer states (a step on
    zero gradients creates them as a real step does) and the in-place bias casts bitsandbytes'
    Linear4bit makes in its first forward."""
    import torch

    if w.quant in ("nf4", "fp4"):
        from profiler.trace.qlora import stand_in_class

        for module in model.modules():
            if isinstance(module, stand_in_class()) and module.bias is not None:
                module.bias.data = module.bias.data.to(module.compute_dtype)
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _buildable(w: Workload) -> Workload:
    """flash_attention_2 needs the flash_attn package and CUDA: SDPA's flash kernel stands in."""
    return replace(w, attn="sdpa") if w.attn == "flash" else w


def _layer_count(cfg: dict) -> int:
    text = cfg.get("text_config", cfg)   # vision-language configs keep the decoder's keys apart
    return next(text[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if k in text)


def _run(model, optimizer, batch, w: Workload) -> None:
    if w.training:
        train_step(model, optimizer, batch, w, "cpu")
    else:
        inference_step(model, batch, w, "cpu")


def _step_root(model, w: Workload):
    """The module whose forward starts the step: the model, or with `--loss chunked` its decoder
    (profiler.steps `_chunked_loss_step` runs the decoder, then the output projection per chunk)."""
    from profiler.steps import causal_lm

    return causal_lm(model).base_model if (w.training and w.loss == "chunked") else model


def _phase_hook(tracker, w: Workload):
    """Root-module forward pre-hook naming the phase: forward (training), prefill then decode."""
    calls = [0]

    def hook(module, args):
        if w.training:
            tracker.set_phase("forward")
        else:
            tracker.set_phase("prefill" if calls[0] == 0 else "decode")
        calls[0] += 1

    return hook


def _register(tracker, model, optimizer, batch) -> None:
    """Count what exists before the step: parameters, buffers, optimizer states, the batch."""
    from profiler.trace.tracker import BUFFER, GRADIENT, INPUT, OPTSTATE, PARAMETER

    for p in model.parameters():
        tracker.track(p, PARAMETER)
        if p.grad is not None:
            tracker.track(p.grad, GRADIENT)
    for b in model.buffers():
        tracker.track(b, BUFFER)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                tracker.track(value, OPTSTATE)
    for t in (batch.input_ids, batch.labels):
        tracker.track(t, INPUT)


def _materialize(model, device: str) -> None:
    """`to_empty` that keeps shared tensors shared (tied embeddings, shared buffers): nn.Module's
    own to_empty makes a new Parameter per module when the tensor type changes (meta to fake),
    which unties the lm_head from the embedding."""
    memo: dict[int, tuple] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = _empty(memo, p, device, param=True)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = _empty(memo, b, device, param=False)


def _empty(memo: dict, t, device: str, param: bool):
    import torch

    hit = memo.get(id(t))
    if hit is not None:
        return hit[1]
    new = torch.empty_like(t, device=device)
    if param:
        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
        new.__dict__.update(t.__dict__)  # attributes peft/bitsandbytes read (quant_type, ...)
    memo[id(t)] = (t, new)
    return new


def trace_row(case, layers: int | None = None) -> dict:
    """A profiler record row (backend "trace") for a Case: peak_allocated_bytes from the trace,
    every other memory and step column unmeasured (None)."""
    w = case.workload()
    row = new_row(case, "trace", workload=w, world_size=1, warmup=1 if w.training else 0, steps=1,
                  started_at=utc_now(), gpu_name=cpu_name(), hostname=socket.gethostname(),
                  **library_versions())
    start = time.perf_counter()
    try:
        result = trace(case, layers=layers)
        row.update(status="ok", message="", peak_allocated_bytes=result.peak_allocated_bytes)
    except NotImplementedError as exc:
        row.update(status="skipped", message=f"not traceable: {exc}")
    except Exception as exc:  # noqa: BLE001 - a row records any failure as data
        row.update(status="error", message=f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
    row["wall_s"] = time.perf_counter() - start
    return check_row(row)
