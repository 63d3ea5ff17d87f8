"""A model of where PyTorch's CUDA caching allocator puts each block, for the tracer's fake tensors.

Fake tensors have sizes but no memory, so nothing says at which device address a real GPU would
have put them. Two things on a GPU depend on it: what `torch.cuda.memory_reserved()` reaches (the
segments the allocator asked cudaMalloc for, fragmentation included), and code keyed by a storage's
address, such as TRL's activation offloading, which does not offload a saved tensor whose storage
address it is tracking: TRL 0.25.0-1.7.x tracked every offloaded address to the end of the
forward, so a later tensor that the allocator placed in the block of an offloaded tensor already
freed was kept on the device; TRL 1.8.0 tracks it while the tensor is in its forward stash, which a
view it copied first can still meet (profiler/offload.py).

The rules are c10/cuda/CUDACachingAllocator.cpp's with its default settings (one stream, no
max_split_size, no expandable segments, no garbage collection threshold):

- a request is rounded up to a multiple of 512 B (`round_size`, kMinBlockSize); 0 B allocates
  nothing;
- requests up to 1 MiB (kSmallSize) are served from the small pool, larger ones from the large pool;
- `get_free_block`: the smallest free block of the pool that is at least as large, the lowest
  address among equal sizes (BlockComparatorSize: size, then address);
- no such block: a new segment (`get_allocation_size`): 2 MiB for a small request (kSmallBuffer),
  20 MiB for a large one under 10 MiB (kLargeBuffer, kMinLargeAlloc), else the request rounded up
  to 2 MiB (kRoundLarge);
- the block handed out is the front of the block found; the rest is split off as a free block when
  at least 512 B are left in the small pool, more than 1 MiB in the large pool (`should_split`);
- a freed block merges with free neighbours of its segment (`try_merge_blocks`) and goes back to
  its pool; segments are never returned (no `empty_cache`).

Addresses are made up (segments are laid out one after the other with a gap), so two blocks have
the same address only when the allocator would have reused one block for both.
"""

from __future__ import annotations

from bisect import bisect_left, insort

MIN_BLOCK = 512                 # kMinBlockSize
SMALL_SIZE = 1 << 20            # kSmallSize: largest small-pool request
SMALL_BUFFER = 2 << 20          # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 << 20         # kLargeBuffer: the segment of a large request under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 << 20      # kMinLargeAlloc
ROUND_LARGE = 2 << 20           # kRoundLarge
_BASE = 1 << 40                 # first made-up segment address
_GAP = 1 << 30                  # between segments: blocks of two segments never touch


def round_size(nbytes: int) -> int:
    """Bytes of the block a request of `nbytes` gets (kMinBlockSize multiples)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def allocation_size(size: int) -> int:
    """Bytes of the segment cudaMalloc gets when no cached block serves a rounded request."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("addr", "size", "small", "free", "prev", "next")

    def __init__(self, addr: int, size: int, small: bool, free: bool, prev=None, nxt=None) -> None:
        self.addr, self.size, self.small, self.free, self.prev, self.next = addr, size, small, free, prev, nxt


class CachingAllocator:
    """`malloc(nbytes) -> address | None` and `free(address)`; `reserved_bytes` (segments held),
    `peak_reserved_bytes`, `allocated_bytes` (live blocks, rounded), `segments`."""

    def __init__(self) -> None:
        self._pools: dict[bool, list] = {True: [], False: []}   # small? -> sorted (size, addr) of free blocks
        self._blocks: dict[int, _Block] = {}                     # addr -> block (free or not)
        self._next = _BASE
        self.reserved_bytes = 0
        self.peak_reserved_bytes = 0
        self.allocated_bytes = 0
        self.segments = 0

    def malloc(self, nbytes: int) -> int | None:
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        i = bisect_left(pool, (size, -1))
        if i < len(pool):
            _, addr = pool.pop(i)
            block = self._blocks[addr]
        else:
            block = self._new_segment(size, small)
        block.free = False
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.addr + size, remaining, small, True, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._blocks[rest.addr] = rest
            insort(pool, (rest.size, rest.addr))
        self.allocated_bytes += block.size
        return block.addr

    def _new_segment(self, size: int, small: bool) -> _Block:
        total = allocation_size(size)
        block = _Block(self._next, total, small, True)
        self._blocks[block.addr] = block
        self._next += total + _GAP
        self.reserved_bytes += total
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self.segments += 1
        return block

    def free(self, addr: int) -> None:
        block = self._blocks[addr]
        if block.free:
            raise ValueError(f"block {addr:#x} freed twice")
        block.free = True
        self.allocated_bytes -= block.size
        pool = self._pools[block.small]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                pool.pop(bisect_left(pool, (neighbour.size, neighbour.addr)))
                block = self._merge(block, neighbour)
        insort(pool, (block.size, block.addr))

    def _merge(self, block: _Block, neighbour: _Block) -> _Block:
        first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        del self._blocks[second.addr]
        return first
