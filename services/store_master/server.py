"""The master's loop: one ROUTER, a {message type: handler} table, a periodic reaper.

All state lives in ``StoreMetadata`` (pure policy); this file only turns frames into verbs,
verbs into replies, and the policy's ``NodeCommand``s into messages to nodes.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any, Awaitable, Callable, Optional

import zmq
import zmq.asyncio

from common.ipc import encode, make_socket, try_decode
from common.store import protocol as p
from common.store.metadata import MetadataConfig, StoreMetadata
from services.store_master import MasterConfig
from services.store_master.metrics import MasterMetrics

log = logging.getLogger("store_master")

Handler = Callable[[bytes, Any], Awaitable[Optional[Any]]]


class MasterServer:
    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.md = StoreMetadata(MetadataConfig(
            put_timeout_s=config.put_timeout_s, lease_s=config.lease_s,
            high_watermark=config.high_watermark, evict_fraction=config.evict_fraction,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            hot_read_threshold=config.hot_read_threshold, hot_window_s=config.hot_window_s,
            max_replicas=config.max_replicas))
        self.metrics = MasterMetrics()
        self.ctx = zmq.asyncio.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, config.address, bind=True)
        self.pub = (make_socket(self.ctx, zmq.PUB, config.events_address, bind=True)
                    if config.events_address else None)
        self.epochs: dict[str, int] = {}  # node_id → registration count
        self.promotions: dict[tuple[str, str], asyncio.Future[bool]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.handlers: dict[type, Handler] = {
            p.StoreExists: self.on_exists,
            p.StoreGet: self.on_get,
            p.StorePutStart: self.on_put_start,
            p.StorePutEnd: self.on_put_end,
            p.StoreRemove: self.on_remove,
            p.StorePollEvents: self.on_poll_events,
            p.StoreStats: self.on_stats,
            p.NodeRegister: self.on_register,
            p.NodeHeartbeat: self.on_heartbeat,
            p.NodeCommandDone: self.on_command_done,
        }

    # ------------------------------------------------------------------ loop
    async def serve(self) -> None:
        try:
            asyncio.get_running_loop().add_signal_handler(
                signal.SIGTERM, asyncio.current_task().cancel)  # type: ignore[union-attr]
        except (RuntimeError, ValueError, NotImplementedError):
            pass  # not the main thread (tests): the caller cancels us
        self.metrics.serve(self.config.metrics_port)
        reaper = asyncio.create_task(self._reap_forever())
        log.info("store master listening on %s", self.config.address)
        try:
            while True:
                identity, frame = await self.sock.recv_multipart()
                msg = try_decode(frame, "store_master")
                handler = self.handlers.get(type(msg)) if msg is not None else None
                if handler is None:
                    continue
                self.metrics.requests.labels(type(msg).__name__).inc()
                keys = getattr(msg, "keys", None)
                if keys is not None:
                    self.metrics.keys.labels(type(msg).__name__).inc(len(keys))
                reply = await handler(identity, msg)
                if reply is not None:
                    self._send(identity, reply)
                self._flush()
        finally:
            reaper.cancel()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            dead, zombies = self.md.reap(time.monotonic())
            for node_id in dead:
                log.warning("node %s missed heartbeats for %.1fs: its replicas are dropped",
                            node_id, self.config.heartbeat_timeout_s)
            if zombies:
                log.info("reclaimed %d zombie puts", zombies)
            self._flush()
            self.metrics.observe(self.md)

    def _send(self, identity: bytes, msg: Any) -> None:
        try:
            self.sock.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as exc:
            log.warning("reply %s to %r dropped: %s", type(msg).__name__, identity, exc)

    def _flush(self) -> None:
        """Send node commands the policy queued and publish fresh KV events."""
        for cmd in self.md.drain_commands():
            if cmd.kind == "replicate":
                source = self.md.nodes.get(cmd.source_node)
                info = dict(source.info, node_id=cmd.source_node) if source else None
                msg = p.NodeCommandMsg(cmd.kind, cmd.key, cmd.offset, cmd.size, info,
                                       cmd.source_offset, self.config.put_timeout_s / 2)
            else:
                msg = p.NodeCommandMsg(cmd.kind, cmd.key, cmd.offset, cmd.size)
            self._send(cmd.node_id.encode(), msg)
        events = self.md.events.drain()
        if events and self.pub is not None:
            self.pub.send(encode(p.StoreEvents([[e.seq, e.kind, e.key] for e in events])))

    def _nodes_of(self, locations: list[Any]) -> dict[str, Any]:
        ids = {n for locs in locations if locs for n, _ in locs}
        return {n: self.md.nodes[n].info for n in ids if n in self.md.nodes}

    # -------------------------------------------------------------- clients
    async def on_exists(self, identity: bytes, msg: p.StoreExists) -> Any:
        return p.StoreExistsReply(msg.req_id, self.md.exists(list(msg.keys)))

    async def on_get(self, identity: bytes, msg: p.StoreGet) -> Any:
        keys = list(msg.keys)
        locations, promoting = self.md.get(keys, time.monotonic())
        if not promoting:
            return p.StoreGetReply(msg.req_id, locations, self._nodes_of(locations),
                                   self.config.lease_s)
        task = asyncio.create_task(self._finish_get(identity, msg.req_id, keys, locations,
                                                    promoting))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return None

    async def _finish_get(self, identity: bytes, req_id: int, keys: list[str],
                          locations: list[Any], promoting: list[int]) -> None:
        """Wait (bounded) for SSD → DRAM promotions, then answer the get."""
        waits = []
        for i in promoting:
            obj = self.md.objects.get(keys[i])
            for rep in obj.replicas if obj else []:
                if rep.tier == "dram" and not rep.ready:
                    fut = self.promotions.setdefault((rep.node_id, keys[i]),
                                                     asyncio.get_running_loop().create_future())
                    waits.append(fut)
        if waits:
            await asyncio.wait(waits, timeout=self.config.promote_wait_s)
        for key in (keys[i] for i in promoting):  # unanswered promotions: stop waiting
            for node_id in list(self.md.nodes):
                fut = self.promotions.get((node_id, key))
                if fut is not None and not fut.done():
                    fut.cancel()
                    del self.promotions[(node_id, key)]
        again, _ = self.md.get([keys[i] for i in promoting], time.monotonic(), promote=False)
        for i, locs in zip(promoting, again):
            locations[i] = locs
        self._send(identity, p.StoreGetReply(req_id, locations, self._nodes_of(locations),
                                             self.config.lease_s))

    async def on_put_start(self, identity: bytes, msg: p.StorePutStart) -> Any:
        if msg.size <= 0:
            return p.StorePutStartReply(msg.req_id, ["nospace"] * len(msg.keys),
                                        [[] for _ in msg.keys], {}, self.config.put_timeout_s)
        slots = self.md.put_start(list(msg.keys), msg.size, msg.replica_num, time.monotonic())
        locations = [[list(loc) for loc in s.locations] for s in slots]
        return p.StorePutStartReply(msg.req_id, [s.status for s in slots], locations,
                                    self._nodes_of(locations), self.config.put_timeout_s)

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
        nodes = {n.node_id: {"dram_used": n.allocator.used_bytes, "dram_capacity": n.capacity,
                             "ssd_used": n.ssd_used, "ssd_capacity": n.ssd_capacity}
                 for n in self.md.nodes.values()}
        return p.StoreStatsReply(msg.req_id, {"nodes": nodes, "objects": len(self.md.objects),
                                              "counters": dict(self.md.counters)})

    # ---------------------------------------------------------------- nodes
    async def on_register(self, identity: bytes, msg: p.NodeRegister) -> Any:
        if identity != msg.node_id.encode():
            log.warning("register from %r claims node_id %s: dropped", identity, msg.node_id)
            return None
        epoch = self.epochs.get(msg.node_id, 0) + 1
        self.epochs[msg.node_id] = epoch
        info = {"session_id": msg.session_id, "base": msg.base, "shm_path": msg.shm_path,
                "hostname": msg.hostname, "epoch": epoch, "segment_bytes": msg.segment_bytes}
        self.md.add_node(msg.node_id, msg.segment_bytes, msg.ssd_bytes, info, time.monotonic())
        log.info("node %s registered: %d MiB DRAM, %d MiB SSD, shm=%s", msg.node_id,
                 msg.segment_bytes >> 20, msg.ssd_bytes >> 20, msg.shm_path)
        return p.NodeAck(True, self.config.heartbeat_interval_s)

    async def on_heartbeat(self, identity: bytes, msg: p.NodeHeartbeat) -> Any:
        known = self.md.heartbeat(msg.node_id, time.monotonic())
        return p.NodeAck(known, self.config.heartbeat_interval_s)

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
        self.sock.close(0)
        if self.pub is not None:
            self.pub.close(0)
        self.ctx.term()
