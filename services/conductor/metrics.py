"""Conductor metrics (prometheus-client), served on its own port."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ConductorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.placed = Counter("crescent_conductor_placed", "requests placed",
                              ["prefill", "decode"], registry=r)
        self.rejected = Counter("crescent_conductor_rejected", "requests rejected at admission",
                                ["reason"], registry=r)
        self.failed = Counter("crescent_conductor_failed", "admitted requests that failed",
                              ["reason"], registry=r)
        self.finished = Counter("crescent_conductor_finished", "requests finished",
                                ["reason"], registry=r)
        self.decision_seconds = Histogram(
            "crescent_conductor_decision_seconds", "time to place one request",
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2), registry=r)
        self.predicted_ttft = Histogram("crescent_conductor_predicted_ttft_seconds",
                                        "predicted TTFT at placement", buckets=_TTFT_BUCKETS,
                                        registry=r)
        self.actual_ttft = Histogram("crescent_conductor_actual_prefill_ttft_seconds",
                                     "accept → KV on decode", buckets=_TTFT_BUCKETS, registry=r)
        self.ttft_error = Histogram("crescent_conductor_ttft_error_seconds",
                                    "actual − predicted TTFT",
                                    buckets=(-5, -1, -0.25, -0.05, 0, 0.05, 0.25, 1, 5),
                                    registry=r)
        self.prompt_tokens = Counter("crescent_prompt_tokens", "prompt tokens prefilled",
                                     registry=r)
        self.cached_tokens = Counter("crescent_cached_tokens",
                                     "prompt tokens reused from a cache", registry=r)
        self.global_hit_tokens = Counter("crescent_global_cache_hit_tokens",
                                         "prompt tokens loaded from the KV pool", registry=r)
        self.transfer_bytes = Counter("crescent_kv_transfer_bytes",
                                      "KV bytes moved prefill → decode", registry=r)
        self.cost_refits = Counter("crescent_conductor_cost_refits",
                                   "prefill cost model replaced by an online refit", registry=r)
        self.workers = Gauge("crescent_workers", "live workers", ["role"], registry=r)
        self.typical_decode = Gauge("crescent_conductor_typical_decode_seconds",
                                    "typical decode time the admission predicts with",
                                    registry=r)
        self.in_flight = Gauge("crescent_conductor_in_flight", "admitted, unfinished",
                               registry=r)

    def serve(self, port: int, host: str) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def update_gauges(self, registry, tracker) -> None:  # noqa: ANN001 (avoid import cycle)
        for role in ("prefill", "decode"):
            self.workers.labels(role=role).set(len(registry.by_role(role)))
        self.in_flight.set(len(tracker.requests))
