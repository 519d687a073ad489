from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from services.store_master.allocator import AllocatorError, OffsetAllocator


def test_first_fit_exact_offsets_and_alignment():
    a = OffsetAllocator(1024, alignment=64)
    assert [a.allocate(100), a.allocate(64), a.allocate(1)] == [0, 128, 192]
    assert a.used_bytes == 256
    a.check_integrity()


def test_full_then_none():
    a = OffsetAllocator(256, alignment=64)
    assert [a.allocate(64) for _ in range(4)] == [0, 64, 128, 192]
    assert a.allocate(1) is None
    a.check_integrity()


def test_coalescing_both_sides():
    a = OffsetAllocator(512, alignment=64)
    offs = [a.allocate(128) for _ in range(4)]
    a.free(offs[0])
    a.free(offs[2])
    assert a.free_ranges() == [(0, 128), (256, 128)]
    a.free(offs[1])  # merges with both neighbours
    assert a.free_ranges() == [(0, 384)]
    a.free(offs[3])
    assert a.free_ranges() == [(0, 512)]
    assert a.allocate(512) == 0
    a.check_integrity()


def test_reuse_hole_and_double_free():
    a = OffsetAllocator(512, alignment=64)
    x, y = a.allocate(128), a.allocate(128)
    a.free(x)
    assert a.allocate(64) == 0 and a.allocate(64) == 64
    with pytest.raises(AllocatorError):
        a.free(x + 1)
    a.free(y)
    with pytest.raises(AllocatorError):
        a.free(y)
    a.check_integrity()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300), st.integers(0, 1000)),
                max_size=120))
def test_random_sequences_keep_integrity(ops):
    a = OffsetAllocator(4096, alignment=32)
    live: dict[int, int] = {}
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            off = a.allocate(size)
            if off is None:
                assert a.largest_free < a.round(size)
                continue
            for o, n in live.items():  # no overlap with anything live
                assert off + a.round(size) <= o or o + n <= off
            live[off] = a.round(size)
        else:
            off = sorted(live)[pick % len(live)]
            assert a.free(off) == live.pop(off)
        a.check_integrity()
        assert a.used_bytes == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.free_ranges() == [(0, 4096)]
