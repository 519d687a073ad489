"""The node's loop: register, heartbeat, and run the master's tier commands (each timed,
its bytes and failures counted: the node's ``/metrics``, common/worker_metrics.py).

The segment is passive memory: clients read and write it through the transfer engine or a
mapping of its file; this loop never touches KV bytes except to move them between tiers
and, for a hot object, to copy another node's replica into its own segment (``replicate``:
one memmove when the source's segment file is mappable here, else a transfer-engine read).
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from common.config import ClusterConfig
from common.host import host_id
from common.mailbox import DealerLink, serve_inbox
from common.security import clamp_interval
from common.service import StartupError
from common.store import protocol as p
from common.store.peers import SegmentMaps
from common.store.shm import Segment, owned_path, sweep_dead
from common.transfer import TransferAgent, TransferConfig
from common import worker_metrics
from services.store_node.ssd import SsdTier

log = logging.getLogger("store_node")
MIN_BEAT_S = 0.05  # a master asking for faster heartbeats gets these


class MasterUnreachable(StartupError):
    pass


class NodeServer:
    def __init__(self, config: ClusterConfig, index: int) -> None:
        store = config.store
        self.store = store
        self.node_id = f"store_node-{index}"
        self.hostname = config.address("store_node", index)
        self.master_address = config.inbox("store_master")
        path = None
        if store.shm_dir:  # first remove files of nodes SIGKILLed on this host
            sweep_dead(store.shm_dir, "store")
            path = owned_path(store.shm_dir, "store", self.node_id)
        self.segment = Segment(store.segment_bytes, path, create=True)
        ssd_dir = f"{store.ssd_dir}/node-{index}" if store.ssd_dir and store.ssd_bytes else None
        self.ssd = SsdTier(ssd_dir, store.ssd_bytes if ssd_dir else 0)
        self.transfer = TransferAgent(TransferConfig(hostname=self.hostname,
                                                     protocol=config.transfer_protocol))
        self.transfer.register(self.segment.base, self.segment.nbytes)
        self.io = ThreadPoolExecutor(1, thread_name_prefix="ssd")  # keeps command order
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="replicate")  # one: no map races
        self.peers = SegmentMaps(store.shm_dir, own_path=self.segment.path)  # other nodes
        self.link = DealerLink(self.master_address, "store_node", self.node_id.encode())
        self.heartbeat_s = store.heartbeat_interval_s
        self.last_ack = time.monotonic()
        self.registered_at = 0.0  # when a registration was last sent from on_ack
        self.handlers = {p.NodeAck: self.on_ack, p.NodeCommandMsg: self.on_command}
        self.metrics = worker_metrics.current()
        self.metrics_server = worker_metrics.serve(config, "store_node", index)

    def _register_msg(self) -> p.NodeRegister:
        return p.NodeRegister(self.node_id, self.hostname, self.transfer.session_id,
                              self.segment.base, self.segment.nbytes, self.ssd.capacity,
                              self.segment.path, os.getpid(), host_id())

    async def register(self) -> None:
        """Register, retrying, until acknowledged or ``register_deadline_s`` passes."""
        give_up = time.monotonic() + self.store.register_deadline_s
        while time.monotonic() < give_up:
            wait = min(self.store.node_timeout_s, max(0.05, give_up - time.monotonic()))
            msg = await self.link.request(self._register_msg(), wait)
            if isinstance(msg, p.NodeAck) and msg.known:
                self.heartbeat_s = self._beat(msg)
                self.last_ack = time.monotonic()
                return
        raise MasterUnreachable(f"master {self.master_address} unreachable for "
                                f"{self.store.register_deadline_s:.0f}s")

    async def serve(self) -> None:
        await self.register()
        log.info("node %s ready: segment %d MiB at %s, session %s", self.node_id,
                 self.segment.nbytes >> 20, self.segment.path or "anonymous memory",
                 self.transfer.session_id)
        print("ready", flush=True)
        beats = asyncio.create_task(self._heartbeat_forever(), name="store-node-heartbeat")
        await serve_inbox(self.link, self.handlers, [beats])

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self.link.send(p.NodeHeartbeat(self.node_id, self.ssd.used))
            silent = time.monotonic() - self.last_ack
            if silent > self.store.register_deadline_s:
                log.warning("master silent for %.0fs; still trying", silent)

    def _beat(self, msg: p.NodeAck) -> float:
        """The master's heartbeat period, within [MIN_BEAT_S, register_deadline_s]."""
        return clamp_interval(msg.heartbeat_interval_s, MIN_BEAT_S,
                              self.store.register_deadline_s)

    def on_ack(self, msg: p.NodeAck) -> Optional[p.NodeRegister]:
        self.last_ack = time.monotonic()
        self.heartbeat_s = self._beat(msg)
        if msg.live is not None:  # on the copier thread: never under a running copy
            self.copier.submit(self.peers.retain, msg.live)
        if msg.known:
            return None
        now = time.monotonic()
        if now - self.registered_at < self.heartbeat_s:
            return None  # the acks of beats queued while the master was away: one will do
        self.registered_at = now
        log.warning("master forgot node %s; registering again", self.node_id)  # or restarted
        return self._register_msg()

    async def on_command(self, msg: p.NodeCommandMsg) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        if msg.op == "replicate":
            start_by = time.monotonic() + clamp_interval(  # never past the master's own
                msg.start_within_s, 0.0, self.store.policy.put_timeout_s / 2)  # reclaim
            fut = loop.run_in_executor(self.copier, self._replicate, msg, start_by)
        else:
            fut = loop.run_in_executor(self.io, self._run_command, msg)
        fut.add_done_callback(lambda f: self._done(msg, f, started))

    def _replicate(self, msg: p.NodeCommandMsg, start_by: float) -> bool:
        """Copy a replica from the source node into this segment (blocking; copier thread).

        Never starts after ``start_by``: the master reclaims the space after put_timeout_s
        and a late copy could overwrite whatever was placed there since."""
        src = msg.source
        if (src is None or msg.offset + msg.size > self.segment.nbytes
                or msg.source_offset + msg.size > int(src.get("segment_bytes", 0))):
            return False
        if time.monotonic() > start_by:
            return False
        try:
            peer = self.peers.get(str(src.get("node_id")), src)
            dst = self.segment.base + msg.offset
            if peer is not None:
                ctypes.memmove(dst, peer.base + msg.source_offset, msg.size)
                self.metrics.moved("replicate", "shm", msg.size)
                return True
            self.transfer.read(src["session_id"], [dst], [src["base"] + msg.source_offset],
                               [msg.size])
            self.metrics.moved("replicate", "transfer_engine", msg.size)
            return True
        except Exception as exc:  # TransferError, OSError, a malformed source
            self.metrics.error("any", "replicate")
            log.warning("replicate %s from %s failed: %s", msg.key, src.get("node_id"), exc)
            return False

    def _run_command(self, msg: p.NodeCommandMsg) -> bool:
        try:
            if msg.op == "offload":
                return self.ssd.offload(self.segment, msg.key, msg.offset, msg.size)
            if msg.op == "promote":
                return self.ssd.promote(self.segment, msg.key, msg.offset, msg.size)
            if msg.op == "drop_ssd":
                return self.ssd.drop(msg.key)
        except (OSError, ValueError) as exc:
            log.warning("%s of %s failed: %s", msg.op, msg.key, exc)
        return False

    def _done(self, msg: p.NodeCommandMsg, fut: Any, started: float) -> None:
        ok = not fut.cancelled() and fut.exception() is None and bool(fut.result())
        if msg.op == "drop_ssd":
            return
        self.metrics.step(msg.op, time.perf_counter() - started, 0, 0)
        if msg.op != "replicate" and ok:  # SSD ↔ DRAM (a replica's: counted as it moves)
            self.metrics.moved(msg.op, "ssd", msg.size)
        elif msg.op != "replicate":
            self.metrics.error("ssd", msg.op)
        self.link.reply(None, p.NodeCommandDone(self.node_id, msg.op, msg.key, ok, msg.offset))

    def close(self) -> None:
        worker_metrics.stop(self.metrics_server)
        self.io.shutdown(wait=True)
        self.copier.shutdown(wait=True)
        self.peers.close()
        self.link.close()
        self.transfer.unregister(self.segment.base)
        self.transfer.close()
        self.segment.close(unlink=True)


async def run(config: ClusterConfig, index: int = 0) -> None:
    """Serve store node ``index`` of ``config`` until cancelled. Raises MasterUnreachable."""
    server = NodeServer(config, index)
    try:
        await server.serve()
    finally:
        server.close()
