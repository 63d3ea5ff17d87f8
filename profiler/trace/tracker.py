"""`LiveBytes`: a dispatch mode that keeps the exact sum of live tensor storage, by category and
by phase, the way the CUDA caching allocator counts it for `max_memory_allocated()`.

Every tensor an op returns is looked up by its untyped storage (views share one); a new storage
is counted once, rounded up to 512 B (the allocator's block granularity; 0 B stays 0), and
uncounted when the storage is freed (a weak reference to the storage object, which PyTorch keeps
alive exactly as long as the storage). Fake tensors have storages with sizes but no memory, so the
count is the one a real device would see, without allocating it.

Categories carry the names of PyTorch's own tracker (`torch.distributed._tools.mem_tracker`,
`_MemRefType`): "Parameter" and "Buffer" (registered up front), "Gradient" (`param.grad`,
recategorised by a post-accumulate hook), "Optstate" (the tensors in `optimizer.state`),
"Activation" (any new storage made in a forward, including checkpoint recomputation inside the
backward) and "Temp" (any other new storage made in the backward). Three more tell apart what
MemTracker files elsewhere: "Input" (the batch, registered up front), "KV cache" (what the KV cache
holds, recategorised by the caller) and "Optimizer temp" (new storage inside `optimizer.step()`
that does not end up in `optimizer.state`; MemTracker counts it as "Optstate").

Autograd sums two gradients flowing into one tensor (a residual merge, a weight tied to two
modules) in place when it holds the only reference to one of them (InputBuffer::accumulate,
`can_accumulate_inplace`), which it never does for fake tensors (they are tensor subclasses): an
out-of-place `add` of two backward temporaries run by the engine is counted as the in-place add
a real device does (the result takes over the operand's bytes), into an operand the real engine
could take: not a view (its storage is shared with its base: the weight gradient a linear's
`TBackward` hands on), and not the output of `embedding_dense_backward`. On real tensors (torch
2.13, CPU, `torch.profiler` memory events) a residual merge and a fan-out are summed with `add_`,
while the tied lm_head/embedding weight's two gradients are summed with an out-of-place `add` that
allocates a third embedding-sized tensor, as the first H100 run measured (Qwen2.5-0.5B at 8
tokens: one embedding above the in-place count).

A phase is a name the caller sets (`set_phase`: forward, prefill, decode); the backward is
detected per op (autograd graph task running) and lasts until the optimizer step or the next
phase the caller sets. `watch_layers` splits phases into parts at the decoder layers. Peaks: the
overall peak, and the peak of each part with the categories at that moment (`part_peaks`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as _dense
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from profiler.trace.allocator import MIN_BLOCK as GRANULE  # every block a multiple of 512 B (kMinBlockSize)
from profiler.trace.allocator import CachingAllocator

_ADD = torch.ops.aten.add.Tensor
_EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default

# MemTracker's names (torch.distributed._tools.mem_tracker._MemRefType values)
PARAMETER = "Parameter"
BUFFER = "Buffer"
GRADIENT = "Gradient"
ACTIVATION = "Activation"
TEMP = "Temp"
OPTSTATE = "Optstate"
# the tracer's own, for what MemTracker does not tell apart
INPUT = "Input"
KV_CACHE = "KV cache"
OPTIMIZER_TEMP = "Optimizer temp"

CATEGORIES = (PARAMETER, BUFFER, INPUT, GRADIENT, OPTSTATE, ACTIVATION, KV_CACHE, TEMP, OPTIMIZER_TEMP)


def rounded(nbytes: int) -> int:
    """Bytes the caching allocator hands out for a request of `nbytes` (0 stays 0)."""
    return -(-nbytes // GRANULE) * GRANULE


@dataclass
class Peak:
    """Largest total seen and the bytes per category at that moment."""

    total: int = 0
    by_category: dict = field(default_factory=dict)


class LiveBytes(TorchDispatchMode):
    """Counts live storages; use as a context manager around the step (after registering the
    model, optimizer and inputs with `track`)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, list] = {}      # id(storage) -> [bytes, category, weakref, address]
        self.allocator = CachingAllocator()   # where a GPU would put each storage (trace/allocator.py)
        self._not_stealable: set[int] = set()  # id(storage) of embedding_dense_backward outputs (live)
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak = Peak()
        self.part_peaks: dict[str, Peak] = {}    # "phase/part" -> peak within that part
        self.phase_start: dict[str, dict] = {}   # categories when each phase first ran an op
        self.category_max = dict.fromkeys(CATEGORIES, 0)
        self.phase = "setup"
        self.part = "pre"
        self._in_optimizer = False
        self._forward_depth = 0
        self._handles: list = []

    # ---- registering and recategorising storages -------------------------------------------
    def track(self, tensor, category: str) -> None:
        """Count `tensor`'s storage under `category` (moving it there if already counted)."""
        if not isinstance(tensor, torch.Tensor):
            return
        st = tensor.untyped_storage()
        entry = self._live.get(id(st))
        if entry is None:
            self._add(st, category)
        elif entry[1] != category:
            self.current[entry[1]] -= entry[0]
            entry[1] = category
            self.current[category] += entry[0]
            self._bump_category(category)

    def _add(self, st, category: str, address: int | None = -1) -> None:
        nbytes = rounded(st.nbytes())
        key = id(st)
        ref = weakref.ref(st, lambda _, key=key: self._free(key))
        if address == -1:
            address = self.allocator.malloc(st.nbytes())
        self._live[key] = [nbytes, category, ref, address]
        self.current[category] += nbytes
        self.total += nbytes
        self._bump_category(category)

    def _free(self, key: int) -> None:
        self._not_stealable.discard(key)   # the id may name another storage later
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current[entry[1]] -= entry[0]
            self.total -= entry[0]
            if entry[3] is not None:
                self.allocator.free(entry[3])

    def address_of(self, tensor) -> int | None:
        """The made-up device address of `tensor`'s storage (None when not counted or 0 bytes)."""
        entry = self._live.get(id(tensor.untyped_storage()))
        return None if entry is None else entry[3]

    def _bump_category(self, category: str) -> None:
        if self.current[category] > self.category_max[category]:
            self.category_max[category] = self.current[category]

    def _update_peaks(self, before: dict | None = None) -> None:
        phase = self.current_phase()
        if phase not in self.phase_start:
            self.phase_start[phase] = {k: v for k, v in (before or self.current).items() if v}
        key = f"{phase}/{self.part}"
        pk = self.part_peaks.get(key)
        if pk is None:
            pk = self.part_peaks[key] = Peak()
        if self.total > pk.total:
            pk.total = self.total
            pk.by_category = {k: v for k, v in self.current.items() if v}
            if self.total > self.peak.total:
                self.peak = Peak(self.total, dict(pk.by_category))

    def restart(self) -> None:
        """Forget the peaks, phases and maxima seen so far; keep the live storages and where the
        allocator put them (a step run again starts from the state the first one left)."""
        self.peak = Peak(self.total, {k: v for k, v in self.current.items() if v})
        self.part_peaks.clear()
        self.phase_start.clear()
        self.category_max = dict(self.current)
        self.phase, self.part = "setup", "pre"

    # ---- phases --------------------------------------------------------------------------------
    def current_phase(self) -> str:
        """optimizer inside optimizer.step(); backward from the first backward op until the next
        phase the caller names (so the gap before the optimizer step counts as backward)."""
        if self._in_optimizer:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1 and self.phase != "backward":
            self.phase, self.part = "backward", "loss"
        return self.phase

    def set_phase(self, phase: str) -> None:
        """Start a phase the caller names (forward, prefill, decode), before its first layer."""
        self.phase, self.part = phase, "pre"

    def _new_category(self) -> str:
        if self._in_optimizer:
            return OPTIMIZER_TEMP
        if torch._C._current_graph_task_id() != -1 and self._forward_depth == 0:
            return TEMP
        return ACTIVATION

    def watch(self, model, optimizer=None) -> None:
        """Hooks: gradients of trainable parameters, optimizer.step(), module forwards (to tell
        checkpoint recomputation from other backward work). Removed by `close()`."""
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda q: self.track(q.grad, GRADIENT)))
        self._handles.append(torch.nn.modules.module.register_module_forward_pre_hook(self._enter))
        self._handles.append(torch.nn.modules.module.register_module_forward_hook(self._leave, always_call=True))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._opt_pre))
            self._handles.append(optimizer.register_step_post_hook(
                lambda opt, args, kwargs: self._opt_post(opt)))

    def _enter(self, module, args) -> None:
        self._forward_depth += 1

    def _leave(self, module, args, out) -> None:
        self._forward_depth -= 1

    def watch_layers(self, layers) -> None:
        """Split phases into parts at the decoder layers, so that each part's peak sits at the same
        point of the step whatever the layer count (what layer extrapolation needs): forward
        `pre`, `layers`, `post`; backward `loss` (before the top layer), `top`, `mid`, `bottom`
        (the layer the backward reaches last) and `end` (below the layers)."""
        layers = list(layers)
        for index, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(
                lambda m, args, i=index: self._layer_enter(i, args)))
            self._handles.append(layer.register_forward_hook(
                lambda m, args, out, i=index, n=len(layers): self._layer_leave(i, n, out), always_call=True))

    def _layer_enter(self, index: int, args) -> None:
        if torch._C._current_graph_task_id() != -1:
            return                                  # checkpoint recomputation
        self.part = "layers"
        if index == 0:
            self._hook_grad(args[0] if args else None, lambda g: self._set_part("end"))

    def _layer_leave(self, index: int, n: int, out) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        if index == n - 1:
            self.part = "post"
        part = "top" if index == n - 1 else ("bottom" if index == 0 else "mid")
        self._hook_grad(out[0] if isinstance(out, (tuple, list)) else out, lambda g, p=part: self._set_part(p))

    def _set_part(self, part: str) -> None:
        self.part = part

    @staticmethod
    def _hook_grad(t, fn) -> None:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(fn)

    def _opt_pre(self, optimizer, args, kwargs) -> None:
        self._in_optimizer = True
        self.part = "step"
        self._update_peaks()

    def _opt_post(self, optimizer) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                self.track(value, OPTSTATE)
        self._in_optimizer = False
        self.phase, self.part = "after_step", "pre"

    def _accumulation(self, args, out) -> bool:
        """If `out = args[0] + args[1]` is autograd summing two backward temporaries, count it
        as done in place into the first operand that allows it; True when counted."""
        if (self._in_optimizer or self._forward_depth or len(args) != 2
                or torch._C._current_graph_task_id() == -1 or not isinstance(out, torch.Tensor)):
            return False
        target = out.untyped_storage()
        if id(target) in self._live:
            return False
        for operand in args:
            if not isinstance(operand, torch.Tensor) or operand.dtype != out.dtype:
                continue
            st = operand.untyped_storage()
            entry = self._live.get(id(st))
            if (entry is not None and entry[1] == TEMP and st.nbytes() == target.nbytes()
                    and _dense(operand) and operand.shape == out.shape and not operand._is_view()
                    and id(st) not in self._not_stealable):
                self.current[entry[1]] -= entry[0]
                self.total -= entry[0]
                entry[0] = 0
                address, entry[3] = entry[3], None   # the sum is written into the operand's block
                self._add(target, TEMP, address)
                return True
        return False

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- the dispatch hook -------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = dict(self.current)
        out = func(*args, **(kwargs or {}))
        if func is _ADD and not kwargs and self._accumulation(args, out):
            self._update_peaks(before)
            return out
        if func is _EMBEDDING_BACKWARD and isinstance(out, torch.Tensor):
            self._not_stealable.add(id(out.untyped_storage()))
        flat, _ = tree_flatten(out)
        category = None
        for t in flat:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if id(st) not in self._live:
                    category = category or self._new_category()
                    self._add(st, category)
        self._update_peaks(before)
        return out
