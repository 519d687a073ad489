"""The global pool's contents, as the conductor learns them from the store master's
KV events (PUB/SUB). Feeds the policy's global PrefixIndex."""
from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from common.ipc import make_socket, try_decode
from common.scheduling import PrefixIndex
from common.store.protocol import StoreEvents

log = logging.getLogger("conductor.store_events")


class StoreEventFeed:
    def __init__(self, address: str, index: PrefixIndex) -> None:
        self.index = index
        self.last_seq = 0
        self.gaps = 0
        self.sock = make_socket(zmq.asyncio.Context.instance(), zmq.SUB, address, bind=False)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")

    def apply(self, msg: StoreEvents) -> None:
        for seq, kind, key in msg.events:
            if self.last_seq and seq != self.last_seq + 1:
                self.gaps += 1
                log.warning("store events %d..%d were missed; the global index may lag",
                            self.last_seq + 1, seq - 1)
            self.last_seq = seq
            if kind == "stored":
                self.index.on_stored([key])
            elif kind == "removed":
                self.index.on_removed([key])

    async def run(self) -> None:
        try:
            while True:
                msg = try_decode(await self.sock.recv(), "conductor.store_events")
                if isinstance(msg, StoreEvents):
                    self.apply(msg)
        finally:
            self.sock.close(0)
