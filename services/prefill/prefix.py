"""Where a prefill's prompt blocks come from: the worker's own cache, then the global
KV pool (store), then fresh blocks to compute into. And where they go afterwards:
the local cache (so hot prefixes replicate themselves) and the store.

A store miss or failure is never an error: those blocks are computed instead.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Optional

from common.worker import WorkerRuntime

log = logging.getLogger("prefill.prefix")

STORE_TIMEOUT_S = 5.0


@dataclass
class PrefixPlan:
    block_table: list[int]  # every block of the prompt, referenced by this request
    cached_blocks: int  # leading blocks whose KV is already present
    global_blocks: int  # of those, loaded from the store now
    stored_from: int  # first block index not known to be in the store


class PrefixLoader:
    def __init__(self, rt: WorkerRuntime, store: Optional[object]) -> None:
        self.rt = rt
        self.pool = rt.engine.pool
        self.kv = rt.engine.kv
        self.bs = rt.engine.config.block_size
        self.store = store
        self._puts: set[asyncio.Task] = set()

    @classmethod
    async def create(cls, rt: WorkerRuntime) -> "PrefixLoader":
        store = None
        if rt.config.use_store:
            from common.store.client import StoreClient

            store = StoreClient(rt.config.inbox("store_master"), rt.transfer,
                                timeout_s=STORE_TIMEOUT_S)
            await store.start()
            store.register_local(rt.engine.kv.base_address, rt.engine.kv.nbytes)
        return cls(rt, store)

    async def acquire(self, tokens: list[int], keys: list[bytes]) -> Optional[PrefixPlan]:
        """Reference every block the prompt needs; None if the pool cannot hold it."""
        need = -(-len(tokens) // self.bs)
        cached, from_store, in_store = await self.lookup(tokens, keys)
        rest = self.pool.try_allocate(need - len(cached))
        if rest is None:
            self.pool.free(cached)
            return None
        return PrefixPlan(cached + rest, len(cached), from_store, in_store)

    async def lookup(self, tokens: list[int], keys: list[bytes]) -> tuple[list[int], int, int]:
        """The prompt's longest cached prefix, referenced: the local cache first, then the
        store. Returns (blocks, how many came from the store now, first block index not
        known to be in the store). At least one token is always left to compute."""
        local = self.pool.match_prefix(keys)
        loaded: list[int] = []
        in_store = len(local)
        if self.store is not None and len(local) < len(keys):
            loaded, in_store = await self._load(keys, len(local))
        cached = local + loaded
        # At least one token must be computed to produce the first token's logits.
        while cached and len(cached) * self.bs >= len(tokens):
            self.pool.free([cached.pop()])
        from_store = max(0, len(cached) - len(local))
        return cached, from_store, max(in_store, len(cached))

    async def _load(self, keys: list[bytes], have: int) -> tuple[list[int], int]:
        """Fetch blocks [have, n) from the store; returns (blocks loaded, n in store)."""
        try:
            n = await self.store.longest_prefix(keys)
        except Exception as exc:  # the store is optional for correctness
            log.warning("store lookup failed (%s); computing instead", exc)
            return [], have
        if n <= have:
            return [], max(n, have)
        blocks = self.pool.try_allocate(n - have)
        if blocks is None:
            return [], n
        try:
            ok = await self.store.batch_get_into(
                keys[have:n], [self.kv.block_address(b) for b in blocks], self.kv.block_nbytes)
        except Exception as exc:
            log.warning("store get failed (%s); computing instead", exc)
            ok = [False] * len(blocks)
        good = 0
        while good < len(ok) and ok[good]:
            good += 1
        self.pool.free(blocks[good:])
        loaded = blocks[:good]
        # Loaded blocks join the local cache: a hot prefix replicates itself here.
        self.pool.cache_full_blocks(loaded, keys[have:have + good])
        return loaded, n

    def release(self, plan: PrefixPlan, keys: list[bytes]) -> None:
        """After the handover: cache full blocks locally, put new ones in the store, and
        drop this request's references (after the put has read them)."""
        full = len(keys)
        self.pool.cache_full_blocks(plan.block_table[:full], keys)
        new = range(plan.stored_from, full)
        if self.store is None or not new:
            self.pool.free(plan.block_table)
            return
        task = asyncio.create_task(self._put(plan, keys, new))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def _put(self, plan: PrefixPlan, keys: list[bytes], new: range) -> None:
        try:
            await self.store.batch_put_from(
                [keys[i] for i in new],
                [self.kv.block_address(plan.block_table[i]) for i in new],
                self.kv.block_nbytes)
        except Exception as exc:
            log.warning("store put of %d blocks failed: %s", len(new), exc)
        finally:
            self.pool.free(plan.block_table)

    async def close(self) -> None:
        for task in list(self._puts):
            task.cancel()
        if self.store is not None:
            await self.store.close()
