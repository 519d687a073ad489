"""Store master: metadata only (keys → replicas, space, leases, eviction, liveness).

``python -m services.store_master --address tcp://127.0.0.1:7600`` serves until killed.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from typing import Optional


@dataclass
class MasterConfig:
    address: str = "tcp://127.0.0.1:7600"  # ROUTER: clients and nodes (DEALER) connect
    events_address: Optional[str] = None  # PUB of KV events, e.g. tcp://127.0.0.1:7601
    metrics_port: Optional[int] = None  # Prometheus HTTP
    heartbeat_interval_s: float = 0.5  # told to nodes
    heartbeat_timeout_s: float = 5.0
    put_timeout_s: float = 10.0
    lease_s: float = 5.0
    high_watermark: float = 0.9
    evict_fraction: float = 0.1
    promote_wait_s: float = 2.0  # a get waits this long for SSD → DRAM promotions
    tick_s: float = 0.1
    hot_read_threshold: int = 4  # reads per DRAM replica within hot_window_s → one more; 0: off
    hot_window_s: float = 10.0
    max_replicas: int = 2  # hot replication adds copies up to this many


async def run(config: MasterConfig) -> None:
    """One event loop; serves until cancelled."""
    from services.store_master.server import MasterServer

    server = MasterServer(config)
    try:
        await server.serve()
    finally:
        server.close()


def parse_args(argv: Optional[list[str]] = None) -> MasterConfig:
    d = MasterConfig()
    p = argparse.ArgumentParser(prog="python -m services.store_master", description=__doc__)
    p.add_argument("--address", default=d.address)
    p.add_argument("--port", type=int, default=None,
                   help="shorthand for --address tcp://127.0.0.1:PORT")
    p.add_argument("--events-address", default=None)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s)
    p.add_argument("--heartbeat-timeout-s", type=float, default=d.heartbeat_timeout_s)
    p.add_argument("--put-timeout-s", type=float, default=d.put_timeout_s)
    p.add_argument("--lease-s", type=float, default=d.lease_s)
    p.add_argument("--high-watermark", type=float, default=d.high_watermark)
    p.add_argument("--evict-fraction", type=float, default=d.evict_fraction)
    p.add_argument("--hot-read-threshold", type=int, default=d.hot_read_threshold,
                   help="reads per replica within --hot-window-s that add a replica (0: off)")
    p.add_argument("--hot-window-s", type=float, default=d.hot_window_s)
    p.add_argument("--max-replicas", type=int, default=d.max_replicas)
    a = p.parse_args(argv)
    address = f"tcp://127.0.0.1:{a.port}" if a.port else a.address
    return MasterConfig(address=address, events_address=a.events_address,
                        metrics_port=a.metrics_port,
                        heartbeat_interval_s=a.heartbeat_interval_s,
                        heartbeat_timeout_s=a.heartbeat_timeout_s,
                        put_timeout_s=a.put_timeout_s, lease_s=a.lease_s,
                        high_watermark=a.high_watermark, evict_fraction=a.evict_fraction,
                        hot_read_threshold=a.hot_read_threshold, hot_window_s=a.hot_window_s,
                        max_replicas=a.max_replicas)


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
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass  # SIGINT / SIGTERM: a clean stop
    return 0
