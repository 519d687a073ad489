"""A router state for dashboard tests without a cluster: a conductor's status with two
workers, its totals and the store's usage (the real message types), requests recorded as
flow.py records them, and the real router app served from a thread."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import replace
from typing import Iterator, Optional

from aiohttp import web

from common.config import ClusterConfig
from common.protocol import RequestAccepted
from common.status_protocol import (
    ClusterStatus, ConductorTotals, InstanceStatus, PrefillSummary, StoreUsage,
)
from services.router.app import build_app
from services.router.state import RouterState

WORKERS = [InstanceStatus("decode-0", "decode", 1024, 1000, 24, 0, 2, 2, context_tokens=300),
           InstanceStatus("prefill-0", "prefill", 512, 500, 12, 3, 0, 4, queued_tokens=900,
                          cached_blocks=40, heartbeat_age_s=0.1)]
TOTALS = ConductorTotals(placed=7, rejected={"ttft_slo": 2}, failed={"timeout": 1},
                         prompt_tokens=1000, cached_tokens=400, global_hit_tokens=150,
                         transfer_bytes=1 << 20, transfers=6, transfer_seconds=1.5)
STORE = StoreUsage(nodes=2, objects=30, dram_used=3 << 20, dram_capacity=64 << 20,
                   ssd_used=0, ssd_capacity=1 << 30,
                   counters={"hits": 9, "misses": 3, "evicted": 1}, age_s=0.4,
                   index_keys=30, index_state="live")


def state(api_keys: Optional[list[str]] = None) -> RouterState:
    config = ClusterConfig.load(None, {"served_model_name": "tiny",
                                       "security": {"api_keys": api_keys or []}})
    s = RouterState(config, mailbox=None, tokenizer=None,  # type: ignore[arg-type]
                    block_keys=lambda ids: [])
    s._on_status(ClusterStatus(True, WORKERS, 5, TOTALS, STORE))
    return s


def prefilled(s: RouterState, rid: str) -> None:
    """The conductor's next status after ``rid``'s prefill moved 4096 bytes in 0.2 s."""
    old = s.status
    assert old is not None and old.totals is not None
    totals = replace(old.totals, transfer_bytes=old.totals.transfer_bytes + 4096,
                     transfers=old.totals.transfers + 1,
                     transfer_seconds=old.totals.transfer_seconds + 0.2)
    s._on_status(replace(old, totals=totals,
                         prefills=[PrefillSummary(rid, 0.4, 0.1, 0.2, 4096)]))


def serve_one(s: RouterState, rid: str, status: int, now: float) -> None:
    """A request through the log and the metrics, as flow.py records it."""
    s.requests.arrived(rid, "/v1/completions", now - 1.0)
    if status == 200:
        s.requests.accepted(RequestAccepted(rid, "prefill-0", "decode-0", 0.1), now - 0.9)
        prefilled(s, rid)
        s.requests.tokens(rid, 5, now - 0.2)
    s.requests.finished(rid, status, (20, 4) if status == 200 else None, now)
    s.metrics.requests.labels("/v1/completions", str(status), "smollm2-135m").inc()


@contextlib.contextmanager
def running_router(s: RouterState, port: int) -> Iterator[str]:
    """The router's HTTP app over ``s`` on 127.0.0.1:``port``, in a thread; its URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_app(s))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()
