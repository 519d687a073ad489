"""The master's loop: one ROUTER inbox, a {message type: handler} table, a periodic reaper.

All state lives in ``StoreMetadata`` (pure policy); this file only turns frames into verbs,
verbs into replies, and the policy's ``NodeCommand``s into messages to nodes.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
from typing import Any, Awaitable, Callable, Optional

import zmq
import zmq.asyncio

from common.config import ClusterConfig
from common.idle_check import IdleCheck
from common.ipc import encode, make_socket
from common.mailbox import OUTBOX_HWM, RouterInbox, serve_inbox
from common.store import protocol as p
from services.store_master.metadata import StoreMetadata
from services.store_master.metrics import MasterMetrics

log = logging.getLogger("store_master")

Handler = Callable[[bytes, Any], Awaitable[Optional[Any]]]
CLIENT_REQUESTS = (p.StoreExists, p.StoreGet, p.StorePutStart, p.StorePutEnd, p.StoreRemove)


class MasterServer:
    def __init__(self, config: ClusterConfig) -> None:
        self.address = config.inbox("store_master")
        self.metrics_port = config.port("store_master_http")
        self.store = config.store
        self.policy = config.store.policy
        self.md = StoreMetadata(self.policy)
        self.metrics = MasterMetrics(config.listen_host("store_master"))
        self.inbox = RouterInbox(config.inbox("store_master", bind=True), "store_master")
        self.pub = make_socket(zmq.asyncio.Context.instance(), zmq.PUB,
                               config.store_events(bind=True), bind=True, hwm=OUTBOX_HWM)
        self.epochs: dict[str, int] = {}  # node_id → registration count
        self.registered: dict[str, p.NodeRegister] = {}  # node_id → its last registration
        self.incarnation = uuid.uuid4().hex[:12]  # new on every start: subscribers resync
        self.last_publish = 0.0
        self.promotions: dict[tuple[str, str], asyncio.Future[bool]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.idle_check = IdleCheck(self.md.check_integrity, "store metadata")
        self.last_client_request = time.monotonic()
        self.handlers: dict[type, Handler] = {
            p.StoreExists: self.on_exists,
            p.StoreGet: self.on_get,
            p.StorePutStart: self.on_put_start,
            p.StorePutEnd: self.on_put_end,
            p.StoreRemove: self.on_remove,
            p.StorePollEvents: self.on_poll_events,
            p.StoreStats: self.on_stats,
            p.StoreKeys: self.on_keys,
            p.NodeRegister: self.on_register,
            p.NodeHeartbeat: self.on_heartbeat,
            p.NodeCommandDone: self.on_command_done,
        }

    # ------------------------------------------------------------------ loop
    async def serve(self) -> None:
        self.metrics.serve(self.metrics_port)
        tasks = [asyncio.create_task(self._reap_forever(), name="store-reaper"),
                 asyncio.create_task(self.idle_check.watch(self._idle), name="store-idle-check")]
        log.info("store master listening on %s (incarnation %s)", self.address,
                 self.incarnation)
        await serve_inbox(self.inbox, self.handlers, tasks, after=self._after)

    def _idle(self) -> bool:
        """No client request for a second (node heartbeats aside)."""
        return time.monotonic() - self.last_client_request >= 1.0

    def _after(self, msg: Any) -> None:
        """Count the request, then send what the policy queued."""
        if isinstance(msg, CLIENT_REQUESTS):
            self.last_client_request = time.monotonic()
        self.metrics.requests.labels(type(msg).__name__).inc()
        keys = getattr(msg, "keys", None)
        if keys is not None:
            self.metrics.keys.labels(type(msg).__name__).inc(len(keys))
        self._flush()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.store.tick_s)
            dead, zombies = self.md.reap(time.monotonic())
            for node_id in dead:
                log.warning("node %s missed heartbeats for %.1fs: its replicas are dropped",
                            node_id, self.policy.heartbeat_timeout_s)
            if zombies:
                log.info("reclaimed %d zombie puts", zombies)
            self._flush()
            self.metrics.observe(self.md)

    def _send(self, identity: bytes, msg: Any) -> None:
        self.inbox.reply(identity, msg)

    def _flush(self) -> None:
        """Send node commands the policy queued and publish fresh KV events."""
        for cmd in self.md.drain_commands():
            if cmd.kind == "replicate":
                source = self.md.node_infos([cmd.source_node]).get(cmd.source_node)
                info = dict(source, node_id=cmd.source_node) if source is not None else None
                msg = p.NodeCommandMsg(cmd.kind, cmd.key, cmd.offset, cmd.size, info,
                                       cmd.source_offset, self.policy.put_timeout_s / 2)
            else:
                msg = p.NodeCommandMsg(cmd.kind, cmd.key, cmd.offset, cmd.size)
            self._send(cmd.node_id.encode(), msg)
        events = self.md.events.drain()
        now = time.monotonic()
        if events or now - self.last_publish >= self.store.heartbeat_interval_s:
            self.last_publish = now  # while idle, an empty batch: the beacon
            self.pub.send(encode(p.StoreEvents([[e.seq, e.kind, e.key] for e in events],
                                               self.incarnation, self.md.events.seq)))

    def _nodes_of(self, locations: list[Any]) -> dict[str, Any]:
        return self.md.node_infos({n for locs in locations if locs for n, _ in locs})

    def _live(self) -> list[str]:
        return sorted(self.md.nodes)

    # -------------------------------------------------------------- clients
    async def on_exists(self, identity: bytes, msg: p.StoreExists) -> Any:
        return p.StoreExistsReply(msg.req_id, self.md.exists(list(msg.keys)))

    async def on_get(self, identity: bytes, msg: p.StoreGet) -> Any:
        keys = list(msg.keys)
        locations, promoting = self.md.get(keys, time.monotonic())
        if not promoting:
            return p.StoreGetReply(msg.req_id, locations, self._nodes_of(locations),
                                   self._lease_s(keys), self._live())
        task = asyncio.create_task(self._finish_get(identity, msg.req_id, keys, locations,
                                                    promoting))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return None

    async def _finish_get(self, identity: bytes, req_id: int, keys: list[str],
                          locations: list[Any], promoting: list[int]) -> None:
        """Wait (bounded) for SSD → DRAM promotions, then answer the get."""
        loop = asyncio.get_running_loop()
        pairs = [(node_id, keys[i]) for i in promoting
                 for node_id in self.md.promoting_nodes(keys[i])]
        waits = [self.promotions.setdefault(pair, loop.create_future()) for pair in pairs]
        if waits:
            await asyncio.wait(waits, timeout=self.store.promote_wait_s)
        for pair in pairs:  # unanswered promotions: stop waiting
            fut = self.promotions.pop(pair, None)
            if fut is not None:
                fut.cancel()
        again, _ = self.md.get([keys[i] for i in promoting], time.monotonic(), promote=False)
        for i, locs in zip(promoting, again):
            locations[i] = locs
        self._send(identity, p.StoreGetReply(req_id, locations, self._nodes_of(locations),
                                             self._lease_s(keys), self._live()))

    def _lease_s(self, keys: list[str]) -> float:
        """The lease a get of ``keys`` was granted (``StoreMetadata.get``'s)."""
        return self.md.grant_s(self.policy.lease_s, self.md.complete_bytes(keys))

    async def on_put_start(self, identity: bytes, msg: p.StorePutStart) -> Any:
        if msg.size <= 0:
            return p.StorePutStartReply(msg.req_id, ["nospace"] * len(msg.keys),
                                        [[] for _ in msg.keys], {}, self.policy.put_timeout_s)
        slots = self.md.put_start(list(msg.keys), msg.size, msg.replica_num, time.monotonic())
        locations = [[list(loc) for loc in s.locations] for s in slots]
        timeout = self.md.grant_s(self.policy.put_timeout_s, msg.size * len(msg.keys))
        return p.StorePutStartReply(msg.req_id, [s.status for s in slots], locations,
                                    self._nodes_of(locations), timeout, self._live())

    async def on_put_end(self, identity: bytes, msg: p.StorePutEnd) -> Any:
        committed = self.md.put_end(list(msg.keys), list(msg.ok), time.monotonic())
        return p.StorePutEndReply(msg.req_id, committed)

    async def on_remove(self, identity: bytes, msg: p.StoreRemove) -> Any:
        return p.StoreRemoveReply(msg.req_id, self.md.remove(list(msg.keys), time.monotonic()))

    async def on_poll_events(self, identity: bytes, msg: p.StorePollEvents) -> Any:
        events = self.md.events.since(msg.after_seq)
        return p.StoreEventsReply(msg.req_id, [[e.seq, e.kind, e.key] for e in events],
                                  self.md.events.seq)

    async def on_stats(self, identity: bytes, msg: p.StoreStats) -> Any:
        return p.StoreStatsReply(msg.req_id, self.md.stats())

    async def on_keys(self, identity: bytes, msg: p.StoreKeys) -> Any:
        return p.StoreKeysReply(msg.req_id, self.incarnation, self.md.events.seq,
                                self.md.committed_keys())

    # ---------------------------------------------------------------- nodes
    async def on_register(self, identity: bytes, msg: p.NodeRegister) -> Any:
        if identity != msg.node_id.encode():
            log.warning("register from %r claims node_id %s: dropped", identity, msg.node_id)
            return None
        now = time.monotonic()
        if self.registered.get(msg.node_id) == msg and self.md.heartbeat(msg.node_id, now):
            # The same process again: heartbeats queued while this master was away all
            # answered "unknown" at once. Keep its epoch and replicas.
            return p.NodeAck(True, self.store.heartbeat_interval_s, self._live())
        self.registered[msg.node_id] = msg
        epoch = self.epochs.get(msg.node_id, 0) + 1
        self.epochs[msg.node_id] = epoch
        info = {"session_id": msg.session_id, "base": msg.base, "shm_path": msg.shm_path,
                "hostname": msg.hostname, "host_id": msg.host_id, "epoch": epoch,
                "segment_bytes": msg.segment_bytes}
        self.md.add_node(msg.node_id, msg.segment_bytes, msg.ssd_bytes, info, now)
        log.info("node %s registered: %d MiB DRAM, %d MiB SSD, shm=%s", msg.node_id,
                 msg.segment_bytes >> 20, msg.ssd_bytes >> 20, msg.shm_path)
        return p.NodeAck(True, self.store.heartbeat_interval_s, self._live())

    async def on_heartbeat(self, identity: bytes, msg: p.NodeHeartbeat) -> Any:
        known = self.md.heartbeat(msg.node_id, time.monotonic())
        return p.NodeAck(known, self.store.heartbeat_interval_s, self._live())

    async def on_command_done(self, identity: bytes, msg: p.NodeCommandDone) -> Any:
        if msg.op == "offload":
            self.md.offload_done(msg.node_id, msg.key, msg.ok, time.monotonic())
        elif msg.op == "promote":
            self.md.promote_done(msg.node_id, msg.key, msg.ok)
            fut = self.promotions.pop((msg.node_id, msg.key), None)
            if fut is not None and not fut.done():
                fut.set_result(msg.ok)
        elif msg.op == "replicate":
            if self.md.replicate_done(msg.node_id, msg.key, msg.offset, msg.ok):
                log.info("hot object %s: new replica on %s", msg.key, msg.node_id)
        return None

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.inbox.close()
        self.pub.close(0)


def freeze_after_full_collections() -> None:
    """After each full garbage collection, move its survivors out of the collector's sight
    (``gc.freeze``), so that the next one scans only what was created since. The master
    holds a few tracked objects per stored object and creates and drops thousands a
    second under load: at 50,000 objects each full collection stopped it for 150-240 ms,
    about once a second while puts evicted (`benchmarks/store_master.py --churn`). Its
    records die by reference count (no cycles: after a churn run, unfreezing and
    collecting found 0 unreachable of 238,605 frozen objects); a cycle still referenced at
    a freeze and dropped later would stay allocated. The master's process only: the
    callback is global to the interpreter."""
    def freeze(phase: str, info: dict[str, Any]) -> None:
        if phase == "stop" and info["generation"] == 2:
            gc.freeze()

    gc.callbacks.append(freeze)


async def run(config: ClusterConfig, index: int = 0) -> None:
    """Serve the store master of ``config`` until cancelled (common/service.py starts it)."""
    freeze_after_full_collections()
    server = MasterServer(config)
    try:
        await server.serve()
    finally:
        server.close()
