"""Conductor metrics (prometheus-client), served on its own port with ``/debug/ttft``."""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from services.conductor.ttft_log import TTFTLog, TTFTRecord

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
        self.reruns = Counter("crescent_conductor_reruns",
                              "requests re-run after their prefill worker was lost", registry=r)
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
        self.ttft_rel_error = Histogram(
            "crescent_conductor_ttft_rel_error", "(predicted − actual) / actual prefill TTFT",
            buckets=(-0.9, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2, 5), registry=r)
        self.prefill_compute = Histogram(
            "crescent_prefill_compute_seconds", "a prompt's share of prefill compute (every "
            "stage of its group)", ["instance"], buckets=_TTFT_BUCKETS, registry=r)
        self.prefill_transfer_wait = Histogram(
            "crescent_prefill_transfer_wait_seconds", "time a prefill was blocked on transfers "
            "(store loads, the next pipeline stage, the last KV writes)", ["instance"],
            buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10), registry=r)
        self.prefill_admission = Histogram(
            "crescent_prefill_admission_seconds", "a prompt's admission on its prefill worker "
            "(store lookups, blocks, a whole-block store read)", ["instance"],
            buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10), registry=r)
        self.ttft_log = TTFTLog()
        self.prompt_tokens = Counter("crescent_prompt_tokens", "prompt tokens prefilled",
                                     registry=r)
        self.cached_tokens = Counter("crescent_cached_tokens",
                                     "prompt tokens reused from a cache", registry=r)
        self.global_hit_tokens = Counter("crescent_global_cache_hit_tokens",
                                         "prompt tokens loaded from the KV pool", registry=r)
        self.transfer_bytes = Counter("crescent_conductor_kv_transfer_bytes",
                                      "KV bytes moved prefill → decode", registry=r)
        self.transfer_seconds = Histogram(
            "crescent_conductor_kv_transfer_seconds", "time one request's KV stream was in "
            "flight prefill → decode (overlaps compute)", buckets=_TTFT_BUCKETS, registry=r)
        self.store_read_bandwidth = Gauge(
            "crescent_conductor_store_read_bytes_per_s", "the store's read bandwidth learned "
            "from prefills' loads (what a prefix fetch is priced at, unless "
            "transfer_bandwidth_bytes_per_s pins it)", registry=r)
        self.cost_refits = Counter("crescent_conductor_cost_refits", "cost correction "
                                   "(prefill overhead and scale, decode scale) refitted online", registry=r)
        self.workers = Gauge("crescent_workers", "live workers", ["role"], registry=r)
        self.typical_decode = Gauge("crescent_conductor_typical_decode_seconds",
                                    "typical decode time the admission predicts with",
                                    registry=r)
        self.in_flight = Gauge("crescent_conductor_in_flight", "admitted, unfinished",
                               registry=r)
        self.kv_resyncs = Counter("crescent_conductor_kv_resyncs",
                                  "KVResync asks sent to workers (their KV events had a gap)",
                                  registry=r)
        self.global_index_keys = Gauge("crescent_conductor_global_index_keys",
                                       "keys in the global prefix index (the store's)",
                                       registry=r)
        # Workers have no HTTP endpoint: what they report in heartbeats is served here.
        self.worker_dropped = Gauge(
            "crescent_worker_dropped", "messages a worker incarnation dropped or gave up on "
            "(stale fences/epochs, full outboxes, expired quarantines, failed store loads "
            "computed instead), cumulative",
            ["instance", "reason"], registry=r)
        self.worker_kv_blocks = Gauge(
            "crescent_worker_kv_blocks", "a worker's KV blocks by state (used, free), as of "
            "its last heartbeat", ["instance", "state"], registry=r)
        self.kv_instances: set[str] = set()  # the instances worker_kv_blocks has series of
        self.worker_kv_bytes = Gauge(
            "crescent_worker_kv_bytes", "KV bytes a worker incarnation moved, cumulative, by "
            "flow (decode, hidden, store_read, store_write) and path (shm, transfer_engine)",
            ["instance", "flow", "path"], registry=r)
        self.worker_quarantined = Gauge(
            "crescent_worker_quarantined", "decode reservations held until their writer's word",
            ["instance"], registry=r)

    def observe_worker(self, instance_id: str, dropped: dict[str, int],
                       quarantined: int, kv_bytes: dict[str, int]) -> None:
        for reason, n in dropped.items():
            self.worker_dropped.labels(instance=instance_id, reason=reason).set(n)
        for flow_path, n in kv_bytes.items():
            flow, _, path = flow_path.partition("/")
            self.worker_kv_bytes.labels(instance=instance_id, flow=flow, path=path).set(n)
        self.worker_quarantined.labels(instance=instance_id).set(quarantined)

    def observe_ttft(self, rec: TTFTRecord) -> None:
        """One request's predicted vs actual (accept → KV on decode) TTFT."""
        self.actual_ttft.observe(rec.actual_prefill_ttft_s)
        self.ttft_error.observe(rec.actual_prefill_ttft_s - rec.predicted_ttft_s)
        if rec.rel_error is not None:
            self.ttft_rel_error.observe(rec.rel_error)
        self.ttft_log.record(rec)

    def serve(self, port: int, host: str) -> ThreadingWSGIServer:
        """Prometheus text on every path but ``/debug/ttft`` (JSON), in a daemon thread.
        Port 0 picks a free port (``server.server_port``)."""
        server = make_server(host, port, self.wsgi_app(), ThreadingWSGIServer,
                             handler_class=_QuietHandler)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        return server

    def wsgi_app(self) -> Callable[[dict, Callable], Iterable[bytes]]:
        metrics = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
            if environ.get("PATH_INFO") != "/debug/ttft":
                return metrics(environ, start_response)
            body = orjson.dumps(self.ttft_log.snapshot())
            start_response("200 OK", [("Content-Type", "application/json"),
                                      ("Content-Length", str(len(body)))])
            return [body]

        return app

    def update_gauges(self, registry, tracker) -> None:  # noqa: ANN001 (avoid import cycle)
        for role in ("prefill", "decode"):
            self.workers.labels(role=role).set(len(registry.by_role(role)))
        self.in_flight.set(len(tracker.requests))
        live = {w.instance_id: w for w in registry.status()}
        for gone in self.kv_instances - set(live):  # a worker gone leaves no series behind
            for state in ("used", "free"):
                self.worker_kv_blocks.remove(gone, state)
        for instance, w in live.items():
            self.worker_kv_blocks.labels(instance, "used").set(w.used_blocks)
            self.worker_kv_blocks.labels(instance, "free").set(w.free_blocks)
        self.kv_instances = set(live)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # one line per scrape would drown the conductor's log
