"""The store client used by workers: batch exists / get_into / put_from, zero copy.

Bytes move straight between the worker's registered KV memory and node segments through
a ``RangeMover`` (common/store/ranges.py): one ``memmove`` per block when the node's segment
file is mappable here (same host), else the transfer engine (TCP/RDMA). Control goes to the
master over one DEALER. A miss is never an error: every call has a deadline and answers
"not there" (False / 0) on any failure.

The whole-object verbs are built on the range verbs, which other processes can share:
``start_put`` → ``RangeMover.write`` (any process, any byte range) → ``end_put``, and
``plan_get`` → ``RangeMover.read``.

Safety: a get copies only under the lease the master granted (counted from before the
request was sent); a copy that finishes after the lease is reported as a miss, because the
space may have been reused. A put writes only within ``put_timeout_s/2`` of asking and
commits nothing otherwise (the master reclaims it as a zombie).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import zmq
import zmq.asyncio

from common.ipc import encode, make_socket, try_decode
from common.mailbox import OUTBOX_HWM
from common.store import protocol as p
from common.store.plans import GetPlan, Location, PutPlan, Replicas, node_refs
from common.store.ranges import RangeMover
from common.transfer import BYTES_PER_S_FLOOR, TransferAgent

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class ClientStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0  # objects newly stored
    put_skipped: int = 0  # already present or in flight elsewhere
    put_failed: int = 0  # no space, transfer failure, deadline
    errors: int = 0  # master timeouts (transfer failures: ``StoreClient.mover.errors``)


class StoreClient:
    def __init__(self, master_address: str, transfer: Optional[TransferAgent],
                 timeout_s: float = 5.0, *, use_shm: bool = True,
                 copy_threads: int = 2, shm_dir: Optional[str] = "/dev/shm",
                 device_memory: Optional["torch.Tensor"] = None) -> None:
        self.master_address = master_address
        self.transfer = transfer
        self.timeout_s = timeout_s
        self.stats = ClientStats()
        self._copy_threads = copy_threads
        self._pool: Optional[ThreadPoolExecutor] = None
        self._sock: Optional[zmq.asyncio.Socket] = None
        self._reader: Optional[asyncio.Task[None]] = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        # same-host node segments in [store] shm_dir, remapped on a new epoch
        self.mover = RangeMover(transfer, shm_dir, use_shm=use_shm, threads=copy_threads,
                                device_memory=device_memory)
        self._registered: list[tuple[int, int]] = []

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        # the process's shared context, as every mailbox's: a context of its own that is
        # never closed (a client left in a reference cycle) blocks the garbage collector in
        # its finalizer, whose term() waits for the sockets the same cycle holds
        self._sock = make_socket(zmq.asyncio.Context.instance(), zmq.DEALER,
                                 self.master_address, bind=False, hwm=OUTBOX_HWM)
        self._pool = ThreadPoolExecutor(self._copy_threads, thread_name_prefix="store-call")
        self._reader = asyncio.create_task(self._read_replies())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for fut in self._pending.values():
            fut.cancel()
        if self._sock is not None:
            self._sock.close(0)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self.mover.close()

    def register_local(self, address: int, nbytes: int) -> None:
        """The worker's KV memory: registered once with the transfer engine."""
        if (address, nbytes) in self._registered:
            return
        if self.transfer is not None:
            self.transfer.register(address, nbytes)
        self._registered.append((address, nbytes))

    # ---------------------------------------------------------------- verbs
    async def batch_exists(self, keys: list[bytes]) -> list[bool]:
        reply = await self._call(lambda r: p.StoreExists(r, [k.hex() for k in keys]))
        return list(reply.present) if reply is not None else [False] * len(keys)

    async def longest_prefix(self, keys: list[bytes]) -> int:
        """Number of leading keys present (committed) anywhere in the pool."""
        n = 0
        for present in await self.batch_exists(keys):
            if not present:
                break
            n += 1
        return n

    async def batch_get_into(self, keys: list[bytes], addresses: list[int],
                             size: int) -> list[bool]:
        """Copy each present object to its address. True where copied byte-exact."""
        plan = await self.plan_get(keys, size)
        ok = [False] * len(keys)
        if plan is not None:
            items = [(i, addresses[i], 0, size) for i, there in enumerate(plan.present())
                     if there]
            got = await self._off_loop(self.mover.try_read, plan, items)
            for (i, *_), hit in zip(items, got):
                ok[i] = hit
        hits = sum(ok)
        self.stats.hits += hits
        self.stats.misses += len(keys) - hits
        self.stats.bytes_read += hits * size
        return ok

    async def batch_put_from(self, keys: list[bytes], addresses: list[int], size: int,
                             replica_num: int = 1) -> int:
        """Store each object not yet present. Returns how many were newly stored."""
        plan = await self.start_put(keys, size, replica_num)
        if plan is None or not plan.keys:
            return 0
        items = [(j, addresses[i], 0, size) for j, i in enumerate(plan.index)]
        return await self.end_put(plan, await self._off_loop(self.mover.try_write, plan, items))

    async def plan_get(self, keys: list[bytes], size: int) -> Optional[GetPlan]:
        """Where each of ``keys`` (objects of ``size`` bytes) is, leased: read them with
        ``RangeMover.read`` by ``plan.deadline``. None: the master did not answer."""
        t0 = time.time()  # the lease counts from before the request
        reply = await self._call(lambda r: p.StoreGet(r, [k.hex() for k in keys]))
        if reply is None:
            return None
        self.mover.retain(reply.live)
        return GetPlan(size, [k.hex() for k in keys], _replicas(reply.locations),
                       node_refs(reply.nodes),
                       t0 + min(reply.lease_s, self._for_bytes(size * len(keys))), reply.live)

    async def start_put(self, keys: list[bytes], size: int,
                        replica_num: int = 1) -> Optional[PutPlan]:
        """Reserve room for each of ``keys`` not yet stored: write them with
        ``RangeMover.write`` by ``plan.deadline``, then ``end_put``. None: the master did
        not answer; a plan without keys: nothing to write (present, or no space)."""
        t0 = time.time()
        hexkeys = [k.hex() for k in keys]
        reply = await self._call(lambda r: p.StorePutStart(r, hexkeys, size, replica_num))
        if reply is None:
            self.stats.put_failed += len(keys)
            return None
        self.mover.retain(reply.live)
        self.stats.put_skipped += sum(1 for s in reply.status if s == "exists")
        self.stats.put_failed += sum(1 for s in reply.status if s == "nospace")
        new = [i for i, s in enumerate(reply.status) if s == "new"]
        return PutPlan(size, [hexkeys[i] for i in new], new,
                       _replicas([reply.locations[i] for i in new]), node_refs(reply.nodes),
                       t0 + min(reply.put_timeout_s / 2, self._for_bytes(size * len(keys))),
                       reply.live)

    def _for_bytes(self, nbytes: int) -> float:
        """The longest this client lets a plan of ``nbytes`` run: ``timeout_s`` plus the
        bytes at the transfer engine's slowest healthy rate (the master's grant, which
        counts them the same way, is the other bound)."""
        return self.timeout_s + nbytes / BYTES_PER_S_FLOOR

    async def end_put(self, plan: PutPlan, written: list[bool]) -> int:
        """Commit the plan's keys whose every byte was written (``written[i]``), abandon
        the others. Returns how many were committed (0 if the master does not answer)."""
        if len(written) != len(plan.keys):
            raise ValueError(f"{len(written)} results for {len(plan.keys)} keys")
        if not plan.keys:
            return 0
        end = await self._call(lambda r: p.StorePutEnd(r, list(plan.keys), list(written)))
        stored = sum(end.committed) if end is not None else 0
        self.stats.puts += stored
        self.stats.put_failed += len(plan.keys) - stored
        self.stats.bytes_written += stored * plan.size
        return stored

    async def remove(self, keys: list[bytes]) -> int:
        reply = await self._call(lambda r: p.StoreRemove(r, [k.hex() for k in keys]))
        return reply.removed if reply is not None else 0

    async def poll_events(self, after_seq: int = 0) -> tuple[list[Any], int]:
        """KV events after ``after_seq``: ([[seq, kind, key_hex], ...], last_seq)."""
        reply = await self._call(lambda r: p.StorePollEvents(r, after_seq))
        return (list(reply.events), reply.last_seq) if reply is not None else ([], after_seq)

    async def keys(self) -> Optional[p.StoreKeysReply]:
        """Every committed key and the master's incarnation and last event (None: no
        answer within ``timeout_s``)."""
        return await self._call(lambda r: p.StoreKeys(r))

    def mapped_segments(self) -> dict[str, str]:
        """node_id → segment file of every node segment mapped in this process."""
        return self.mover.mapped()

    async def master_stats(self) -> Optional[dict[str, Any]]:
        reply = await self._call(lambda r: p.StoreStats(r))
        return reply.stats if reply is not None else None

    async def _off_loop(self, fn: Callable[..., list[bool]], *args: Any) -> list[bool]:
        """A mover call on this client's threads (the copies never block the loop)."""
        assert self._pool is not None, "StoreClient.start() first"
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------ control
    async def _call(self, make: Callable[[int], Any]) -> Optional[Any]:
        """One request/reply with the master under ``timeout_s``; None on timeout."""
        assert self._sock is not None, "StoreClient.start() first"
        req_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        try:
            # NOBLOCK: with the master away, requests beyond the high-water mark fail at once
            await self._sock.send(encode(make(req_id)), flags=zmq.NOBLOCK)
            return await asyncio.wait_for(fut, self.timeout_s)
        except (asyncio.TimeoutError, zmq.ZMQError) as exc:
            self.stats.errors += 1
            log.warning("store master did not answer in %.1fs (%s)", self.timeout_s,
                        type(exc).__name__)
            return None
        finally:
            self._pending.pop(req_id, None)

    async def _read_replies(self) -> None:
        assert self._sock is not None
        while True:
            frame = await self._sock.recv()
            msg = try_decode(frame, "store_client")
            fut = self._pending.get(getattr(msg, "req_id", -1))
            if fut is not None and not fut.done():
                fut.set_result(msg)


def _replicas(locations: list[Any]) -> list[Replicas]:
    """The master's per-key ``[[node_id, offset], ...]`` (or None: a miss), typed."""
    return [Replicas([Location(str(n), int(off)) for n, off in locs or []])
            for locs in locations]
