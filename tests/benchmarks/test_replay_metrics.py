"""The live replay benchmark's pure parts, against hand-computed values."""
from __future__ import annotations

import math
import random

import pytest

from benchmarks.replay_metrics import (
    RequestResult, conversation_slice, goodput, metric_totals, parse_record, percentile,
    poisson_arrivals_ms, ratio, scale_trace, scaled_input_length, slice_stats,
    stretched_arrivals_ms, summarize, top_self_functions,
)


def row(first: int, *rest: int, t: int = 0, length: int = 0, out: int = 10) -> dict:
    ids = [first, *rest]
    return {"timestamp": t, "input_length": length or 512 * len(ids), "output_length": out,
            "hash_ids": ids}


# --------------------------------------------------------------------------- trace
@pytest.mark.parametrize("length,blocks,expected", [
    (40160, 79, 1255),   # 40160 / 32 = 1255 exactly
    (513, 2, 17),        # 16.03 rounds to 16, but 2 blocks need >= 17 tokens
    (1024, 2, 32),       # two full blocks
    (1, 1, 1),           # never empty
    (520, 2, 17),        # 16.25 -> 16 -> clamped up to 17
    (1000, 2, 31),       # 31.25 -> 31
])
def test_scaled_input_length_keeps_blocks_consistent(length, blocks, expected) -> None:
    got = scaled_input_length(length, blocks, 16)
    assert got == expected
    assert math.ceil(got / 16) == blocks


def test_scaled_input_length_needs_a_block() -> None:
    with pytest.raises(ValueError):
        scaled_input_length(100, 0, 16)


def test_conversation_slice_takes_whole_conversations_in_trace_order() -> None:
    rows = [row(1, 2), row(5), row(1, 2, 3), row(7), row(5, 6), row(8)]
    # conversation 1 = rows 0, 2; conversation 5 = rows 1, 4; then 7 = row 3
    assert conversation_slice(rows, 2) == [rows[0], rows[2]]
    assert conversation_slice(rows, 3) == [rows[0], rows[1], rows[2]]
    assert conversation_slice(rows, 4) == [rows[0], rows[1], rows[2], rows[4]]
    assert conversation_slice(rows, 5) == rows[:5]
    assert conversation_slice(rows, 99) == rows
    with pytest.raises(ValueError):
        conversation_slice(rows, 0)


def test_poisson_arrivals_are_seeded_exponential_gaps() -> None:
    rng = random.Random(0)
    g1, g2 = rng.expovariate(2.0), rng.expovariate(2.0)
    assert poisson_arrivals_ms(3, 2.0, 0) == [0, round(g1 * 1000), round((g1 + g2) * 1000)]
    assert poisson_arrivals_ms(3, 2.0, 0) == [0, 930, 1640]
    with pytest.raises(ValueError):
        poisson_arrivals_ms(3, 0.0, 0)


def test_stretched_arrivals_span_n_minus_one_over_rate() -> None:
    assert stretched_arrivals_ms([1000, 1500, 3000], 1.0) == [0, 500, 2000]
    assert stretched_arrivals_ms([1000, 1500, 3000], 2.0) == [0, 250, 1000]
    assert stretched_arrivals_ms([7, 7], 1.0) == [0, 0]


def test_scale_trace_scales_lengths_caps_output_keeps_hash_ids() -> None:
    rows = [row(*range(79), length=40160, out=100, t=5),
            row(100, length=300, out=0, t=9)]
    out = scale_trace(rows, 2.0, seed=0, max_output=80, arrivals="trace")
    assert out == [
        {"timestamp": 0, "input_length": 1255, "output_length": 80, "hash_ids": list(range(79))},
        {"timestamp": 500, "input_length": 9, "output_length": 1, "hash_ids": [100]},
    ]
    assert [r["timestamp"] for r in scale_trace(rows, 2.0, 0)] == [0, 930]
    with pytest.raises(ValueError):
        scale_trace(rows, 2.0, 0, arrivals="bursty")


def test_slice_stats_counts_blocks_seen_earlier() -> None:
    rows = [row(1, 2, t=0, out=10), row(1, 3, t=1000, out=20), row(1, 2, 4, t=3000, out=30)]
    stats = slice_stats(rows)
    assert stats == {"requests": 3, "mean_input": 512 * 7 / 3, "mean_output": 20.0,
                     "block_reuse": 3 / 7, "duration_s": 3.0}


# --------------------------------------------------------------------------- metrics
def test_percentile_is_linear_between_order_statistics() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_tbt_is_mean_of_longest_tenth_of_gaps_at_least_one() -> None:
    assert RequestResult(ttft_s=0.1, gaps_s=(0.1,) * 9 + (1.0,)).tbt_s == 1.0
    # 11 gaps: ceil(1.1) = 2 longest, (1.0 + 0.5) / 2
    assert RequestResult(ttft_s=0.1, gaps_s=(0.1,) * 9 + (1.0, 0.5)).tbt_s == 0.75
    assert RequestResult(ttft_s=0.1, gaps_s=(0.3, 0.2)).tbt_s == 0.3
    assert RequestResult(ttft_s=0.1).tbt_s == 0.0


def test_goodput_needs_success_and_both_slos_inclusive() -> None:
    results = [
        RequestResult(ttft_s=1.0, gaps_s=(0.05, 0.1)),   # in
        RequestResult(ttft_s=2.0, gaps_s=(0.2,)),        # in: both bounds inclusive
        RequestResult(ttft_s=2.5, gaps_s=(0.05,)),       # TTFT too slow
        RequestResult(ttft_s=1.0, gaps_s=(0.05, 0.3)),   # TBT too slow
        RequestResult(error_code=429, error="slo"),      # rejected
    ]
    assert goodput(results, 2.0, 0.2) == 2
    assert goodput(results, 3.0, 0.5) == 4


def test_parse_record_success_and_error() -> None:
    ok = parse_record({"metadata": {}, "metrics": {
        "time_to_first_token": {"value": 250.0, "unit": "ms"},
        "request_latency": {"value": 1250.0, "unit": "ms"},
        "inter_token_latency": {"value": 100.0, "unit": "ms"},
        "inter_chunk_latency": {"value": [50.0, 150.0], "unit": "ms"},
        "output_token_count": {"value": 3, "unit": "tokens"}}})
    assert ok == RequestResult(ttft_s=0.25, e2e_s=1.25, itl_s=0.1, gaps_s=(0.05, 0.15),
                               output_tokens=3)
    assert ok.ok and ok.tbt_s == 0.15
    err = parse_record({"metadata": {}, "metrics": {"error_isl": {"value": 5}},
                        "error": {"code": 429, "type": "Too Many Requests", "message": "m"}})
    assert err == RequestResult(error_code=429, error="Too Many Requests")
    assert not err.ok
    timeout = parse_record({"metrics": {}, "error": {"code": None, "message": "took long"}})
    assert timeout.error_code == -1 and timeout.error == "took long"
    with pytest.raises(ValueError):
        parse_record({"metrics": {"request_latency": {"value": 1, "unit": "fortnights"}}})


def test_summarize_counts_and_percentiles() -> None:
    results = [
        RequestResult(ttft_s=1.0, e2e_s=2.0, itl_s=0.1, gaps_s=(0.1,), output_tokens=2),
        RequestResult(ttft_s=3.0, e2e_s=4.0, itl_s=0.3, gaps_s=(0.3,), output_tokens=4),
        RequestResult(error_code=429, error="slo"),
        RequestResult(error_code=500, error="boom"),
        RequestResult(error_code=-1, error="missing from AIPerf export"),
    ]
    s = summarize(results, ttft_slo_s=2.0, tbt_slo_s=0.2).to_dict()
    assert (s["requests"], s["completed"], s["rejected_429"], s["errors"], s["goodput"]) == \
        (5, 2, 1, 2, 1)
    assert s["ttft_p50_s"] == 2.0 and s["ttft_p90_s"] == pytest.approx(2.8)
    assert s["e2e_p99_s"] == pytest.approx(3.98)
    assert s["tbt_p50_s"] == pytest.approx(0.2)
    assert s["itl_mean_s"] == pytest.approx(0.2)
    assert s["output_tokens_mean"] == 3.0
    assert s["error_kinds"] == {"429": 1, "500": 1, "missing from AIPerf export": 1}
    empty = summarize([], 2.0, 0.2).to_dict()
    assert empty["ttft_p50_s"] is None and empty["itl_mean_s"] is None


def test_metric_totals_sums_label_sets_and_skips_comments() -> None:
    text = ("# HELP x\n# TYPE x counter\n"
            'crescent_router_requests_total{endpoint="/v1",status="200"} 4.0\n'
            'crescent_router_requests_total{endpoint="/v1",status="429"} 1.0\n'
            "crescent_router_prompt_tokens_total 4267.0\n"
            "garbage line\n")
    assert metric_totals(text) == {"crescent_router_requests_total": 5.0,
                                   "crescent_router_prompt_tokens_total": 4267.0}
    assert ratio(48.0, 4800.0) == 0.01
    assert ratio(None, 1.0) is None and ratio(1.0, 0.0) is None


def test_top_self_functions_merges_lines_and_finds_own_frames() -> None:
    collapsed = ("MainThread;a (x.py:1);b (x.py:2) 3\n"
                 "MainThread;a (x.py:1);b (x.py:5) 1\n"
                 "MainThread;a (/repo/y.py:1);c (/repo/y.py:9);d (torch/f.py:3) 4\n")
    assert top_self_functions(collapsed) == [("b (x.py)", 0.5), ("d (torch/f.py)", 0.5)]
    assert top_self_functions(collapsed, k=1) == [("b (x.py)", 0.5)]
    assert top_self_functions(collapsed, within=("/repo/",)) == [
        ("(elsewhere)", 0.5), ("c (/repo/y.py)", 0.5)]
    assert top_self_functions(collapsed, within=("/repo/", "(x.py")) == [
        ("b (x.py)", 0.5), ("c (/repo/y.py)", 0.5)]


def test_prediction_errors_from_debug_ttft() -> None:
    import json

    from benchmarks.replay_metrics import prediction_errors
    body = json.dumps({"summary": {"count": 3, "median_rel_error": -0.1,
                                   "median_abs_rel_error": 0.2, "p90_abs_rel_error": 0.6,
                                   "within_25pct": 0.5}})
    assert prediction_errors(body) == {"pred_median_rel_err": -0.1,
                                       "pred_median_abs_rel_err": 0.2,
                                       "pred_p90_abs_rel_err": 0.6, "pred_within_25pct": 0.5}
    assert set(prediction_errors("not json").values()) == {None}
