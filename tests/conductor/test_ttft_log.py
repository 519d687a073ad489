"""Predicted vs actual TTFT per request: the ring, the relative-error histogram, and the
``/debug/ttft`` JSON served next to the conductor's Prometheus metrics."""
from __future__ import annotations

import httpx
import pytest

from common.config import ClusterConfig, SLOConfig
from common.kv.events import KVEvents
from common.protocol import (
    BlocksReserved, PrefillDone, RegisterWorker, RequestAccepted, SubmitRequest,
    WorkerHeartbeat, WorkerLoad,
)
from common.sampling_params import SamplingParams
from services.conductor.metrics import ConductorMetrics
from services.conductor.service import Conductor
from services.conductor.ttft_log import TTFTLog, TTFTRecord


def rec(i: int, predicted: float, actual: float) -> TTFTRecord:
    return TTFTRecord(f"r{i}", 100.0 + i, predicted, actual, 40, 30)


def test_ring_keeps_the_last_capacity_records_in_order() -> None:
    log = TTFTLog(capacity=3)
    for i in range(5):
        log.record(rec(i, 1.0, 1.0))
    assert [r.request_id for r in log.records()] == ["r2", "r3", "r4"]
    with pytest.raises(ValueError, match="capacity must be positive"):
        TTFTLog(0)


def test_snapshot_summary_exact() -> None:
    log = TTFTLog()
    assert log.snapshot() == {"summary": {"count": 0, "median_rel_error": None,
                                          "median_abs_rel_error": None,
                                          "p90_abs_rel_error": None, "within_25pct": None},
                              "cost": {}, "requests": []}
    # rel errors: -0.5, +0.25, +1.0, and one without an actual (0 s: no error).
    for i, (p, a) in enumerate([(1.0, 2.0), (2.5, 2.0), (4.0, 2.0), (1.0, 0.0)]):
        log.record(rec(i, p, a))
    snap = log.snapshot()
    assert snap["summary"] == {"count": 4, "median_rel_error": 0.25,
                               "median_abs_rel_error": 0.5, "p90_abs_rel_error": 1.0,
                               "within_25pct": 1 / 3}
    assert snap["requests"][0] == {
        "request_id": "r0", "accepted_at": 100.0, "predicted_ttft_s": 1.0,
        "actual_prefill_ttft_s": 2.0, "prompt_tokens": 40, "prefill_tokens": 30,
        "reserve_s": 0.0, "cached_tokens": 0, "compute_s": 0.0, "wait_s": 0.0, "admit_s": 0.0, "rel_error": -0.5}
    assert snap["requests"][3]["rel_error"] is None


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


class Mail:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, address: str, msg: object) -> bool:
        self.sent.append(msg)
        return True


def test_conductor_records_each_request_and_serves_json() -> None:
    clock, mail = Clock(), Mail()
    cfg = ClusterConfig(slo=SLOConfig(ttft_s=1000, tbt_s=1000))
    c = Conductor(cfg, mail, clock=clock)  # type: ignore[arg-type]
    for role in ("prefill", "decode"):
        c.on_register(RegisterWorker(f"{role}-0", role, f"tcp://w/{role}", "h:0", 4096, 1024,
                                     32, 100, 16))
        c.on_heartbeat(WorkerHeartbeat(f"{role}-0", role, WorkerLoad(), 100, 0, 100, KVEvents(), 0))
    c.on_submit(SubmitRequest("r1", list(range(40)), [], SamplingParams(max_tokens=8), 0.0))
    clock.t = 1000.05
    c.on_reserved(BlocksReserved("r1", "decode-0", [1, 2, 3]))
    [accepted] = [m for m in mail.sent if isinstance(m, RequestAccepted)]  # once reserved
    clock.t = 1000.5
    c.on_prefill_done(PrefillDone("r1", "decode-0", 40, 0, 0, 0.4, 1000, 0.01, wait_s=0.02,
                                  admit_s=0.003))
    [r] = c.metrics.ttft_log.records()
    assert r == TTFTRecord("r1", 1000.0, accepted.predicted_ttft_s, 0.5, 40, 40,
                           reserve_s=pytest.approx(0.05), compute_s=0.4, wait_s=0.02,
                           admit_s=0.003)
    assert r.rel_error == pytest.approx((accepted.predicted_ttft_s - 0.5) / 0.5)

    server = c.metrics.serve(0, "127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        body = httpx.get(url + "/debug/ttft", timeout=5).json()
        assert body["summary"]["count"] == 1
        assert body["requests"][0]["request_id"] == "r1"
        assert body["requests"][0]["actual_prefill_ttft_s"] == 0.5
        assert body["cost"]["profile"] == "auto" and body["cost"]["refits"] == 0
        text = httpx.get(url + "/metrics", timeout=5).text
        assert "crescent_conductor_ttft_rel_error_count 1.0" in text
        assert "crescent_conductor_actual_prefill_ttft_seconds_count 1.0" in text
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_app_without_records() -> None:
    m = ConductorMetrics()
    server = m.serve(0, "127.0.0.1")
    try:
        r = httpx.get(f"http://127.0.0.1:{server.server_port}/debug/ttft", timeout=5)
        assert r.headers["content-type"] == "application/json"
        assert r.json()["summary"]["count"] == 0
    finally:
        server.shutdown()
        server.server_close()
