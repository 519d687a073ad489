"""The store client used by workers: batch exists / get_into / put_from, zero copy.

Bytes move straight between the worker's registered KV memory and node segments: one
``memmove`` per block when the node's segment file is mappable here (same host), else the
transfer engine (TCP/RDMA). Control goes to the master over one DEALER. A miss is never an
error: every call has a deadline and answers "not there" (False / 0) on any failure.

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
from typing import Any, Callable, Optional

import zmq
import zmq.asyncio

from common.ipc import encode, make_socket, try_decode
from common.mailbox import OUTBOX_HWM
from common.store import protocol as p
from common.store.peers import SegmentMaps
from common.store.shm import copy_many
from common.transfer import TransferAgent, TransferError

log = logging.getLogger(__name__)

Job = tuple[int, int, int]  # (index into the batch, local address, offset in the segment)


@dataclass
class ClientStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0  # objects newly stored
    put_skipped: int = 0  # already present or in flight elsewhere
    put_failed: int = 0  # no space, transfer failure, deadline
    errors: int = 0  # master timeouts and transfer failures


class StoreClient:
    def __init__(self, master_address: str, transfer: Optional[TransferAgent],
                 timeout_s: float = 5.0, *, use_shm: bool = True,
                 copy_threads: int = 2, shm_dir: Optional[str] = "/dev/shm") -> None:
        self.master_address = master_address
        self.transfer = transfer
        self.timeout_s = timeout_s
        self.use_shm = use_shm
        self.stats = ClientStats()
        self._copy_threads = copy_threads
        self._pool: Optional[ThreadPoolExecutor] = None
        self._ctx: Optional[zmq.asyncio.Context] = None
        self._sock: Optional[zmq.asyncio.Socket] = None
        self._reader: Optional[asyncio.Task[None]] = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        # same-host node segments in [store] shm_dir, remapped on a new epoch
        self._maps = SegmentMaps(shm_dir)
        self._registered: list[tuple[int, int]] = []

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, self.master_address, bind=False,
                                 hwm=OUTBOX_HWM)
        self._pool = ThreadPoolExecutor(self._copy_threads, thread_name_prefix="store-copy")
        self._reader = asyncio.create_task(self._read_replies())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for fut in self._pending.values():
            fut.cancel()
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._maps.close()

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
        t0 = time.monotonic()
        reply = await self._call(lambda r: p.StoreGet(r, [k.hex() for k in keys]))
        ok = [False] * len(keys)
        if reply is not None:
            self._forget_dead(reply.live)
            deadline = min(t0 + reply.lease_s, t0 + self.timeout_s)
            plans = [list(locs or []) for locs in reply.locations]
            await self._move_with_fallback(plans, addresses, size, reply.nodes, ok,
                                           write=False, deadline=deadline)
            if time.monotonic() > deadline:  # lease may have lapsed mid-copy: trust nothing
                ok = [False] * len(keys)
        hits = sum(ok)
        self.stats.hits += hits
        self.stats.misses += len(keys) - hits
        self.stats.bytes_read += hits * size
        return ok

    async def batch_put_from(self, keys: list[bytes], addresses: list[int], size: int,
                             replica_num: int = 1) -> int:
        """Store each object not yet present. Returns how many were newly stored."""
        t0 = time.monotonic()
        hexkeys = [k.hex() for k in keys]
        reply = await self._call(lambda r: p.StorePutStart(r, hexkeys, size, replica_num))
        if reply is None:
            self.stats.put_failed += len(keys)
            return 0
        self._forget_dead(reply.live)
        new = [i for i, s in enumerate(reply.status) if s == "new"]
        self.stats.put_skipped += sum(1 for s in reply.status if s == "exists")
        self.stats.put_failed += sum(1 for s in reply.status if s == "nospace")
        if not new:
            return 0
        deadline = min(t0 + reply.put_timeout_s / 2, t0 + self.timeout_s)
        written = [True] * len(new)
        for r in range(max(len(reply.locations[i]) for i in new)):  # every replica
            plans = [[reply.locations[i][r]] if r < len(reply.locations[i]) else []
                     for i in new]
            done = [not plan for plan in plans]
            await self._move_with_fallback(plans, [addresses[i] for i in new], size,
                                           reply.nodes, done, write=True, deadline=deadline)
            written = [w and d for w, d in zip(written, done)]
        if time.monotonic() > deadline:
            written = [False] * len(new)
        end = await self._call(lambda r: p.StorePutEnd(r, [hexkeys[i] for i in new], written))
        stored = sum(end.committed) if end is not None else 0
        self.stats.puts += stored
        self.stats.put_failed += len(new) - stored
        self.stats.bytes_written += stored * size
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

    def _forget_dead(self, live: Optional[list[str]]) -> None:
        """Unmap the segments of nodes the master no longer lists."""
        if live is not None:
            self._maps.retain(live)

    def mapped_segments(self) -> dict[str, str]:
        """node_id → segment file of every node segment mapped in this process."""
        return self._maps.mapped()

    async def master_stats(self) -> Optional[dict[str, Any]]:
        reply = await self._call(lambda r: p.StoreStats(r))
        return reply.stats if reply is not None else None

    # ------------------------------------------------------------ data path
    async def _move_with_fallback(self, plans: list[list[Any]], addresses: list[int],
                                  size: int, nodes: dict[str, Any], ok: list[bool],
                                  write: bool, deadline: float) -> None:
        """Try each item's locations in order until one copy succeeds or time runs out."""
        attempt = 0
        while True:
            by_node: dict[str, list[Job]] = {}
            for i, plan in enumerate(plans):
                if not ok[i] and attempt < len(plan):
                    node_id, offset = plan[attempt]
                    by_node.setdefault(node_id, []).append((i, addresses[i], offset))
            if not by_node or time.monotonic() >= deadline:
                return
            results = await asyncio.gather(*(
                self._move(n, nodes.get(n), jobs, size, write, deadline)
                for n, jobs in by_node.items()))
            for jobs, success in zip(by_node.values(), results):
                for i, _, _ in jobs:
                    ok[i] = ok[i] or success
            attempt += 1

    async def _move(self, node_id: str, info: Optional[dict[str, Any]], jobs: list[Job],
                    size: int, write: bool, deadline: float) -> bool:
        if info is None:
            return False
        seg = self._maps.get(node_id, info) if self.use_shm else None
        remaining = deadline - time.monotonic()
        try:
            if seg is not None:
                pairs = [(seg.base + off, addr, size) if write else (addr, seg.base + off, size)
                         for _, addr, off in jobs]
                # bounded, never abandoned half-way, never unmapped under the copy
                await self._copy(pairs, seg.view(0, seg.nbytes))
                return True
            if self.transfer is None:
                return False
            local = [addr for _, addr, _ in jobs]
            remote = [info["base"] + off for _, _, off in jobs]
            move = self.transfer.write_async if write else self.transfer.read_async
            await move(info["session_id"], local, remote, [size] * len(jobs), remaining)
            return True
        except (TransferError, asyncio.TimeoutError, OSError) as exc:
            self.stats.errors += 1
            log.warning("store %s via %s failed: %s", "put" if write else "get",
                        info.get("session_id"), exc)
            return False

    async def _copy(self, pairs: list[tuple[int, int, int]], pin: memoryview) -> None:
        """memmove on the copy threads, split in as many slices as there are threads;
        each slice holds ``pin`` (a view of the segment) until it is done."""
        assert self._pool is not None
        loop = asyncio.get_running_loop()
        total = sum(n for _, _, n in pairs)
        if total < (1 << 20) or len(pairs) < 2:
            await loop.run_in_executor(self._pool, copy_many, pairs, pin)
            return
        k = self._copy_threads
        await asyncio.gather(*(loop.run_in_executor(self._pool, copy_many, pairs[j::k], pin)
                               for j in range(k)))

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
