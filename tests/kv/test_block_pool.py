"""Block pool: exact block ids, exact eviction order, KV events, integrity after every step."""
from __future__ import annotations

import pytest

from common.kv.block_pool import BlockPool, OutOfBlocksError
from common.kv.events import BlockRemoved, BlockStored

K = [bytes([i]) * 16 for i in range(8)]


def _check(pool: BlockPool, free_order: list[int], evictable: int) -> None:
    pool.check_integrity()
    assert pool.free_order() == free_order
    assert pool.num_evictable == evictable
    assert pool.num_free_uncached + pool.num_evictable + pool.num_used == pool.num_blocks


def test_allocate_free_reuse_sequence() -> None:
    pool = BlockPool(8)
    _check(pool, list(range(8)), 0)
    assert pool.allocate(3) == [0, 1, 2]
    _check(pool, [3, 4, 5, 6, 7], 0)
    pool.cache_full_blocks([0, 1], K[:2])
    assert pool.drain_events() == [BlockStored(1, K[0], 0), BlockStored(2, K[1], 1)]
    pool.free([0, 1, 2])  # tail first: 2 (uncached), then 1, then 0
    _check(pool, [3, 4, 5, 6, 7, 2, 1, 0], 2)
    assert pool.match_prefix([K[0], K[1], K[5]]) == [0, 1]
    assert (pool.ref_count(0), pool.ref_count(1)) == (1, 1)
    _check(pool, [3, 4, 5, 6, 7, 2], 0)
    pool.free([0, 1])
    _check(pool, [3, 4, 5, 6, 7, 2, 1, 0], 2)
    assert pool.allocate(6) == [3, 4, 5, 6, 7, 2]  # never-cached blocks go first
    _check(pool, [1, 0], 2)
    assert pool.allocate(1) == [1]  # least recently freed cached block is evicted
    assert pool.drain_events() == [BlockRemoved(3, K[1], 1)]
    _check(pool, [0], 1)
    assert pool.peek_prefix([K[0], K[1]]) == 1
    assert pool.match_prefix([K[0], K[1]]) == [0]
    _check(pool, [], 0)
    assert pool.try_allocate(1) is None
    with pytest.raises(OutOfBlocksError, match="cannot allocate 1 KV blocks: only 0 of 8 free"):
        pool.allocate(1)
    pool.free([3, 4, 5, 6, 7, 2, 1, 0])
    _check(pool, [1, 2, 7, 6, 5, 4, 3, 0], 1)
    assert pool.drain_events() == []


def test_shared_blocks_need_every_reference_freed() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache_full_blocks(a, K[:2])
    assert pool.match_prefix(K[:2]) == a
    assert pool.ref_count(0) == 2
    pool.free(a)
    _check(pool, [2, 3], 0)
    pool.free(a)
    _check(pool, [2, 3, 1, 0], 2)


def test_share_adds_a_reference_each_holder_frees() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.share(a[:1])
    pool.share(a[:1])
    assert [pool.ref_count(b) for b in a] == [3, 1]
    pool.free(a)
    _check(pool, [2, 3, 1], 0)
    pool.free(a[:1])
    pool.free(a[:1])
    _check(pool, [2, 3, 1, 0], 0)
    with pytest.raises(ValueError, match="not in use and cannot be shared"):
        pool.share([0])
    assert pool.ref_count(0) == 0


def test_duplicate_key_keeps_first_block() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache_full_blocks(a, [K[0]])
    pool.cache_full_blocks(b, [K[0]])
    assert pool.block_key(b[0]) is None
    assert pool.num_cached == 1
    pool.free(b)
    _check(pool, [2, 3, 1], 0)
    pool.free(a)
    _check(pool, [2, 3, 1, 0], 1)


def test_misuse_is_rejected() -> None:
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="freed more times than referenced"):
        pool.free([0])
    with pytest.raises(ValueError, match="not in use"):
        pool.cache_full_blocks([1], [K[1]])
    b = pool.allocate(1)
    pool.cache_full_blocks(b, [K[1]])
    with pytest.raises(ValueError, match="already cached under another key"):
        pool.cache_full_blocks(b, [K[2]])
    with pytest.raises(ValueError):
        BlockPool(0)
    pool.check_integrity()


def test_event_hook_sees_sequence_numbers() -> None:
    seen: list = []
    pool = BlockPool(2, on_event=seen.append)
    pool.cache_full_blocks(pool.allocate(2), K[:2])
    pool.free([0, 1])
    pool.allocate(1)
    assert [(type(e).__name__, e.seq, e.block_id) for e in seen] == [
        ("BlockStored", 1, 0), ("BlockStored", 2, 1), ("BlockRemoved", 3, 1)]
