"""Activation offloading as TRL runs it (`SFTConfig(activation_offloading=True)`), for the profiler's
real steps and for the tracer.

What TRL's OffloadActivations does with memory (huggingface/trl @0167b7d
trl/models/activation_offloading.py, from torchtune; defaults use_streams=True, pinned host memory,
min_offload_size=1024, max_fwd_stash_size=5), re-implemented here for its memory behaviour:

- forward, every tensor autograd saves gets a number. It stays on the device (held by the
  offloader until the backward unpacks it) when it is smaller than 1 KiB, is not on the
  accelerator, is a parameter or buffer or shares a parameter's storage, is a torchao float8
  tensor, or when its storage was already offloaded in this forward (the deduplication keeps the
  later saves of one storage on the device). Any other is copied to host memory, and the device
  tensor stays in a forward stash until a tensor numbered 5 later is packed (the copy's stream has
  then surely finished);
- backward: a tensor still in the forward stash is handed back as it is; any other is copied back
  to the device and stays in a backward stash until the autograd node after the one that used it
  has run (TRL frees the previous node's tensors in a hook on the current node); the first node's
  hook empties the forward stash; the end of the backward empties the rest;
- the output head (`get_output_embeddings`) is left out: its saved tensors stay on the device.

TRL keys a storage by its device address, so a saved tensor that the caching allocator put in the
block of an offloaded tensor freed earlier in this forward counts as already offloaded and stays on
the device: on the H100 about a third of the offloadable bytes stayed so (calibrations/measurements/
h100-80gb/h100-second-contact-2026-11-27.csv). The tracer reproduces it by giving fake tensors the
addresses of its model of the allocator (`fake_addresses`, profiler/trace/allocator.py).

`Offloader(device_type, copy)`: `copy(tensor) -> (host, restore)` makes the host copy and returns the
function that brings it back as a new device tensor. On a GPU (`host_copy`) that is a pinned copy;
in the tracer (`profiler.trace`, fake CPU tensors standing for the device) `metadata_copy` keeps no
bytes at all and the restore makes a new tensor of the same layout, which the tracer counts as the
device allocation it is. The tensors' device is the tracer's CPU there, so `device_type` names
which tensors count as on the accelerator.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable

MIN_OFFLOAD_BYTES = 1024     # TRL's min_offload_size
FORWARD_STASH = 5            # TRL's max_fwd_stash_size
FLOAT8_CLASSES = ("Float8TrainingTensor", "ScaledMMConfig", "LinearMMConfig")


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


_FAKE_ADDRESS: list = []   # the tracer's address of a fake tensor (fake_addresses), innermost last


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


def host_copy(pin: bool) -> Callable:
    """The GPU's copy, as TRL makes it: a (pinned) host tensor like the saved one (a broadcast
    tensor, with a zero stride: its storage instead), and the restore that copies it back to the
    device as a new tensor of the same size and stride."""
    import torch

    def copy(t):
        device = t.device
        if 0 in t.stride():
            size, stride, offset = t.size(), t.stride(), t.storage_offset()
            flat = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
            host = torch.empty(flat.shape, dtype=t.dtype, pin_memory=pin, device="cpu")
            host.copy_(flat, non_blocking=pin)

            def restore():
                return torch.as_strided(host.to(device, non_blocking=pin), size, stride, offset)
            return host, restore
        host = torch.empty_like(t, pin_memory=pin, device="cpu")
        host.copy_(t, non_blocking=pin)
        return host, lambda: host.to(device, non_blocking=pin)
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
    `kept` the saved tensors left on the device (each save once)."""

    def __init__(self, model, device_type: str, copy: Callable):
        self.device_type = device_type
        self.copy = copy
        self.params = {_address(p) for p in model.parameters() if p.device.type != "meta"}
        self.tracker: dict[int, tuple] = {}       # number -> ("kept", tensor) | ("host", restore)
        self.seen: dict = {}                      # key -> (weak reference to the storage | None)
        self.fwd_stash: dict[int, object] = {}   # number -> device tensor (kept until 5 later)
        self.bwd_stash: dict[int, object] = {}   # number -> tensor brought back
        self.next_id = 0
        self.node = None
        self.started = False                      # a backward is unpacking
        self.moved = 0
        self.kept = 0

    # ---- forward -----------------------------------------------------------------------------
    def pack(self, t) -> int:
        import torch

        if not self.tracker:              # a new forward: TRL resets its deduplication map
            self.seen.clear()
        self.next_id += 1
        number = self.next_id
        key = (_address(t), t.storage_offset(), t.dtype)
        if (self._seen(key) or t.device.type != self.device_type
                or t.element_size() * t.nelement() < MIN_OFFLOAD_BYTES
                or isinstance(t, torch.nn.Parameter) or type(t).__name__ in FLOAT8_CLASSES
                or _address(t) in self.params):
            self.tracker[number] = ("kept", t)
            self.kept += 1
            return number
        for old in list(self.fwd_stash):   # numbered FORWARD_STASH or more before this one
            if old > number - FORWARD_STASH:
                break
            del self.fwd_stash[old]
        _, restore = self.copy(t)
        self.tracker[number] = ("host", restore)
        self.fwd_stash[number] = t
        self.seen[key] = weakref.ref(t.untyped_storage()) if _is_fake(t) and not _FAKE_ADDRESS else None
        self.moved += 1
        return number

    def _seen(self, key) -> bool:
        """Whether this storage region was offloaded in this forward. A real tensor is keyed by its
        address as TRL keys it, so a later tensor at a freed offloaded tensor's address counts as
        seen, as in TRL; so is a fake one in the tracer (`fake_addresses`: the address its model of
        the caching allocator gives); any other fake one by its live storage object only."""
        if key not in self.seen:
            return False
        ref = self.seen[key]
        if ref is not None and ref() is None:
            del self.seen[key]
            return False
        return True

    # ---- backward ----------------------------------------------------------------------------
    def unpack(self, number: int):
        import torch

        if not self.started:        # the first unpack of a backward: clean up when it ends
            self.started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        kind, value = self.tracker.pop(number)
        if kind == "kept":
            return value
        previous = self._new_node()
        if number in self.fwd_stash:
            t = self.fwd_stash[number]
        else:
            t = value()
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
            self.fwd_stash.clear()
            for number in previous:
                self.bwd_stash.pop(number, None)
            return outputs
        node.register_hook(hook)

    def _backward_done(self) -> None:
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
