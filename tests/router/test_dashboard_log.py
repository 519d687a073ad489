"""The router's request log for the dashboard: timelines laid end to end, prefill figures
that come after the last token, KV rates from the growth of the conductor's totals,
bounded memory, rates per second over a window."""
from __future__ import annotations

import pytest

from common.protocol import RequestAccepted
from common.status_protocol import ClusterStatus, ConductorTotals, PrefillSummary
from services.router.dashboard_log import RateWindow, RequestLog, Timeline


def report(request_id: str, prefill_s: float = 0.3, wait_s: float = 0.05,
           nbytes: int = 4096, seconds: float = 0.25) -> PrefillSummary:
    return PrefillSummary(request_id, prefill_s, wait_s, seconds, nbytes)


def served(log: RequestLog, rid: str, t0: float = 100.0) -> None:
    """Arrive at t0, accepted +0.01, prefill figures, first token +0.5, last +0.9, done
    +0.95."""
    log.arrived(rid, "/v1/chat/completions", t0)
    log.accepted(RequestAccepted(rid, "prefill-0", "decode-0", 0.2), t0 + 0.01)
    log.prefilled(report(rid))
    log.tokens(rid, 1, t0 + 0.5)
    log.tokens(rid, 3, t0 + 0.9)
    log.finished(rid, 200, (64, 16), t0 + 0.95)


def test_phases_add_up_to_the_request() -> None:
    log = RequestLog()
    served(log, "a")
    [t] = log.timelines()
    assert t["phases"] == pytest.approx({"queued": 0.15, "prefill": 0.3, "transfer": 0.05,
                                         "decode": 0.4})
    assert (t["status"], t["prompt_tokens"], t["cached_tokens"], t["output_tokens"]) == \
        (200, 64, 16, 4)
    assert (t["prefill_id"], t["decode_id"], t["transfer_bytes"]) == \
        ("prefill-0", "decode-0", 4096)
    assert not log.live


def test_compute_longer_than_the_wait_is_clamped() -> None:
    t = Timeline("a", "/v1/completions", 10.0, first_token=10.2, last_token=10.2,
                 ended=10.3, prefill_s=0.5, wait_s=0.1)
    assert t.phases() == {"queued": 0.0, "prefill": pytest.approx(0.2), "transfer": 0.0,
                          "decode": 0.0}


def test_refused_request_is_all_queued() -> None:
    log = RequestLog()
    log.arrived("r", "/v1/completions", 50.0)
    log.finished("r", 429, None, 50.02)
    [t] = log.timelines()
    assert t["status"] == 429 and t["phases"]["queued"] == pytest.approx(0.02)
    assert sum(t["phases"].values()) == pytest.approx(0.02)
    assert log.rejected.sum(50.5) == 1 and log.admitted.sum(50.5) == 0


def test_report_after_the_last_token_still_lands() -> None:
    log = RequestLog()
    log.arrived("a", "/v1/completions", 0.0)
    log.tokens("a", 1, 0.4)
    log.finished("a", 200, (8, 0), 0.41)
    log.prefilled(report("a", prefill_s=0.2, wait_s=0.1))
    assert log.timelines()[0]["phases"] == pytest.approx(
        {"queued": 0.1, "prefill": 0.2, "transfer": 0.1, "decode": 0.0})


def test_unknown_ids_change_nothing() -> None:
    log = RequestLog()
    log.tokens("ghost", 3, 1.0)
    log.accepted(RequestAccepted("ghost", "p", "d", 0.1), 1.0)
    log.finished("ghost", 200, None, 1.0)
    log.prefilled(report("ghost", nbytes=100))
    assert log.timelines() == [] and not log.live and log.admitted.sum(1.0) == 0


def moved(nbytes: int, seconds: float) -> ConductorTotals:
    return ConductorTotals(transfer_bytes=nbytes, transfer_seconds=seconds)


def test_kv_rates_are_what_the_conductors_totals_grew_by() -> None:
    log = RequestLog()
    log.moved(1, moved(1 << 30, 50.0), 10.0)  # the first heard: a baseline only
    assert log.kv_bytes.sum(10.0) == 0 and log.kv_seconds.sum(10.0) == 0
    log.moved(1, moved((1 << 30) + 4096, 50.5), 11.0)
    log.moved(1, moved((1 << 30) + 6144, 50.75), 12.0)
    assert log.kv_bytes.sum(12.0) == 6144 and log.kv_seconds.sum(12.0) == 0.75
    log.moved(2, moved(1000, 0.25), 13.0)  # a new conductor counts from zero
    assert log.kv_bytes.sum(13.0) == 7144 and log.kv_seconds.sum(13.0) == 1.0
    assert log.kv_bytes.sum(30.0) == 0  # out of the window


def test_a_status_fills_timelines_and_rates() -> None:
    log = RequestLog()
    log.arrived("a", "/v1/completions", 0.0)
    log.heard(ClusterStatus(True, [], 1, moved(0, 0.0)), 0.1)
    log.heard(ClusterStatus(True, [], 1, moved(4096, 0.25), None, [report("a")]), 0.2)
    log.tokens("a", 1, 0.4)
    log.finished("a", 200, (8, 0), 0.5)
    [t] = log.timelines()
    assert (t["transfer_bytes"], t["transfer_s"], t["phases"]["prefill"]) == (4096, 0.25, 0.3)
    assert log.kv_bytes.sum(0.5) == 4096
    log.heard(ClusterStatus(True, []), 0.6)  # an old conductor: no totals, no figures
    assert log.kv_bytes.sum(0.6) == 4096


def test_keeps_only_the_last_requests_newest_first() -> None:
    log = RequestLog(keep=3)
    for i in range(5):
        served(log, f"r{i}", t0=float(i))
    assert [t["request_id"] for t in log.timelines()] == ["r4", "r3", "r2"]


def test_rate_window_sums_the_last_seconds_only() -> None:
    w = RateWindow(window_s=10)
    for second in range(30):
        w.add(5.0, second + 0.5)
        w.add(1.0, second + 0.7)
    assert len(w._buckets) == 10  # one per second of the window, no more
    assert w.sum(29.9) == 60.0 and w.rate(29.9) == 6.0
    assert w.sum(35.0) == 24.0  # seconds 26..29 are left
    assert w.sum(100.0) == 0.0 and not w._buckets


def test_a_request_is_shown_with_the_model_it_ran_on() -> None:
    log = RequestLog()
    log.arrived("r", "/v1/completions", 1.0, "sql-lora")
    log.finished("r", 200, (3, 0), 2.0)
    assert [t["model"] for t in log.timelines()] == ["sql-lora"]
