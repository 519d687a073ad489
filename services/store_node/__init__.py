"""Store node: a DRAM segment (a /dev/shm file by default) registered with the transfer
engine, plus an optional SSD tier. Carries bytes only through the transfer engine (or
same-host mappings of its segment file); the master owns all metadata.

``python -m services.store_node --master tcp://127.0.0.1:7600 --segment-mib 256``
prints ``ready`` once registered; exits 1 if the master stays unreachable.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import dataclass
from typing import Optional


@dataclass
class NodeConfig:
    master_address: str = "tcp://127.0.0.1:7600"
    node_id: Optional[str] = None  # default: node-<hostname>-<pid>
    segment_bytes: int = 256 << 20
    ssd_dir: Optional[str] = None  # None: no SSD tier
    ssd_bytes: int = 0
    hostname: str = "127.0.0.1"  # transfer-engine hostname
    protocol: str = "tcp"
    shm_dir: Optional[str] = "/dev/shm"  # None: anonymous segment, transfer engine only
    register_deadline_s: float = 10.0  # give up if the master is unreachable this long
    timeout_s: float = 2.0  # one register/heartbeat exchange

    def resolved_node_id(self) -> str:
        return self.node_id or f"node-{self.hostname}-{os.getpid()}"


class MasterUnreachable(RuntimeError):
    pass


async def run(config: NodeConfig) -> None:
    """One event loop; serves until cancelled. Raises MasterUnreachable."""
    from services.store_node.server import NodeServer

    server = NodeServer(config)
    try:
        await server.serve()
    finally:
        server.close()


def parse_args(argv: Optional[list[str]] = None) -> NodeConfig:
    d = NodeConfig()
    p = argparse.ArgumentParser(prog="python -m services.store_node", description=__doc__)
    p.add_argument("--master", default=d.master_address, help="master ROUTER address")
    p.add_argument("--node-id", default=None)
    p.add_argument("--segment-mib", type=int, default=d.segment_bytes >> 20)
    p.add_argument("--ssd-dir", default=None)
    p.add_argument("--ssd-mib", type=int, default=0)
    p.add_argument("--hostname", default=d.hostname)
    p.add_argument("--protocol", default=d.protocol)
    p.add_argument("--shm-dir", default=d.shm_dir, help="'' for an anonymous segment")
    p.add_argument("--register-deadline-s", type=float, default=d.register_deadline_s)
    a = p.parse_args(argv)
    return NodeConfig(master_address=a.master, node_id=a.node_id,
                      segment_bytes=a.segment_mib << 20, ssd_dir=a.ssd_dir,
                      ssd_bytes=a.ssd_mib << 20, hostname=a.hostname, protocol=a.protocol,
                      shm_dir=a.shm_dir or None, register_deadline_s=a.register_deadline_s)


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(run(config))
    except MasterUnreachable as exc:
        print(f"store_node: {exc}", file=sys.stderr, flush=True)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass  # SIGINT / SIGTERM: a clean stop
    return 0
