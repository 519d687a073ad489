"""Simulators on hand-built traces with exact outcomes, and the paper's orderings on a subset.

Cost model: prefill 1 ms per new token, a fetched 512-token block 0.1 s, a decode step 10 ms.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from common.scheduling import CostModel, DecodeCoefficients, PrefillCoefficients, SchedulerConfig
from traces.batch import DecodeBatch
from traces.colocated import ColocatedConfig, simulate_colocated
from traces.loader import TraceRequest, load_trace
from traces.metrics import COMPLETED, REJECTED_AFTER_PREFILL, REJECTED_ARRIVAL, tail_tbt
from traces.simulate import main as simulate_main
from traces.simulator import ClusterConfig, simulate_disaggregated

TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "synthetic_trace.jsonl"
COST = CostModel(PrefillCoefficients(c_new=0.001), DecodeCoefficients(d0=0.01), 1000, 5.12e6,
                 kv_capacity_tokens=1_000_000)
FREE = SchedulerConfig(ttft_slo_s=None, tbt_slo_s=None, admission="none")


def req(i: int, t: float, blocks: tuple[int, ...], out: int = 3) -> TraceRequest:
    return TraceRequest(i, t, 512 * len(blocks), out, blocks)


def test_tail_tbt_is_mean_of_longest_tenth() -> None:
    assert tail_tbt([0.1] * 18 + [0.5, 0.3]) == pytest.approx(0.4)
    assert tail_tbt([0.2, 0.1]) == pytest.approx(0.2)
    assert tail_tbt([]) == 0.0


def test_decode_batch_gaps_and_context() -> None:
    b = DecodeBatch()
    b.join(1, prompt_tokens=10, decode_tokens=2, ready_s=0.0)
    assert b.end_step(0.5) == [] and b.context_tokens == 12
    b.join(2, prompt_tokens=5, decode_tokens=1, ready_s=0.6)
    done = b.end_step(1.5)
    assert [(rid, round(tbt, 6)) for rid, tbt in done] == [(1, 1.0), (2, 0.9)]
    assert b.size == 0 and b.context_tokens == 0
    b.check_integrity()


def test_single_request_exact_ttft_and_tbt() -> None:
    res = simulate_disaggregated([req(0, 0.0, (0, 1))], COST, "kvcache_centric", FREE, ClusterConfig(1, 1))
    r = res.records[0]
    assert r.status == COMPLETED
    assert r.ttft_s == pytest.approx(1.024) and r.tbt_s == pytest.approx(0.01)
    assert r.finish_s == pytest.approx(1.044)


def _prefix_trace() -> list[TraceRequest]:
    return [req(0, 0.0, (0, 1, 2)), req(1, 2.0, (0, 1, 3)), req(2, 2.1, (0, 1, 4))]


def test_kvcache_centric_fetches_to_idle_instance() -> None:
    res = simulate_disaggregated(_prefix_trace(), COST, "kvcache_centric", FREE, ClusterConfig(2, 1))
    ttft = [r.ttft_s for r in res.records]
    # B reuses P0's 2 blocks; C would wait 0.412 s on P0, so idle P1 fetches 2 blocks (0.2 s).
    assert ttft == pytest.approx([1.536, 0.512, 0.712])
    assert (res.hits.total_blocks, res.hits.local_blocks, res.hits.fetched_blocks) == (9, 2, 2)


def test_local_cache_aware_waits_for_the_holder() -> None:
    res = simulate_disaggregated(_prefix_trace(), COST, "local_cache_aware", FREE, ClusterConfig(2, 1))
    assert [r.ttft_s for r in res.records] == pytest.approx([1.536, 0.512, 0.924])
    assert (res.hits.local_blocks, res.hits.fetched_blocks) == (4, 0)


def _decode_tight() -> tuple[list[TraceRequest], ClusterConfig]:
    trace = [req(0, 0.0, (0, 1), out=100), req(1, 0.1, (5, 6))]
    return trace, ClusterConfig(2, 1, decode_capacity_tokens=2048)


@pytest.mark.parametrize("admission,status", [
    ("none", REJECTED_AFTER_PREFILL),     # decode full when its prefill ends
    ("early", REJECTED_ARRIVAL),          # request 0's KV is already reserved there
    ("predicted", REJECTED_ARRIVAL),      # request 0 predicted in decode by then
])
def test_decode_overload_by_admission_mode(admission: str, status: str) -> None:
    trace, cluster = _decode_tight()
    cfg = SchedulerConfig(ttft_slo_s=None, tbt_slo_s=None, admission=admission)
    res = simulate_disaggregated(trace, COST, "kvcache_centric", cfg, cluster)
    assert [r.status for r in res.records] == [COMPLETED, status]


@pytest.mark.parametrize("admission,status", [
    ("none", COMPLETED),            # request 0 has left decode when request 1 gets there
    ("early", REJECTED_ARRIVAL),    # both do not fit at once, and both are counted now
    ("predicted", COMPLETED),       # request 0 predicted gone (typical decode 0.5 s) by 1.636 s
])
def test_prediction_admits_what_will_fit_when_prefill_ends(admission: str, status: str) -> None:
    # Decode memory 2,560 tokens; request 0 needs 1,026 and decodes 10 ms from 1.024 s;
    # request 1 needs 1,539 and its 1,536-token prefill ends at 0.1 + 1.536 s.
    trace = [req(0, 0.0, (0, 1), out=2), req(1, 0.1, (5, 6, 7))]
    cfg = SchedulerConfig(ttft_slo_s=None, tbt_slo_s=None, admission=admission,
                          expected_decode_s=0.5)
    res = simulate_disaggregated(trace, COST, "kvcache_centric", cfg,
                                 ClusterConfig(2, 1, decode_capacity_tokens=2560))
    assert [r.status for r in res.records] == [COMPLETED, status]


def test_colocated_chunked_prefill_exact() -> None:
    # 1,024-token prompt in 512-token chunks: two steps of 0.512 s; then 2 decode steps.
    res = simulate_colocated([req(0, 0.0, (0, 1))], COST, "local_cache_aware", FREE,
                             ColocatedConfig(num_instances=1, chunk_tokens=512))
    r = res.records[0]
    assert r.ttft_s == pytest.approx(1.024) and r.tbt_s == pytest.approx(0.01)


def test_colocated_decode_slowed_by_riding_chunk() -> None:
    trace = [req(0, 0.0, (0,), out=4), req(1, 0.52, (1, 2))]
    res = simulate_colocated(trace, COST, "round_robin", FREE, ColocatedConfig(1, chunk_tokens=512))
    # Request 0 decodes from 0.512; steps 2..3 carry 511 prefill tokens of request 1.
    assert res.records[0].tbt_s == pytest.approx(0.01 + 0.511)


@pytest.mark.skipif(not TRACE.exists(), reason="shared synthetic trace absent")
def test_paper_orderings_on_subset() -> None:
    trace = load_trace(TRACE, limit=1200)
    cost = CostModel.profile("llama3-70b-8xa800")
    ttft = {}
    for name in ("random", "load_balance", "local_cache_aware", "kvcache_centric"):
        res = simulate_disaggregated(trace, cost, name, FREE, ClusterConfig(6, 2))
        s = res.summary(30.0, 0.1)
        ttft[name] = s["ttft_mean"]
        if name == "kvcache_centric":
            assert s["hit_global"] > s["hit_local"]
    assert ttft["random"] > ttft["load_balance"] > ttft["local_cache_aware"] > ttft["kvcache_centric"]


@pytest.mark.skipif(not TRACE.exists(), reason="shared synthetic trace absent")
def test_cli_main(tmp_path, capsys) -> None:
    rc = simulate_main(["--trace", str(TRACE), "--limit", "100", "--json",
                        "--plot-dir", str(tmp_path)])
    assert rc == 0
    assert '"requests": 100.0' in capsys.readouterr().out
    assert len(list(tmp_path.glob("*.png"))) == 2
    rc = simulate_main(["--trace", str(TRACE), "--limit", "100", "--json", "--admission",
                        "predicted", "--decode-slowdown", "4.75", "--decode-time", "mean"])
    assert rc == 0
    assert '"name": "disagg/kvcache_centric/predicted"' in capsys.readouterr().out


def test_decode_choice_counts_requests_still_in_prefill() -> None:
    # One decode seat per instance. Request 0 is assigned to D0 while still in prefill, so
    # request 1 goes to D1 (no herding onto the instance that merely looks idle).
    trace = [req(0, 0.0, (0,), out=200), req(1, 0.1, (1,), out=200)]
    for handoff in ("assigned", "any"):
        res = simulate_disaggregated(trace, COST, "kvcache_centric", FREE, ClusterConfig(
            num_prefill=2, num_decode=2, decode_max_batch=1, decode_handoff=handoff))
        assert [r.status for r in res.records] == [COMPLETED, COMPLETED]
        assert res.records[1].tbt_s == pytest.approx(0.01)   # alone in its batch


def test_wasted_prefill_delays_the_next_request() -> None:
    # One prefill instance and one decode seat: request 1 is prefilled, then rejected
    # (seat taken), and request 2 waits behind its wasted prefill.
    trace = [req(0, 0.0, (0,), out=500), req(1, 0.0, (1, 2)), req(2, 0.0, (3,))]
    res = simulate_disaggregated(trace, COST, "kvcache_centric", FREE,
                                 ClusterConfig(1, 1, decode_max_batch=1))
    assert [r.status for r in res.records] == [COMPLETED, REJECTED_AFTER_PREFILL, REJECTED_AFTER_PREFILL]
    assert res.records[2].ttft_s == pytest.approx(0.512 + 1.024 + 0.512)


def test_decode_durations_are_learned_from_completed_decodes() -> None:
    from traces.simulator import DisaggregatedSim
    trace = [req(0, 0.0, (0,), out=11), req(1, 0.0, (1,), out=31)]
    cfg = SchedulerConfig(ttft_slo_s=None, tbt_slo_s=None, admission="predicted", expected_decode_s=99.0)
    sim = DisaggregatedSim(trace, COST, "kvcache_centric", cfg, ClusterConfig(2, 1))
    sim.run()
    # Both reach decode at 0.512 s; request 0 steps at once (10 x 10 ms = 0.1 s), request 1
    # joins the next step (0.01 + 30 x 10 ms = 0.31 s). Too few to replace the prior yet.
    hist = sim.scheduler.decode_durations
    assert hist.samples == 2 and hist._sorted == pytest.approx([0.1, 0.31])
    assert hist.mean() == 99.0
    fixed = DisaggregatedSim(trace, COST, "kvcache_centric", cfg, ClusterConfig(2, 1),
                             decode_time="fixed")
    fixed.run()
    assert fixed.scheduler.decode_durations.samples == 0


def test_find_capacity_bisects_to_the_threshold_edge() -> None:
    from traces.capacity import find_capacity
    # Attainment falls linearly: 1.0 at speed 0 to 0.0 at speed 10 (0.9 at 1) for SLO a;
    # SLO b twice as tolerant.
    res = find_capacity(lambda s: {"a": 1 - s / 10, "b": 1 - s / 20}, ["a", "b"],
                        threshold=0.9, start=1.0, rel_tol=0.01)
    assert res.capacity["a"] == pytest.approx(1.0, rel=0.02)
    assert res.capacity["b"] == pytest.approx(2.0, rel=0.02)
    lo, hi = res.bracket["b"]
    assert lo <= 2.0 <= hi


@pytest.mark.skipif(not TRACE.exists(), reason="shared synthetic trace absent")
def test_overload_rejections_follow_the_papers_order() -> None:
    # benchmarks/simulate_paper.py's headline overload row: 8P + 8D at 2x, decode pool
    # bound by the TBT SLO. Baseline > early rejection > prediction-based.
    from benchmarks.simulate_paper import OVERLOAD_DECODE_SLOWDOWN, OVERLOAD_SPEED
    trace = load_trace(TRACE, speed=OVERLOAD_SPEED)
    cost = CostModel.profile("llama3-70b-8xa800").with_decode_slowdown(OVERLOAD_DECODE_SLOWDOWN)
    rejected = {}
    for mode in ("none", "early", "predicted"):
        cfg = SchedulerConfig(ttft_slo_s=30.0, tbt_slo_s=0.1, admission=mode)
        s = simulate_disaggregated(trace, cost, "kvcache_centric", cfg, ClusterConfig(8, 8)).summary(30.0, 0.1)
        rejected[mode] = s["rejected"]
        if mode == "early":   # counts reservations: nothing is rejected after its prefill
            assert s["rejected_after_prefill"] == 0
    assert rejected["none"] > rejected["early"] > rejected["predicted"]
