"""What the conductor tells the router every heartbeat beyond readiness: its totals, the
store's usage and the prefills done since, for the router's dashboard (docs/dashboard.md).

The totals are read back from the conductor's own Prometheus counters, so the dashboard
and ``/metrics`` cannot disagree. The store's usage comes from the master's ``StoreStats``
answer, asked every ``interval_s`` under the store client's deadline (``StoreView``); a
master that does not answer keeps its last figures, their ``age_s`` growing, and is asked
less often (up to every ``MAX_INTERVAL_S``) so a dead master costs one warning a while.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, Optional

from common.config import ClusterConfig
from common.metric_values import by_label, total
from common.status_protocol import ConductorTotals, StoreUsage
from common.store.client import StoreClient
from services.conductor.metrics import ConductorMetrics
from services.conductor.store_events import IndexSync

log = logging.getLogger("conductor.status")

STATS_TIMEOUT_S = 1.0  # one StoreStats request
MAX_INTERVAL_S = 10.0


def _counts(values: dict[str, float]) -> dict[str, int]:
    return {k: int(v) for k, v in values.items()}


def conductor_totals(m: ConductorMetrics) -> ConductorTotals:
    return ConductorTotals(
        placed=int(total(m.placed)), rejected=_counts(by_label(m.rejected, "reason")),
        failed=_counts(by_label(m.failed, "reason")), prompt_tokens=int(total(m.prompt_tokens)),
        cached_tokens=int(total(m.cached_tokens)),
        global_hit_tokens=int(total(m.global_hit_tokens)),
        transfer_bytes=int(total(m.transfer_bytes)),
        transfers=int(total(m.transfer_seconds, "_count")),
        transfer_seconds=total(m.transfer_seconds, "_sum"))


def store_usage(stats: dict[str, Any]) -> StoreUsage:
    """One ``StoreStats`` answer (services/store_master/metadata.py ``stats()``), summed over nodes;
    ValueError if it is not shaped like one."""
    try:
        nodes = list(stats["nodes"].values())
        return StoreUsage(
            nodes=len(nodes), objects=int(stats["objects"]),
            dram_used=sum(int(n["dram_used"]) for n in nodes),
            dram_capacity=sum(int(n["dram_capacity"]) for n in nodes),
            ssd_used=sum(int(n["ssd_used"]) for n in nodes),
            ssd_capacity=sum(int(n["ssd_capacity"]) for n in nodes),
            counters={str(k): int(v) for k, v in stats["counters"].items()}, age_s=0.0)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed store stats: {exc!r}") from None


class StoreView:
    """The store master's usage as last answered (kept fresh by ``run``), with the
    conductor's global index beside it."""

    def __init__(self, config: ClusterConfig, sync: Optional[IndexSync],
                 interval_s: float = 1.0) -> None:
        self.client = StoreClient(config.inbox("store_master"), None, STATS_TIMEOUT_S,
                                  use_shm=False)
        self.sync = sync
        self.interval_s = interval_s
        self.last: Optional[StoreUsage] = None
        self.last_at = 0.0  # monotonic time of that answer

    def usage(self, now: Optional[float] = None) -> Optional[StoreUsage]:
        if self.last is None:
            return None
        now = time.monotonic() if now is None else now
        sync = self.sync
        return replace(self.last, age_s=round(now - self.last_at, 3),
                       index_keys=len(sync.index) if sync else 0,
                       index_state=sync.state.value if sync else "")

    async def run(self) -> None:
        await self.client.start()
        wait = self.interval_s
        try:
            while True:
                if await self.poll():
                    wait = self.interval_s
                else:
                    wait = min(2 * wait, MAX_INTERVAL_S)
                await asyncio.sleep(wait)
        finally:
            await self.client.close()

    async def poll(self) -> bool:
        """Ask the master once; True if it answered with usable figures."""
        stats = await self.client.master_stats()
        if stats is None:
            return False
        try:
            self.last = store_usage(stats)
        except ValueError as exc:
            log.warning("%s: dropped", exc)
            return False
        self.last_at = time.monotonic()
        return True
