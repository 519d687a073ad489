"""Prometheus metrics of the store master (one registry per master instance), served on
the master's listen address (``ClusterConfig.listen_host``), like every other listener."""
from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from services.store_master.metadata import StoreMetadata


class MasterMetrics:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("store_requests", "Requests by type", ["type"], registry=r)
        self.keys = Counter("store_keys", "Keys asked for by request type", ["type"], registry=r)
        self.events = Counter("store_policy_events", "Hits, misses, evictions, offloads, "
                              "promotions, zombie puts, dead nodes", ["kind"], registry=r)
        self.objects = Gauge("store_objects", "Objects known (any state)", registry=r)
        self.nodes = Gauge("store_nodes", "Registered live nodes", registry=r)
        self.used = Gauge("store_used_bytes", "Allocated bytes", ["tier"], registry=r)
        self.capacity = Gauge("store_capacity_bytes", "Capacity", ["tier"], registry=r)
        self._seen: dict[str, int] = {}

    def serve(self, port: Optional[int]) -> Optional[Any]:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread (port 0: a free one; None:
        not at all). Returns the HTTP server (``server_address``)."""
        if port is None:
            return None
        server, _ = start_http_server(port, addr=self.host, registry=self.registry)
        return server

    def observe(self, md: StoreMetadata) -> None:
        """Refresh gauges and turn the policy's counters into Prometheus counters."""
        stats = md.stats()
        nodes = stats["nodes"].values()
        self.objects.set(stats["objects"])
        self.nodes.set(len(nodes))
        for tier in ("dram", "ssd"):
            self.used.labels(tier).set(sum(n[f"{tier}_used"] for n in nodes))
            self.capacity.labels(tier).set(sum(n[f"{tier}_capacity"] for n in nodes))
        for kind, value in stats["counters"].items():
            delta = value - self._seen.get(kind, 0)
            if delta > 0:
                self.events.labels(kind).inc(delta)
            self._seen[kind] = value
