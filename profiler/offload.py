"""Activation offloading as TRL runs it (`SFTConfig(activation_offloading=True)`), for the profiler's
real steps and for the tracer.

What TRL's OffloadActivations does with memory (huggingface/trl v1.9.0 @f2cd577
trl/models/activation_offloading.py, from torchtune; defaults use_streams=True, pinned host memory,
min_offload_size=1024, max_fwd_stash_size=5), re-implemented here for its memory behaviour:

- forward, every tensor autograd saves gets a number. It stays on the device (held by the
  offloader until the backward unpacks it) when its storage is tracked (below), is smaller than
  1 KiB, is not on the accelerator, is a parameter or buffer or shares a parameter's storage, or is
  a torchao float8 tensor. Any other is copied to host memory (a view that does not start its
  storage is first cloned, a strided one made contiguous: that copy is what stays), and the device
  tensor stays in a forward stash until a tensor numbered 5 later is offloaded (the copy's stream
  has then surely finished);
- tracked storages (the deduplication; the key is the storage's address plus the view's offset, and
  the dtype): an offloaded one while its tensor is in the forward stash, and a later save of one so
  kept until the backward unpacks it. So a storage saved again soon after its offload (an RMSNorm's
  input by its pow and its mul, a hidden state by q, k and v) stays on the device at the later
  saves; one saved again after its tensor left the stash is offloaded again (rotary cos/sin, which
  every layer saves);
- backward: a tensor still in the forward stash is handed back as it is; any other is copied back
  to the device and stays in a backward stash until the autograd node after the one that used it
  has run (TRL frees the previous node's tensors in a hook on the current node); the first node's
  hook empties the forward stash; the end of the backward empties the rest;
- the output head (`get_output_embeddings`) is left out: its saved tensors stay on the device;
- entering the context on a GPU empties the allocator's cache when bitsandbytes is imported.

TRL 0.25.0 to 1.7.x kept an offloaded storage's key to the end of the forward (released since
1.8.0, huggingface/trl#6241), so a saved tensor that the caching allocator put in the block of an
offloaded tensor freed earlier counted as already offloaded and stayed on the device: 13-44% of the
offloaded bytes in whole-model traces and on the H100 (calibrations/measurements/h100-80gb/
h100-second-contact-2026-11-27.csv, which ran it). `legacy_dedupe()` runs that; the tracer
reproduces it by giving fake tensors the addresses of its model of the allocator (`fake_addresses`,
profiler/trace/allocator.py), which it always does (a copied view's key can still meet a new
tensor at its address).

`Offloader(device_type, copy)`: `copy(tensor) -> (host, restore)` makes the host copy and returns the
function that brings it back as a new device tensor. On a GPU (`host_copy`) that is a pinned copy;
in the tracer (`profiler.trace`, fake CPU tensors standing for the device) `metadata_copy` keeps no
bytes at all and the restore makes a new tensor of the same layout, which the tracer counts as the
device allocation it is. The tensors' device is the tracer's CPU there, so `device_type` names
which tensors count as on the accelerator.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager, nullcontext
from typing import Callable

MIN_OFFLOAD_BYTES = 1024     # TRL's min_offload_size
FORWARD_STASH = 5            # TRL's max_fwd_stash_size
FLOAT8_CLASSES = ("Float8TrainingTensor", "ScaledMMConfig", "LinearMMConfig")


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


_FAKE_ADDRESS: list = []   # the tracer's address of a fake tensor (fake_addresses), innermost last
_LEGACY: list = []         # inside legacy_dedupe(): TRL 0.25.0-1.7.x's deduplication


@contextmanager
def legacy_dedupe():
    """While inside, an Offloader made does what huggingface/trl @0167b7d (TRL 0.25.0 to 1.3.x) did:
    an offloaded storage's key stays for the whole forward (as up to 1.7.x), so a later tensor the
    caching allocator puts at a freed offloaded tensor's address stays on the device; no view is
    copied before its host copy (1.4.0 on copy it) and the cache is not emptied (1.5.0 on). The H100
    rows measured on 2026-11-27 ran this (calibrations/measurements/superseded.csv); the tracer
    reproduces them with it (tests/test_measured_h100.py)."""
    _LEGACY.append(True)
    try:
        yield
    finally:
        _LEGACY.pop()


@contextmanager
def fake_addresses(address_of: Callable):
    """While inside, a fake tensor's address is `address_of(tensor)` (the tracer's model of the
    caching allocator, profiler/trace/allocator.py) when it gives one: a later tensor that the
    allocator would put in the block of a freed offloaded one is then seen as TRL sees it on a GPU."""
    _FAKE_ADDRESS.append(address_of)
    try:
        yield
    finally:
        _FAKE_ADDRESS.remove(address_of)


def _address(t) -> int:
    """A real tensor's storage address (TRL's key); a fake one's made-up device address under
    `fake_addresses`, else its storage object's address. A DTensor (FSDP2's parameters) by its
    local shard, as TRL looks at it."""
    t = getattr(t, "_local_tensor", t)
    if not _is_fake(t):
        return t.untyped_storage().data_ptr()
    address = _FAKE_ADDRESS[-1](t) if _FAKE_ADDRESS else None
    return t.untyped_storage()._cdata if address is None else address


def _storage_key(t) -> tuple:
    """TRL's `_get_unique_tensor_key`: the storage's address plus the view's offset (in elements,
    as TRL adds them), and the dtype; a DTensor by its local shard."""
    t = getattr(t, "_local_tensor", t)
    return (_address(t) + t.storage_offset(), t.dtype)


def host_copy(pin: bool) -> Callable:
    """The GPU's copy, as TRL makes it: a (pinned) host tensor like the saved one (a broadcast
    tensor, with a zero stride: its storage instead), and the restore that copies it back to the
    device as a new tensor of the same size and stride. On the simulated device (CPU tensors
    standing for the GPU's, profiler.device.simulated) the host copy is made as host memory, which
    it does not count, and the restore is a new counted tensor, as the GPU's copy back is."""
    import torch

    from profiler.device import simulated

    sim = simulated.active()

    def back(host, device):
        return host.clone() if sim else host.to(device, non_blocking=pin)

    def copy(t):
        device = t.device
        with simulated.host_memory() if sim else nullcontext():
            if 0 in t.stride():
                size, stride, offset = t.size(), t.stride(), t.storage_offset()
                flat = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
                host = torch.empty(flat.shape, dtype=t.dtype, pin_memory=pin, device="cpu")
                host.copy_(flat, non_blocking=pin)
            else:
                host = torch.empty_like(t, pin_memory=pin, device="cpu")
                host.copy_(t, non_blocking=pin)
        if 0 in t.stride():
            return host, lambda: torch.as_strided(back(host, device), size, stride, offset)
        return host, lambda: back(host, device)
    return copy


def metadata_copy(t) -> tuple:
    """The tracer's copy: nothing kept; the restore makes a new tensor of the size the GPU's would
    have (under FakeTensorMode a fake tensor: the device allocation the tracer counts)."""
    import torch

    if 0 in t.stride():
        size, stride, offset, dtype = t.size(), t.stride(), t.storage_offset(), t.dtype
        elements = t.untyped_storage().nbytes() // t.element_size()

        def restore():
            return torch.as_strided(torch.empty(elements, dtype=dtype), size, stride, offset)
        return None, restore
    shape, dtype = t.shape, t.dtype
    return None, lambda: torch.empty(shape, dtype=dtype)


def step_copy(pin: bool) -> Callable:
    """What a step uses: the tracer's metadata copy for a fake tensor, the host copy for a real one."""
    real = host_copy(pin)

    def copy(t):
        return metadata_copy(t) if _is_fake(t) else real(t)
    return copy


class Offloader:
    """The saved-tensor hooks of one model (see the module docstring). `moved` counts host copies,
    `kept` the saved tensors left on the device (each save once); `host_bytes` is what the host
    copies alive hold (made in the forward, freed as the backward brings each back),
    `peak_host_bytes` its peak."""

    def __init__(self, model, device_type: str, copy: Callable):
        self.device_type = device_type
        self.copy = copy
        self.params = {_address(p) for p in model.parameters() if p.device.type != "meta"}
        self.tracker: dict[int, tuple] = {}       # number -> ("kept", tensor) | ("host", (restore, bytes))
        self.tracked: dict = {}                   # storage key -> (number, weak reference | None)
        self.key_of: dict[int, tuple] = {}        # number -> storage key it tracks
        self.fwd_stash: dict[int, object] = {}   # number -> device tensor (kept until 5 later)
        self.bwd_stash: dict[int, object] = {}   # number -> tensor brought back
        self.next_id = 0
        self.node = None
        self.started = False                      # a backward is unpacking
        self.moved = 0
        self.kept = 0
        self.legacy = bool(_LEGACY)                # TRL 0.25.0-1.7.x (legacy_dedupe)
        self.host_bytes = 0
        self.peak_host_bytes = 0

    # ---- forward -----------------------------------------------------------------------------
    def pack(self, t) -> int:
        import torch

        if not self.tracker:              # a new forward: TRL resets its deduplication map
            self.tracked.clear()
            self.key_of.clear()
        self.next_id += 1
        number = self.next_id
        key = _storage_key(t)
        if self._tracked(key):            # a storage offloaded and still stashed, or kept so
            self.tracker[number] = ("kept", t)
            if not self.legacy:
                self._track(key, number, None)
            self.kept += 1
            return number
        if (t.device.type != self.device_type or t.element_size() * t.nelement() < MIN_OFFLOAD_BYTES
                or isinstance(t, torch.nn.Parameter) or type(t).__name__ in FLOAT8_CLASSES
                or _address(t) in self.params):
            self.tracker[number] = ("kept", t)
            self.kept += 1
            return number
        for old in list(self.fwd_stash):   # numbered FORWARD_STASH or more before this one
            if old > number - FORWARD_STASH:
                break
            del self.fwd_stash[old]
            self._release(old)
        original = t
        if not self.legacy and 0 not in t.stride():    # TRL >= 1.4.0 copies a view that does not
            if t.storage_offset() != 0:                 # start its storage, and a strided one (not
                t = t.clone(memory_format=torch.contiguous_format)   # a broadcast)
            elif not t.is_contiguous():
                t = t.contiguous()
        _, restore = self.copy(t)
        nbytes = t.untyped_storage().nbytes() if 0 in t.stride() else t.element_size() * t.nelement()
        self.tracker[number] = ("host", (restore, nbytes))
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        self.fwd_stash[number] = t        # the (copied) device tensor, until 5 later
        self._track(key, number, original)
        self.moved += 1
        return number

    def _track(self, key, number: int, t) -> None:
        """TRL's track_storage_key; for a fake tensor without the tracer's addresses, a weak
        reference to its storage too (its key is the storage object's, which a new one may reuse)."""
        weak = t is not None and _is_fake(t) and not _FAKE_ADDRESS
        ref = weakref.ref(t.untyped_storage()) if weak else None
        self.tracked[key] = (number, ref)
        self.key_of[number] = key

    def _release(self, number: int) -> None:
        """TRL's release_storage_key: the number's key is forgotten unless a later save took it over
        (TRL before 1.8.0 kept every key to the end of the forward)."""
        if self.legacy:
            return
        key = self.key_of.pop(number, None)
        if key is not None and self.tracked.get(key, (None,))[0] == number:
            del self.tracked[key]

    def _tracked(self, key) -> bool:
        """Whether this storage region is tracked: offloaded and still in the forward stash, or a
        later save of such a storage not yet unpacked (TRL >= 1.8.0 releases a key when its tensor
        leaves the stash, huggingface/trl#6241). A real tensor is keyed by its address as TRL keys
        it, so a view that TRL copied (its original may be freed while stashed) can be matched by a
        tensor the allocator later puts at the same address, as on a GPU; so can a fake one in the
        tracer (`fake_addresses`: its model of the caching allocator); any other fake one by its
        live storage object only."""
        if key not in self.tracked:
            return False
        ref = self.tracked[key][1]
        if ref is not None and ref() is None:
            del self.tracked[key]
            return False
        return True

    # ---- backward ----------------------------------------------------------------------------
    def unpack(self, number: int):
        import torch

        if not self.started:        # the first unpack of a backward: clean up when it ends
            self.started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        kind, value = self.tracker.pop(number)
        self._release(number)
        if kind == "kept":
            return value
        restore, nbytes = value
        self.host_bytes -= nbytes          # TRL drops its host copy once it is unpacked
        previous = self._new_node()
        if number in self.fwd_stash:
            t = self.fwd_stash[number]
        else:
            t = restore()
            self.bwd_stash[number] = t
        self._after_node(previous)
        return t

    def _new_node(self) -> list:
        """The numbers brought back so far, when the backward moved on to a new node (TRL lets them
        go once that node has run)."""
        import torch

        node = torch._C._current_autograd_node()
        if node is not None and node is not self.node:
            self.node = node
            return list(self.bwd_stash)
        return []

    def _after_node(self, previous: list) -> None:
        """A hook on the current node: once it has run, the forward stash is emptied and the
        previous node's tensors are let go."""
        import torch

        node = torch._C._current_autograd_node()
        if node is None:
            return

        def hook(outputs, inputs):
            for number in list(self.fwd_stash):
                del self.fwd_stash[number]
                self._release(number)
            for number in previous:
                self.bwd_stash.pop(number, None)
            return outputs
        node.register_hook(hook)

    def _backward_done(self) -> None:
        for number in list(self.fwd_stash):
            self._release(number)
        self.fwd_stash.clear()
        self.bwd_stash.clear()
        self.node = None
        self.started = False


@contextmanager
def offload_activations(model, device_type: str, copy: Callable):
    """Saved tensors handled by an Offloader while the context is open, the output head's left on
    the device (TRL's NoOpManager around it). Yields the Offloader."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(base, "module", base)
    head = base.get_output_embeddings()
    offloader = Offloader(model, device_type, copy)
    if device_type == "cuda" and "bitsandbytes" in sys.modules and not offloader.legacy:
        torch.cuda.empty_cache()   # TRL >= 1.5.0's __enter__ (huggingface/trl#5730): bitsandbytes' buffers
    stack, handles = [], []
    if head is not None:
        def enter(*_):
            ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            ctx.__enter__()
            stack.append(ctx)

        def leave(*_):
            stack.pop().__exit__(None, None, None)

        handles = [head.register_forward_pre_hook(enter), head.register_forward_hook(leave, always_call=True)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
            yield offloader
    finally:
        for h in handles:
            h.remove()
