"""profiler/trace/allocator.py: the CUDA caching allocator's placement rules, by hand-counted cases
(c10/cuda/CUDACachingAllocator.cpp defaults), and the tracer's use of it."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from profiler.trace.allocator import CachingAllocator, allocation_size, round_size
from profiler.trace.tracker import LiveBytes

MiB = 2**20


@pytest.mark.parametrize("nbytes,rounded", [(1, 512), (512, 512), (513, 1024), (3 * MiB + 1, 3 * MiB + 512)])
def test_requests_round_to_512_bytes(nbytes, rounded):
    assert round_size(nbytes) == rounded


@pytest.mark.parametrize("size,segment", [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB),
                                          (10 * MiB - 512, 20 * MiB), (10 * MiB, 10 * MiB),
                                          (11 * MiB, 12 * MiB)])
def test_segment_sizes(size, segment):
    assert allocation_size(size) == segment


def test_a_freed_block_serves_the_next_request_of_its_size_at_its_address():
    a = CachingAllocator()
    x = a.malloc(64 * MiB)
    y = a.malloc(64 * MiB)
    assert y != x
    a.free(x)
    assert a.malloc(64 * MiB) == x
    assert a.reserved_bytes == 128 * MiB and a.segments == 2


def test_best_fit_takes_the_smallest_block_that_fits_then_the_lowest_address():
    a = CachingAllocator()
    big, mid1, mid2 = a.malloc(40 * MiB), a.malloc(30 * MiB), a.malloc(30 * MiB)
    for addr in (big, mid2, mid1):
        a.free(addr)
    assert a.malloc(30 * MiB) == mid1          # 30 MiB blocks fit better than 40; mid1 is lower
    assert a.malloc(30 * MiB) == mid2
    assert a.malloc(25 * MiB) == big           # only the 40 MiB one is left: split, front handed out
    assert a.malloc(15 * MiB) == big + 25 * MiB
    assert a.reserved_bytes == 100 * MiB


def test_a_large_request_under_10_mib_gets_a_20_mib_segment_that_later_requests_split():
    a = CachingAllocator()
    first = a.malloc(5 * MiB)
    assert a.malloc(5 * MiB) == first + 5 * MiB
    assert a.malloc(9 * MiB) == first + 10 * MiB
    assert a.reserved_bytes == 20 * MiB
    assert a.malloc(2 * MiB) != first + 19 * MiB   # 1 MiB left: not split off (kSmallSize), new segment
    assert a.reserved_bytes == 40 * MiB


def test_a_remainder_of_1_mib_stays_with_the_block():
    a = CachingAllocator()
    a.malloc(11 * MiB)                   # a 12 MiB segment; 1 MiB left is not more than kSmallSize
    assert a.allocated_bytes == 12 * MiB


def test_small_requests_share_a_2_mib_segment():
    a = CachingAllocator()
    x = a.malloc(1000)
    assert a.malloc(100) == x + 1024
    assert a.reserved_bytes == 2 * MiB and a.allocated_bytes == 1536


def test_freed_neighbours_merge():
    a = CachingAllocator()
    x, y, z = a.malloc(8 * MiB), a.malloc(8 * MiB), a.malloc(4 * MiB)   # one 20 MiB segment
    a.free(y)
    a.free(x)
    assert a.malloc(16 * MiB) == x       # x and y merged into one 16 MiB block
    a.free(z)
    assert a.reserved_bytes == 20 * MiB


def test_freeing_twice_is_an_error():
    a = CachingAllocator()
    x = a.malloc(MiB)
    a.free(x)
    with pytest.raises(ValueError):
        a.free(x)
    assert a.malloc(0) is None


def test_the_tracker_places_fake_storages_where_the_allocator_would():
    with FakeTensorMode():
        tracker = LiveBytes()
        with tracker:
            x = torch.empty(16 * MiB, dtype=torch.uint8)
            first = tracker.address_of(x)
            del x
            y = torch.empty(16 * MiB, dtype=torch.uint8)
            z = torch.empty(16 * MiB, dtype=torch.uint8)
            assert tracker.address_of(y) == first
            assert tracker.address_of(z) != first
            assert tracker.allocator.peak_reserved_bytes == 32 * MiB


def test_reserved_is_traced_only_when_asked_and_never_below_allocated():
    from profiler.case import Case
    from profiler.trace import trace

    case = Case("Qwen/Qwen2.5-0.5B-Instruct", {"method": "lora", "batch": 1, "seq": 128}, 1, 1)
    plain = trace(case)
    assert plain.peak_reserved_bytes is None and plain.extrapolated
    with_reserved = trace(case, reserved=True)
    assert not with_reserved.extrapolated and with_reserved.layers_traced == (24,)
    assert with_reserved.peak_reserved_bytes >= with_reserved.peak_allocated_bytes
    # the second step's allocated peak is the one step's (states made in the first or up front)
    assert abs(with_reserved.peak_allocated_bytes - plain.peak_allocated_bytes) <= 0.002 * plain.peak_allocated_bytes
