"""Where a prefill's prompt blocks come from: the worker's own cache, then the global
KV pool (store), then fresh blocks to compute into. And where they go afterwards:
the local cache (so hot prefixes replicate themselves) and the store.

A store miss or failure is never an error: those blocks are computed instead. The
decisions (what to reuse, load, compute, put back) are pure, in ``prefix_plan.py``; this
module executes them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional

from common.kv.block_pool import BlockPool
from common.kv.memory import PagedKVMemory
from common.transfer import watched
from common.worker import WorkerRuntime
from services.prefill.prefix_plan import (
    Reuse, ask_store, leading, plan_reuse, put_back, store_fetch,
)

if TYPE_CHECKING:
    from common.protocol import PrefetchLoads
    from common.store.client import StoreClient
    from common.store.plans import GetPlan

log = logging.getLogger("prefill.prefix")

STORE_TIMEOUT_S = 5.0
# A plan asked for ahead (``prefetch``, the conductor's hint with the reservation) serves its
# task's admission while at least this much of its lease is left; at most PREFETCHED wait
PLAN_LEFT_S, PREFETCHED = 1.0, 64


@dataclass
class PrefixPlan:
    block_table: list[int]  # every block of the prompt, referenced by this request
    cached_blocks: int  # leading blocks whose KV is already present
    global_blocks: int  # of those, loaded from the store now
    stored_from: int  # first block index not known to be in the store
    # Layer-wise: the blocks [load_from, cached_blocks) are read from the store layer by
    # layer under ``load`` while the prompt computes (services/prefill/layer_io.py).
    load: Optional["GetPlan"] = None
    load_from: int = 0
    # whole blocks read from the store before compute: bytes, seconds (PrefillDone)
    read_bytes: int = 0
    read_s: float = field(default=0.0, compare=False)  # measured: no two plans alike


class PrefixLoader:
    """Executes the reuse plan (``services/prefill/prefix_plan.py``) against the worker's
    block pool and the store client: references, copies, caches and puts blocks."""

    def __init__(self, pool: BlockPool, kv: PagedKVMemory, store: Optional[StoreClient],
                 layerwise: bool = False, object_nbytes: Optional[int] = None) -> None:
        self.pool = pool
        # new blocks go to the store, and stored ones load, during the compute
        self.layerwise = layerwise
        self.object_nbytes = object_nbytes or kv.block_nbytes  # a store object: every layer
        self.kv = kv
        self.bs = kv.block_size
        self.store = store
        self._puts: set[asyncio.Task] = set()
        # request id -> (its keys, the plan asked for ahead), oldest first
        self._prefetched: OrderedDict[str, tuple[list[bytes], asyncio.Task]] = OrderedDict()

    @classmethod
    async def create(cls, rt: WorkerRuntime) -> "PrefixLoader":
        store = None
        if rt.config.store.enabled:
            from common.store.client import StoreClient

            store = StoreClient(rt.config.inbox("store_master"), rt.transfer,
                                timeout_s=STORE_TIMEOUT_S, shm_dir=rt.config.store.shm_dir,
                                device_memory=rt.engine.kv.device_bytes)
            await store.start()
            store.register_local(rt.engine.kv.base_address, rt.engine.kv.nbytes)
        kv = rt.engine.kv
        # Layer-wise, a stored prefix loads during the compute: on a GPU from a same-host
        # store every layer's read is queued at once and the compute waits for each on
        # the GPU (layer_io.LaunchedLoads); whole blocks before the compute were one DMA
        # of 48 GB/s the compute waited for (an H200, issue 26: 38 ms of a 16k prompt).
        # Layer-wise store I/O is the prefill worker's (store_writes.py, layer_io.py): a
        # colocated worker reads and puts whole blocks (layer-wise, it put none).
        return cls(rt.engine.pool, kv, store, rt.config.kv_layerwise and rt.role == "prefill",
                   kv.layer_nbytes * rt.engine.model_config.num_layers)

    def prefetch(self, hint: "PrefetchLoads") -> None:
        """Ask the store now where the hinted prompt's blocks are, for the layer-wise load
        of its task to come (its admission takes the answer: ``_planned``)."""
        if not self.layerwise or self.store is None or hint.request_id in self._prefetched:
            return
        try:
            keys = [bytes.fromhex(k) for k in hint.block_keys]
        except ValueError:  # the task's own keys fail it, with a reason
            return
        while len(self._prefetched) >= PREFETCHED:  # hints whose task never came
            self._prefetched.popitem(last=False)[1][1].cancel()
        self._prefetched[hint.request_id] = (keys, asyncio.ensure_future(self._plan(keys)))

    async def acquire(self, tokens: list[int], keys: list[bytes], from_store: bool = True,
                      reuse_prefix: bool = True, request_id: Optional[str] = None,
                      ) -> Optional[PrefixPlan]:
        """Reference every block the prompt needs; None if the pool cannot hold it.
        ``from_store`` False: read nothing from the store (still asked which blocks it
        holds, so that they are not put again). ``reuse_prefix`` False: compute the whole
        prompt into fresh blocks, cached prefix or not (its prompt logprobs need every
        row; after it, a block whose key is cached already stays private)."""
        cached, reuse, load, read = await self._find(
            tokens, keys, from_store=from_store and reuse_prefix, request_id=request_id)
        if not reuse_prefix:
            self.pool.free(cached)
            cached, reuse = [], replace(reuse, local=0, loaded=0, kept=0)
        rest = self.pool.try_allocate(reuse.fresh)
        if rest is None:
            self.pool.free(cached)
            return None
        if load is not None and reuse.global_blocks:
            n = reuse.global_blocks
            load = replace(load, keys=load.keys[:n], replicas=load.replicas[:n])
        else:
            load = None
        return PrefixPlan(cached + rest, reuse.kept, reuse.global_blocks, reuse.stored_from,
                          load, reuse.local if load is not None else 0, *read)

    async def lookup(self, tokens: list[int], keys: list[bytes]) -> tuple[list[int], int, int]:
        """The prompt's longest cached prefix, referenced: the local cache first, then the
        store. Returns (blocks, how many came from the store now, first block index not
        known to be in the store). At least one token is always left to compute."""
        cached, reuse, _, _ = await self._find(tokens, keys, whole=True)
        return cached, reuse.global_blocks, reuse.stored_from

    async def _find(self, tokens: list[int], keys: list[bytes], whole: bool = False,
                    from_store: bool = True, request_id: Optional[str] = None,
                    ) -> tuple[list[int], Reuse, Optional["GetPlan"], tuple[int, float]]:
        """(blocks kept, the reuse plan, a layer-wise load's lease, (bytes, seconds) of
        whole blocks read from the store now)."""
        ahead = self._prefetched.pop(request_id, None) if request_id is not None else None
        local = self.pool.match_prefix(keys)
        loaded: list[int] = []
        found: Optional[int] = None
        load = None
        read = (0, 0.0)
        if ask_store(len(local), len(keys), self.store is not None):
            if self.layerwise and not whole and from_store:  # one round trip: where each
                plan = await self._planned(keys, ahead)  # key is, leased (a miss: none)
                exists = plan.present() if plan is not None else None
            else:
                plan, exists = None, await self._exists(keys)
            if exists is not None:
                found = leading(exists)
                fetch = store_fetch(len(local), exists) if from_store else range(0)
                if plan is not None:
                    loaded, load = self._claim(plan, fetch)
                else:
                    started = time.perf_counter()
                    loaded = await self._fetch(keys, fetch)
                    if loaded:
                        read = (len(loaded) * self.kv.block_nbytes,
                                time.perf_counter() - started)
        if ahead is not None:  # not wanted after all (a local hit, no store loads)
            ahead[1].cancel()
        reuse = plan_reuse(len(tokens), self.bs, len(local), len(loaded), found)
        cached = local + loaded
        self.pool.free(cached[reuse.kept:])  # tail first, like any sequence's blocks
        return cached[:reuse.kept], reuse, load, read

    async def _plan(self, keys: list[bytes]) -> Optional["GetPlan"]:
        """Where the store holds each of ``keys``, leased (layer_io reads them during the
        compute); None when it fails: those blocks are computed instead."""
        try:
            return await self.store.plan_get(keys, self.object_nbytes)
        except Exception as exc:
            log.warning("store lookup failed (%s); computing instead", exc)
            return None

    async def _planned(self, keys: list[bytes],
                       ahead: Optional[tuple[list[bytes], asyncio.Task]]) -> Optional["GetPlan"]:
        """The plan asked for ahead for these keys, if its lease has ``PLAN_LEFT_S`` left;
        else the store's answer now."""
        if ahead is not None and ahead[0] == keys:
            plan = await ahead[1]
            if plan is not None and plan.deadline - time.time() > PLAN_LEFT_S:
                return plan
        elif ahead is not None:
            ahead[1].cancel()
        return await self._plan(keys)

    def _claim(self, plan: "GetPlan", fetch: range) -> tuple[list[int], Optional["GetPlan"]]:
        """Fresh blocks for ``fetch`` (leading blocks the store holds) and the part of
        ``plan`` that reads them: the reads run layer by layer during the compute
        (layer_io.start_loads); the blocks join the local cache only once the prompt is
        done."""
        blocks = self.pool.try_allocate(len(fetch)) if fetch else None
        if not blocks:
            return [], None
        return blocks, replace(plan, keys=plan.keys[fetch.start:fetch.stop],
                               replicas=plan.replicas[fetch.start:fetch.stop])

    async def _exists(self, keys: list[bytes]) -> Optional[list[bool]]:
        """The store's answer for every key; None when it fails (the store is optional for
        correctness: those blocks are computed instead)."""
        try:
            return await self.store.batch_exists(keys)
        except Exception as exc:
            log.warning("store lookup failed (%s); computing instead", exc)
            return None

    async def _fetch(self, keys: list[bytes], fetch: range) -> list[int]:
        """Copy blocks ``fetch`` from the store into fresh local blocks; returns the
        leading ones copied intact, which join the local cache (a hot prefix replicates
        itself here)."""
        if not fetch:
            return []
        blocks = self.pool.try_allocate(len(fetch))
        if blocks is None:
            return []
        try:
            ok = await self.store.batch_get_into(
                keys[fetch.start:fetch.stop], [self.kv.block_address(b) for b in blocks],
                self.kv.block_nbytes)
        except Exception as exc:
            log.warning("store get failed (%s); computing instead", exc)
            ok = [False] * len(blocks)
        good = leading(ok)
        self._free_settled(blocks[good:])
        self.pool.cache_full_blocks(blocks[:good], keys[fetch.start:fetch.start + good])
        return blocks[:good]

    def _free_settled(self, blocks: list[int]) -> None:
        """Free blocks a failed store read targeted, but not under a read that timed out
        and still runs (it would land in a block given to another request): while any
        transfer call is in flight, they stay out of the pool until those calls return."""
        transfer = getattr(self.store, "transfer", None)
        pending = transfer.in_flight() if transfer is not None and blocks else []
        if not pending:
            self.pool.free(blocks)
            return
        task = asyncio.create_task(self._free_after(blocks, pending))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def _free_after(self, blocks: list[int], pending: list) -> None:
        try:
            await asyncio.wait([watched(f) for f in pending])
        finally:
            self.pool.free(blocks)

    @property
    def busy(self) -> bool:
        """Puts in flight, or reads that may still land, hold blocks."""
        return bool(self._puts)

    def release(self, plan: PrefixPlan, keys: list[bytes]) -> None:
        """After the handover: cache full blocks locally, put new ones in the store, and
        drop this request's references (after the put has read them)."""
        full = len(keys)
        self.pool.cache_full_blocks(plan.block_table[:full], keys)
        # layer-wise, the new blocks were put while they were computed (store_writes.py)
        new = put_back(plan.stored_from, full, self.store is not None and not self.layerwise)
        if not new:
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
        for task in [*self._puts, *(t for _, t in self._prefetched.values())]:
            task.cancel()
        if self.store is not None:
            await self.store.close()
