"""PrefixLoader executes the reuse plan against a real block pool and a recording store:
exact block ids, references, cached keys and store calls (block size 4)."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, Optional

from common.kv.block_pool import BlockPool
from common.kv.memory import PagedKVMemory
from common.store.plans import GetPlan, Location, Replicas
from services.prefill.prefix import PrefixLoader, PrefixPlan

BS = 4
BLOCK_BYTES = 2 * BS * 2 * 4  # one layer, K and V, one head of 2 float32 per token


class Store:
    """The StoreClient verbs the loader uses, over a set of keys. ``bad``: keys whose copy
    fails; ``down``: every call raises."""

    def __init__(self, have: set[bytes], bad: Optional[set[bytes]] = None) -> None:
        self.have, self.bad, self.down = have, bad or set(), False
        self.transfer: Any = None  # the client's transfer agent (in_flight), if any
        self.base = 0  # the KV memory's base address, to name blocks by id
        self.calls: list[tuple[str, int]] = []  # (verb, number of keys)
        self.puts: list[tuple[list[bytes], list[int]]] = []  # keys, block ids

    async def batch_exists(self, keys: list[bytes]) -> list[bool]:
        self.calls.append(("exists", len(keys)))
        if self.down:
            raise ConnectionError("store master unreachable")
        return [k in self.have for k in keys]

    async def plan_get(self, keys: list[bytes], size: int) -> Optional[GetPlan]:
        self.calls.append(("plan", len(keys)))
        if self.down:
            raise ConnectionError("store master unreachable")
        return GetPlan(size, [k.hex() for k in keys],
                       [Replicas([Location("n", i * size)] if k in self.have else [])
                        for i, k in enumerate(keys)], [], time.time() + 60)

    async def batch_get_into(self, keys: list[bytes], addresses: list[int], size: int
                             ) -> list[bool]:
        self.calls.append(("get", len(keys)))
        return [k in self.have and k not in self.bad for k in keys]

    async def batch_put_from(self, keys: list[bytes], addresses: list[int], size: int) -> int:
        self.calls.append(("put", len(keys)))
        self.puts.append((keys, [(a - self.base) // size for a in addresses]))
        self.have.update(keys)
        return len(keys)


def keys(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 16 for i in range(n)]


def loader(store: Optional[Store], num_blocks: int = 12, layerwise: bool = False
           ) -> PrefixLoader:
    kv = PagedKVMemory(num_blocks, num_layers=1, block_size=BS, num_kv_heads=1, head_dim=2)
    if store is not None:
        store.base = kv.base_address
    return PrefixLoader(BlockPool(num_blocks), kv, store, layerwise)  # type: ignore[arg-type]


def warm(pl: PrefixLoader, ks: list[bytes]) -> None:
    """Cache blocks under ``ks`` locally (blocks 0, 1, ...), unreferenced."""
    blocks = pl.pool.allocate(len(ks))
    pl.pool.cache_full_blocks(blocks, ks)
    pl.pool.free(blocks)


def test_local_hits_then_the_store_then_fresh_blocks() -> None:
    ks = keys(4)
    store = Store(set(ks[:3]))
    pl = loader(store)
    warm(pl, ks[:1])  # block 0
    plan = asyncio.run(pl.acquire(list(range(17)), ks))
    # Block 0 from the local cache; 1, 2 copied from the store; 3, 4 fresh.
    assert plan == PrefixPlan([0, 1, 2, 3, 4], cached_blocks=3, global_blocks=2, stored_from=3,
                              read_bytes=2 * BLOCK_BYTES)
    assert plan.read_s > 0  # measured around the copy: the conductor learns bandwidth from it
    assert store.calls == [("exists", 4), ("get", 2)]
    assert [pl.pool.block_key(b) for b in range(5)] == ks[:3] + [None, None]
    assert [pl.pool.ref_count(b) for b in range(5)] == [1] * 5


def test_a_failed_copy_keeps_the_intact_head_and_frees_the_rest() -> None:
    ks = keys(4)
    store = Store(set(ks), bad={ks[1]})
    pl = loader(store)
    plan = asyncio.run(pl.acquire(list(range(17)), ks))
    # Fetched into blocks 0..3; the copy of 1 failed, so 1..3 go back to the end of the
    # free list and the prompt's other four blocks are fresh ones.
    assert plan == PrefixPlan([0, 4, 5, 6, 7], cached_blocks=1, global_blocks=1, stored_from=4,
                              read_bytes=BLOCK_BYTES)  # the intact head only
    assert pl.pool.free_order()[-3:] == [3, 2, 1]  # freed tail first
    assert [pl.pool.block_key(b) for b in plan.block_table] == [ks[0], None, None, None, None]


def test_a_block_aligned_prompt_leaves_its_last_block_to_compute() -> None:
    ks = keys(3)
    store = Store(set(ks))
    pl = loader(store)
    cached, from_store, stored_from = asyncio.run(pl.lookup(list(range(12)), ks))
    assert (cached, from_store, stored_from) == ([0, 1], 2, 3)
    # The last block was copied too: it stays in the local cache, unreferenced.
    assert pl.pool.block_key(2) == ks[2] and pl.pool.ref_count(2) == 0


def test_layer_wise_one_round_trip_plans_the_load() -> None:
    """Layer-wise, the store is asked once (``plan_get`` of every key: where each is, and
    so which exist); the blocks after the local hits up to the first miss get fresh blocks
    and the part of the lease that reads them during the compute; a rerun without store
    loads and a store that is down go by ``exists`` and compute."""
    ks = keys(5)
    store = Store({ks[0], ks[1], ks[2], ks[4]})  # a hole at 3: block 4 is not loaded
    pl = loader(store, layerwise=True)
    warm(pl, ks[:1])  # block 0
    plan = asyncio.run(pl.acquire(list(range(21)), ks))
    assert store.calls == [("plan", 5)]
    assert plan.cached_blocks == 3 and plan.global_blocks == 2 and plan.stored_from == 3
    assert plan.load_from == 1 and plan.load.keys == [k.hex() for k in ks[1:3]]
    assert [r.locations[0].offset for r in plan.load.replicas] == [BLOCK_BYTES, 2 * BLOCK_BYTES]
    assert plan.block_table[:3] == [0, 1, 2] and plan.read_bytes == 0  # read during compute
    assert [pl.pool.block_key(b) for b in plan.block_table[1:3]] == [None, None]  # not yet
    store.calls.clear()
    again = loader(store, layerwise=True)
    assert asyncio.run(again.acquire(list(range(21)), ks, from_store=False)).load is None
    assert store.calls == [("exists", 5)]
    store.down, store.calls = True, []
    down = loader(store, layerwise=True)
    assert asyncio.run(down.acquire(list(range(9)), ks[:2])) == PrefixPlan([0, 1, 2], 0, 0, 0)
    assert store.calls == [("plan", 2)]  # asked once, not again by exists


def test_the_store_down_or_off_means_computing() -> None:
    ks = keys(2)
    store = Store(set(ks))
    store.down = True
    pl = loader(store)
    assert asyncio.run(pl.acquire(list(range(9)), ks)) == PrefixPlan([0, 1, 2], 0, 0, 0)
    assert store.calls == [("exists", 2)]
    off = loader(None)
    warm(off, ks)
    assert asyncio.run(off.acquire(list(range(9)), ks)) == PrefixPlan([0, 1, 2], 2, 0, 2)


def test_a_rerun_after_a_failed_load_reads_nothing_from_the_store() -> None:
    """``from_store=False`` (PrefillTask.store_loads): local hits only, the store's blocks
    computed again, but still known to be there, so not put again."""
    ks = keys(4)
    store = Store(set(ks[:3]))
    pl = loader(store)
    warm(pl, ks[:1])  # block 0
    plan = asyncio.run(pl.acquire(list(range(17)), ks, from_store=False))
    assert plan == PrefixPlan([0, 1, 2, 3, 4], cached_blocks=1, global_blocks=0, stored_from=3)
    assert store.calls == [("exists", 4)]


def test_a_full_pool_frees_the_hits_and_returns_none() -> None:
    ks = keys(2)
    pl = loader(None, num_blocks=3)
    warm(pl, ks[:1])
    held = pl.pool.allocate(1)
    assert asyncio.run(pl.acquire(list(range(12)), ks)) is None  # needs 3, 2 left
    assert pl.pool.ref_count(0) == 0 and pl.pool.num_used == 1
    pl.pool.free(held)
    pl.pool.check_integrity()


def test_release_caches_puts_blocks_not_in_the_store_then_frees() -> None:
    ks = keys(3)
    store = Store(set(ks[:1]))
    pl = loader(store)

    async def go() -> None:
        plan = await pl.acquire(list(range(14)), ks)
        assert plan == PrefixPlan([0, 1, 2, 3], 1, 1, stored_from=1, read_bytes=BLOCK_BYTES)
        pl.release(plan, ks)
        assert pl.busy and pl.pool.num_used == 4  # the put still reads the blocks
        while pl.busy:
            await asyncio.sleep(0)

    asyncio.run(go())
    assert store.puts == [(ks[1:], [1, 2])]
    assert pl.pool.num_used == 0 and pl.pool.num_cached == 3
    pl.pool.check_integrity()


def test_blocks_of_a_read_that_outlived_its_deadline_stay_out_of_the_pool() -> None:
    """The store's copy of block 1 timed out, but the native read still runs (the
    transfer agent reports it in flight): the blocks it may land in are kept until it
    returns, and the prompt computes into others."""
    ks = keys(3)
    store = Store(set(ks), bad={ks[1]})
    native: Future = Future()
    store.transfer = SimpleNamespace(in_flight=lambda: [f for f in [native] if not f.done()])
    pl = loader(store, num_blocks=8)

    async def go() -> None:
        plan = await pl.acquire(list(range(13)), ks)
        assert plan == PrefixPlan([0, 3, 4, 5], cached_blocks=1, global_blocks=1,
                                  stored_from=3, read_bytes=BLOCK_BYTES)
        assert pl.busy and pl.pool.num_used == 6  # 1 and 2 held for the read
        assert pl.pool.try_allocate(3) is None  # not even to a request asking for them
        native.set_result(0)
        while pl.busy:
            await asyncio.sleep(0)
        assert pl.pool.num_used == 4 and pl.pool.free_order()[-2:] == [2, 1]
        pl.pool.free(plan.block_table)

    asyncio.run(go())
    pl.pool.check_integrity()


def test_a_plan_asked_ahead_serves_its_tasks_admission() -> None:
    """The conductor's hint (``PrefetchLoads``, with the reservation) asks the store at
    once; the task's admission takes that plan instead of asking again, unless it is for
    other keys or has too little of its lease left; a hint whose task loads nothing from
    the store is dropped; hints are bounded; without layer-wise loads there are none."""
    from common.protocol import PrefetchLoads
    from services.prefill.prefix import PLAN_LEFT_S, PREFETCHED

    ks = keys(5)
    store = Store(set(ks[:4]))

    async def run(pl: PrefixLoader, hint_keys: list[bytes], rid: str = "r",
                  lease: Optional[float] = None) -> PrefixPlan:
        pl.prefetch(PrefetchLoads("r", [k.hex() for k in hint_keys]))
        if lease is not None:  # the hinted plan, had its lease run short meanwhile
            keys_, task = pl._prefetched["r"]
            plan = await task
            short = GetPlan(plan.size, plan.keys, plan.replicas, [], time.time() + lease)
            pl._prefetched["r"] = (keys_, asyncio.ensure_future(asyncio.sleep(0, short)))
        return await pl.acquire(list(range(21)), ks, request_id=rid)

    pl = loader(store, layerwise=True)
    plan = asyncio.run(run(pl, ks))
    assert store.calls == [("plan", 5)] and plan.global_blocks == 4 and not pl._prefetched
    # other keys (cancelled before it asked), another request's, a lease running out
    for hint_keys, rid, lease, calls in ((ks[:4], "r", None, 1), (ks, "other", None, 2),
                                         (ks, "r", PLAN_LEFT_S / 2, 2)):
        store.calls = []
        asyncio.run(run(loader(store, layerwise=True), hint_keys, rid, lease))
        assert store.calls == [("plan", 5)] * calls, (hint_keys == ks, rid, lease)
    pl = loader(store, layerwise=True)
    warm(pl, ks[:4])  # every stored block is local: the store is not asked by the task

    async def local() -> None:
        pl.prefetch(PrefetchLoads("r", [k.hex() for k in ks]))
        task = pl._prefetched["r"][1]
        await pl.acquire(list(range(21)), ks, request_id="r")
        assert task.cancelled() or task.done()
    store.calls = []
    asyncio.run(local())
    assert not pl._prefetched

    async def many() -> int:
        pl = loader(store, layerwise=True)
        for i in range(PREFETCHED + 3):
            pl.prefetch(PrefetchLoads(f"r{i}", [ks[0].hex()]))
        pl.prefetch(PrefetchLoads("bad", ["not hex"]))
        await asyncio.sleep(0)
        n = len(pl._prefetched)
        tasks = [t for _, t in pl._prefetched.values()]
        pl.store = None  # closing cancels the plans asked ahead (this store has no close)
        await pl.close()
        await asyncio.sleep(0)
        assert all(t.cancelled() or t.done() for t in tasks)
        return n
    assert asyncio.run(many()) == PREFETCHED
    off = loader(store)  # whole blocks before the compute: no plans ahead
    off.prefetch(PrefetchLoads("r", [k.hex() for k in ks]))
    assert not off._prefetched
