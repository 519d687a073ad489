"""The node's loop: register, heartbeat, and run the master's tier commands.

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
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import zmq
import zmq.asyncio

from common.ipc import encode, make_socket, try_decode
from common.store import protocol as p
from common.store.shm import Segment
from common.transfer import TransferAgent, TransferConfig
from services.store_node import MasterUnreachable, NodeConfig
from services.store_node.ssd import SsdTier

log = logging.getLogger("store_node")


class NodeServer:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = config.resolved_node_id()
        path = None
        if config.shm_dir:
            path = os.path.join(config.shm_dir,
                                f"crescent-store-{self.node_id}-{uuid.uuid4().hex[:8]}")
        self.segment = Segment(config.segment_bytes, path, create=True)
        self.ssd = SsdTier(config.ssd_dir, config.ssd_bytes)
        self.transfer = TransferAgent(TransferConfig(hostname=config.hostname,
                                                     protocol=config.protocol))
        self.transfer.register(self.segment.base, self.segment.nbytes)
        self.io = ThreadPoolExecutor(1, thread_name_prefix="ssd")  # keeps command order
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="replicate")  # one: no map races
        self.peers: dict[str, tuple[int, Optional[Segment]]] = {}  # shm path → (epoch, map)
        self.ctx = zmq.asyncio.Context()
        self.sock = make_socket(self.ctx, zmq.DEALER, config.master_address, bind=False,
                                identity=self.node_id.encode())
        self.heartbeat_s = 0.5
        self.last_ack = time.monotonic()
        self.handlers = {p.NodeAck: self.on_ack, p.NodeCommandMsg: self.on_command}

    def _register_msg(self) -> p.NodeRegister:
        return p.NodeRegister(self.node_id, self.config.hostname, self.transfer.session_id,
                              self.segment.base, self.segment.nbytes, self.ssd.capacity,
                              self.segment.path, os.getpid())

    async def register(self) -> None:
        """Register, retrying, until acknowledged or ``register_deadline_s`` passes."""
        give_up = time.monotonic() + self.config.register_deadline_s
        while time.monotonic() < give_up:
            await self.sock.send(encode(self._register_msg()))
            wait = min(self.config.timeout_s, max(0.05, give_up - time.monotonic()))
            if await self.sock.poll(wait * 1000):
                msg = try_decode(await self.sock.recv(), "store_node")
                if isinstance(msg, p.NodeAck) and msg.known:
                    self.heartbeat_s = msg.heartbeat_interval_s
                    self.last_ack = time.monotonic()
                    return
        raise MasterUnreachable(f"master {self.config.master_address} unreachable for "
                                f"{self.config.register_deadline_s:.0f}s")

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)  # type: ignore[union-attr]
        except (RuntimeError, ValueError, NotImplementedError):
            pass  # not the main thread (tests): the caller cancels us
        await self.register()
        log.info("node %s ready: segment %d MiB at %s, session %s", self.node_id,
                 self.segment.nbytes >> 20, self.segment.path or "anonymous memory",
                 self.transfer.session_id)
        print("ready", flush=True)
        beats = asyncio.create_task(self._heartbeat_forever())
        try:
            while True:
                msg = try_decode(await self.sock.recv(), "store_node")
                handler = self.handlers.get(type(msg)) if msg is not None else None
                if handler is not None:
                    await handler(msg)
        finally:
            beats.cancel()

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self.sock.send(encode(p.NodeHeartbeat(self.node_id, self.ssd.used)))
            silent = time.monotonic() - self.last_ack
            if silent > self.config.register_deadline_s:
                log.warning("master silent for %.0fs; still trying", silent)

    async def on_ack(self, msg: p.NodeAck) -> None:
        self.last_ack = time.monotonic()
        self.heartbeat_s = msg.heartbeat_interval_s
        if not msg.known:  # dropped by the master (or it restarted): start afresh
            log.warning("master forgot node %s; registering again", self.node_id)
            await self.sock.send(encode(self._register_msg()))

    async def on_command(self, msg: p.NodeCommandMsg) -> None:
        loop = asyncio.get_running_loop()
        if msg.op == "replicate":
            start_by = time.monotonic() + msg.start_within_s
            fut = loop.run_in_executor(self.copier, self._replicate, msg, start_by)
        else:
            fut = loop.run_in_executor(self.io, self._run_command, msg)
        fut.add_done_callback(lambda f: self._done(msg, f))

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
            peer = self._peer(src)
            dst = self.segment.base + msg.offset
            if peer is not None:
                ctypes.memmove(dst, peer.base + msg.source_offset, msg.size)
                return True
            self.transfer.read(src["session_id"], [dst], [src["base"] + msg.source_offset],
                               [msg.size])
            return True
        except Exception as exc:  # TransferError, OSError, a malformed source
            log.warning("replicate %s from %s failed: %s", msg.key, src.get("node_id"), exc)
            return False

    def _peer(self, info: dict[str, Any]) -> Optional[Segment]:
        """Another node's segment file mapped here, if this host can open it."""
        path = info.get("shm_path")
        if not path or path == self.segment.path:
            return None
        cached = self.peers.get(path)
        if cached is not None and cached[0] == info.get("epoch"):
            return cached[1]
        seg: Optional[Segment] = None
        if os.path.exists(path):
            try:
                seg = Segment(int(info["segment_bytes"]), path)
            except (OSError, ValueError) as exc:
                log.info("cannot map %s (%s): using the transfer engine", path, exc)
        self.peers[path] = (info.get("epoch", 0), seg)
        return seg

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

    def _done(self, msg: p.NodeCommandMsg, fut: Any) -> None:
        ok = not fut.cancelled() and fut.exception() is None and bool(fut.result())
        if msg.op == "drop_ssd":
            return
        try:
            self.sock.send(encode(p.NodeCommandDone(self.node_id, msg.op, msg.key, ok,
                                                    msg.offset)), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not report %s of %s: %s", msg.op, msg.key, exc)

    def close(self) -> None:
        self.io.shutdown(wait=True)
        self.copier.shutdown(wait=True)
        for _, seg in self.peers.values():
            if seg is not None:
                seg.close()
        self.peers.clear()
        self.sock.close(0)
        self.ctx.term()
        self.transfer.unregister(self.segment.base)
        self.transfer.close()
        self.segment.close(unlink=True)

