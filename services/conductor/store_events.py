"""The global pool's contents, as the conductor learns them from the store master's KV
events (PUB/SUB). Feeds the policy's global PrefixIndex and keeps it equal to the master's
committed keys across lost events and master restarts.

``IndexSync`` is the pure state machine (no zmq; time passed in):

    WAITING ──events or beacon──→ RESYNCING ──snapshot──→ LIVE
    LIVE ──gap (seq jumps, or last_seq ahead)──→ RESYNCING   (index kept until the snapshot)
    LIVE | RESYNCING ──new incarnation (master restarted)──→ RESYNCING   (index cleared)
    any ──master silent for silence_s──→ WAITING   (index cleared: nothing is reachable)

A snapshot (``StoreKeys``) holds every committed key as of event ``last_seq`` of one
incarnation; events queued behind it with ``seq <= last_seq`` are already in it and are
skipped. While RESYNCING, events are dropped (the snapshot, asked after them, covers them).
``StoreEventFeed`` runs it: it asks for a snapshot with a deadline and retries with
back-off until one arrives or the master goes silent.
"""
from __future__ import annotations

import enum
import logging
import time
from typing import Any, Optional

import zmq
import zmq.asyncio

from common.config import ClusterConfig
from common.ipc import make_socket, try_decode
from common.scheduling import PrefixIndex
from common.store.client import StoreClient
from common.store.protocol import StoreEvents, StoreKeysReply

log = logging.getLogger("conductor.store_events")

SNAPSHOT_TIMEOUT_S = 2.0  # one StoreKeys request
RETRY_FIRST_S, RETRY_MAX_S = 0.2, 2.0  # back-off between failed snapshot requests


class Sync(enum.Enum):
    WAITING = "waiting"  # nothing heard from a master (yet, or for silence_s)
    RESYNCING = "resyncing"  # a snapshot is needed before events can be applied
    LIVE = "live"  # the index equals the master's keys as of ``last_seq``


class IndexSync:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.state = Sync.WAITING
        self.incarnation: Optional[str] = None
        self.last_seq = 0
        self.last_heard: Optional[float] = None
        self.gaps = 0  # events lost in one incarnation
        self.restarts = 0  # incarnations that replaced another
        self.resyncs = 0  # snapshots applied

    def on_events(self, msg: StoreEvents, now: float) -> None:
        self.last_heard = now
        if msg.incarnation != self.incarnation:
            if self.incarnation is not None:
                self.restarts += 1
                log.warning("store master restarted (incarnation %s → %s): resync",
                            self.incarnation, msg.incarnation)
            self.index.replace(())  # the old master's objects are gone with it
            self.incarnation, self.last_seq = msg.incarnation, 0
            self.state = Sync.RESYNCING
        if self.state is not Sync.LIVE:
            return
        for seq, kind, key in msg.events:
            if seq <= self.last_seq:
                continue  # already in the snapshot
            if seq != self.last_seq + 1:
                return self._gap(self.last_seq + 1, seq - 1)
            self.last_seq = seq
            if kind == "stored":
                self.index.on_stored([key])
            elif kind == "removed":
                self.index.on_removed([key])
        if msg.last_seq > self.last_seq:
            self._gap(self.last_seq + 1, msg.last_seq)

    def _gap(self, first: int, last: int) -> None:
        self.gaps += 1
        log.warning("store events %d..%d were missed: resync", first, last)
        self.state = Sync.RESYNCING

    def on_snapshot(self, reply: StoreKeysReply) -> None:
        """Replace the index with the master's keys; events after ``last_seq`` follow."""
        self.index.replace(reply.keys)
        self.incarnation, self.last_seq = reply.incarnation, reply.last_seq
        self.state = Sync.LIVE
        self.resyncs += 1
        log.info("global index resynced: %d keys as of event %d of master %s",
                 len(reply.keys), reply.last_seq, reply.incarnation)

    def on_silence(self, now: float, silence_s: float) -> bool:
        """Forget a master silent for ``silence_s``; True if it was just forgotten."""
        if self.last_heard is None or now - self.last_heard < silence_s:
            return False
        if self.state is not Sync.WAITING:
            log.warning("store master silent for %.1fs: global index cleared", silence_s)
        self.index.replace(())
        self.state, self.incarnation, self.last_seq = Sync.WAITING, None, 0
        self.last_heard = None
        return True


class StoreEventFeed:
    """SUB to the master's KV events and a StoreClient for snapshots, feeding ``index``.

    The master publishes at least every ``store.heartbeat_interval_s``; silence for
    ``store.policy.heartbeat_timeout_s`` (the timeout it applies to its nodes) means it
    is gone."""

    def __init__(self, config: ClusterConfig, index: PrefixIndex) -> None:
        self.sync = IndexSync(index)
        self.silence_s = config.store.policy.heartbeat_timeout_s
        self.client = StoreClient(config.inbox("store_master"), None, SNAPSHOT_TIMEOUT_S,
                                  use_shm=False)
        self.sock = make_socket(zmq.asyncio.Context.instance(), zmq.SUB,
                                config.store_events_address, bind=False)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.retry_s = RETRY_FIRST_S
        self.next_try = 0.0

    @property
    def index(self) -> PrefixIndex:
        return self.sync.index

    async def run(self) -> None:
        await self.client.start()
        try:
            while True:
                await self.step()
        finally:
            self.sock.close(0)
            await self.client.close()

    async def step(self) -> None:
        """Take one message (or time out), then ask for a snapshot if one is due."""
        now = time.monotonic()
        wait = self.silence_s
        if self.sync.state is Sync.RESYNCING:
            wait = max(0.0, min(wait, self.next_try - now))
        msg: Any = None
        if await self.sock.poll(wait * 1000):
            msg = try_decode(await self.sock.recv(), "conductor.store_events")
        now = time.monotonic()
        if isinstance(msg, StoreEvents):
            self.sync.on_events(msg, now)
        elif msg is None:
            self.sync.on_silence(now, self.silence_s)
        if self.sync.state is Sync.RESYNCING and now >= self.next_try:
            await self.resync()

    async def resync(self) -> None:
        """One snapshot request under its deadline; on failure, retry later (back-off)."""
        reply = await self.client.keys()
        if reply is not None:
            self.sync.on_snapshot(reply)
            self.retry_s = RETRY_FIRST_S
            return
        log.warning("store master gave no snapshot in %.1fs; retrying in %.1fs",
                    SNAPSHOT_TIMEOUT_S, self.retry_s)
        self.next_try = time.monotonic() + self.retry_s
        self.retry_s = min(self.retry_s * 2, RETRY_MAX_S)
