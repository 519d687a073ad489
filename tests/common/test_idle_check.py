"""IdleCheck: a pool's invariants while its process is idle (a worker's block pool: also
no block referenced; the store master's metadata), throttled, logged and counted; strict
mode raises."""
from __future__ import annotations

import asyncio
import logging

import pytest

from common.kv.block_pool import BlockPool
from services.store_master.metadata import StoreMetadata
from common.idle_check import IdleCheck


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_clean_pool_passes_and_checks_are_throttled() -> None:
    pool, clock = BlockPool(4), Clock()
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks[:1], [b"k" * 16])
    pool.free(blocks)  # one evictable, three plain: all free
    check = IdleCheck(pool.check_idle, "KV block pool", interval_s=10.0, strict=True,
                      clock=clock)
    assert check.run()
    clock.now += 9.9
    assert not check.run()  # too soon
    clock.now += 0.1
    assert check.run()
    assert (check.checks, check.violations) == (2, 0)


def test_a_referenced_block_is_a_leak_logged_and_counted(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    pool, clock = BlockPool(4), Clock()
    pool.allocate(1)
    check = IdleCheck(pool.check_idle, "KV block pool", interval_s=1.0, clock=clock)
    with caplog.at_level(logging.ERROR, logger="common.idle_check"):
        assert check.run()
    assert check.violations == 1
    assert caplog.messages == ["KV block pool integrity violated (violation 1): "
                               "1 of 4 blocks still referenced with nothing queued or running"]
    clock.now += 1.0
    check.run()
    assert check.violations == 2


def test_strict_raises_on_a_broken_invariant() -> None:
    pool = BlockPool(4)
    pool._ref[2] = 1  # referenced, yet still on the free list: a double free's trace
    check = IdleCheck(pool.check_idle, "KV block pool", interval_s=0, strict=True)
    with pytest.raises(AssertionError, match="referenced block on a free list"):
        check.run()
    assert check.violations == 1


def test_watch_checks_only_while_the_worker_says_it_is_idle() -> None:
    pool = BlockPool(4)
    held = pool.allocate(1)
    check = IdleCheck(pool.check_idle, "KV block pool", interval_s=0.01, strict=True)
    busy = [True]

    async def go() -> None:
        watch = asyncio.create_task(check.watch(lambda: not busy[0]))
        await asyncio.sleep(0.05)
        assert check.checks == 0  # busy: the held block is legitimately in use
        pool.free(held)
        busy[0] = False
        while check.checks < 2:
            await asyncio.sleep(0.01)
        watch.cancel()

    asyncio.run(asyncio.wait_for(go(), 5))
    assert check.violations == 0


def test_a_negative_interval_is_rejected() -> None:
    with pytest.raises(ValueError, match="interval_s must be >= 0"):
        IdleCheck(BlockPool(1).check_idle, "KV block pool", interval_s=-1)


def test_store_metadata_is_checked_the_same_way(caplog: pytest.LogCaptureFixture) -> None:
    md = StoreMetadata()
    md.add_node("n0", 1 << 20, 0, {}, now=0.0)
    slot, = md.put_start(["k"], 4096, 1, now=0.0)
    md.put_end(["k"], [True], now=0.0)
    check = IdleCheck(md.check_integrity, "store metadata", interval_s=0)
    assert check.run() and check.violations == 0
    md.nodes["n0"].allocator.free(slot.locations[0][1])  # freed under a live replica
    with caplog.at_level(logging.ERROR, logger="common.idle_check"):
        assert check.run()
    assert check.violations == 1
    assert caplog.messages[0].startswith("store metadata integrity violated (violation 1): ")
