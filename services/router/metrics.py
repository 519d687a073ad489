"""Prometheus metrics of the router, in one registry per router (tests run several)."""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            120.0, 300.0)
_TOKEN_GAP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class RouterMetrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # ``model``: the served name a request asked for (the model's or a LoRA adapter's;
        # "" for one refused before its body was valid)
        self.requests = Counter("crescent_router_requests", "Finished HTTP generation "
                                "requests", ["endpoint", "status", "model"], registry=r)
        self.in_flight = Gauge("crescent_router_requests_in_flight",
                               "Generation requests being served", registry=r)
        self.resumed = Counter("crescent_router_resumed", "Streams that went on with a "
                               "continuation after their decode worker was lost", registry=r)
        self.ttft = Histogram("crescent_router_time_to_first_token_seconds",
                              "Arrival to first token", ["model"], buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("crescent_router_inter_token_latency_seconds",
                             "Gap between consecutive output tokens", buckets=_TOKEN_GAP,
                             registry=r)
        self.queue_time = Histogram("crescent_router_queue_time_seconds",
                                    "Arrival to acceptance by the conductor",
                                    buckets=_LATENCY, registry=r)
        self.e2e = Histogram("crescent_router_e2e_latency_seconds",
                             "Arrival to last token", ["model"], buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("crescent_router_prompt_tokens",
                                     "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("crescent_router_cached_prompt_tokens",
                                     "Prompt tokens served from the KV cache", registry=r)
        self.generation_tokens = Counter("crescent_router_generation_tokens",
                                         "Output tokens streamed", registry=r)

    def observe_tokens(self, gap_s: float, n_tokens: int) -> None:
        """A delta of ``n_tokens`` arrived ``gap_s`` after the previous one."""
        if n_tokens <= 0:
            return
        per_token = gap_s / n_tokens
        for _ in range(n_tokens):
            self.itl.observe(per_token)
        self.generation_tokens.inc(n_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
