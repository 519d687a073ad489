"""The dashboard's numbers (``GET /debug/dashboard``), as one JSON-ready dict.

Built from what the router already holds: the conductor's latest ``ClusterStatus``
(workers, the conductor's totals, the store's usage), the router's own metrics (the same
counters ``/metrics`` serves) and its ``RequestLog`` (timelines, rates). docs/dashboard.md
lists every field. Sections the cluster does not report are None, never made up: no
``store`` without a store (or before its master answered), no ``cache``, ``transfer`` or
``admission.conductor`` from a conductor that sends no totals.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

from common.metric_values import by_label, total
from common.status_protocol import ConductorTotals, StoreUsage
from services.router.dashboard_log import RequestLog
from services.router.metrics import RouterMetrics
from services.router.peer_logs import merged
from services.router.state import RouterState


def ratio(part: float, whole: float) -> Optional[float]:
    """``part / whole``, None when there is no whole to speak of."""
    return part / whole if whole > 0 else None


def store_section(store: StoreUsage) -> dict[str, Any]:
    """The pool's usage and its own hit rate: the share of keys asked (``StoreGet``) that
    were found."""
    hits, misses = store.counters.get("hits", 0), store.counters.get("misses", 0)
    return {**asdict(store), "hit_rate": ratio(hits, hits + misses)}


def cache_section(totals: ConductorTotals) -> dict[str, Any]:
    """Prompt tokens served from a cache instead of computed: from the prefill worker's
    own pool (local) or loaded from the store (global), as shares of all prompt tokens."""
    local = max(0, totals.cached_tokens - totals.global_hit_tokens)
    return {"prompt_tokens": totals.prompt_tokens, "local_hit_tokens": local,
            "global_hit_tokens": totals.global_hit_tokens,
            "local_hit_rate": ratio(local, totals.prompt_tokens),
            "global_hit_rate": ratio(totals.global_hit_tokens, totals.prompt_tokens)}


def transfer_section(totals: ConductorTotals, log: RequestLog, now: float) -> dict[str, Any]:
    """KV moved prefill → decode: the conductor's totals, rates over the log's window
    (bandwidth: bytes over the seconds the streams were in flight)."""
    window_bytes = log.kv_bytes.sum(now)
    return {"transfers": totals.transfers, "bytes": totals.transfer_bytes,
            "seconds": totals.transfer_seconds,
            "window_s": log.window_s, "bytes_per_s": window_bytes / log.window_s,
            "bandwidth_bytes_per_s": ratio(window_bytes, log.kv_seconds.sum(now))}


def admission_section(metrics: RouterMetrics, log: RequestLog,
                      totals: Optional[ConductorTotals], now: float) -> dict[str, Any]:
    """What came in and what was turned away: the router's HTTP outcomes of generation
    requests by status (429: refused), the conductor's admissions and refusals by reason,
    and the router's rates over the window."""
    http = {status: int(n) for status, n in
            sorted(by_label(metrics.requests, "status").items())}
    return {"http": http, "rejected_429": http.get("429", 0),
            "in_flight": int(total(metrics.in_flight, "")),
            "admitted_per_s": log.admitted.rate(now),
            "rejected_per_s": log.rejected.rate(now), "window_s": log.window_s,
            "conductor": None if totals is None else {
                "placed": totals.placed, "rejected": totals.rejected,
                "failed": totals.failed}}


def dashboard_data(state: RouterState, now: float,
                   peers: Optional[tuple[dict[str, list], list[str]]] = None) -> dict[str, Any]:
    """Everything the page and ``crescent status`` show; ``now``: wall clock. The workers,
    store, cache and KV figures are the cluster's (the conductor's status); the admission
    rates are this router's own (``router`` of ``routers``), and so is the request log
    unless ``peers`` holds the other routers' (services/router/peer_logs.py: their logs,
    the routers that did not answer): then each request names its router."""
    status = state.status
    totals = status.totals if status else None
    store = status.store if status else None
    return {
        "time": now, "model": state.config.model_name, "ready": state.is_ready(),
        "router": state.name, "routers": state.config.routers,
        "draining": state.draining, "status_age_s": state.status_age(),
        "conductor_epoch": status.conductor_epoch if status else None,
        "workers": [asdict(i) for i in status.instances] if status else [],
        "store": store_section(store) if store else None,
        "cache": cache_section(totals) if totals else None,
        "transfer": transfer_section(totals, state.requests, now) if totals else None,
        "admission": admission_section(state.metrics, state.requests, totals, now),
        "requests": state.requests.timelines() if peers is None else merged(
            state.name, state.requests.timelines(), peers[0], state.requests.keep),
        "routers_silent": [] if peers is None else peers[1],
    }
