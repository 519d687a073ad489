"""SLO admission: TTFT/TBT rejection, plain vs prediction-based early rejection."""
from __future__ import annotations

import pytest

from common.scheduling import (
    DecodeInstanceState,
    DecodeSlot,
    Rejection,
    RequestInfo,
    ScheduleDecision,
    SchedulerConfig,
    make_scheduler,
    predicted_load,
)
from common.scheduling.decode_time import DecodeDurations
from tests_sched_helpers import BLOCK, cost, decode, prefill

REQ = RequestInfo("r", block_keys=list(range(10)), prompt_tokens=1000, kv_tokens=1100)


def sched(admission: str, **kw):
    cfg = SchedulerConfig(kvcache_balancing_threshold=2.0, ttft_slo_s=kw.pop("ttft", None),
                          tbt_slo_s=kw.pop("tbt", None), admission=admission,
                          block_size=BLOCK, expected_decode_s=5.0, **kw)
    return make_scheduler("kvcache_centric", cfg, cost())


def rejected(d: ScheduleDecision) -> Rejection:
    """The policy's rejection of a decision that placed nothing."""
    assert not d.accepted and (d.prefill_id, d.decode_id) == (None, None)
    assert d.rejection is not None
    return d.rejection


# Decode rejections retry after half the typical decode time (expected_decode_s = 5 s).
FULL = Rejection("decode_full", 2.5, "no decode instance has room for 1100 tokens "
                 "(prompt + max_tokens)")


def test_ttft_slo_rejects_with_retry_after() -> None:
    d = sched("none", ttft=2.0).schedule(REQ, [prefill("A", 4.0, 0)], [decode("d0")], 0, 0.0)
    assert rejected(d) == Rejection("ttft_slo", 3.0, "predicted TTFT 5.00 s exceeds the 2 s SLO")
    assert d.predicted_ttft_s == pytest.approx(5.0)


def test_ttft_slo_met_is_accepted() -> None:
    d = sched("none", ttft=6.0).schedule(REQ, [prefill("A", 4.0, 0)], [decode("d0")], 0, 0.0)
    assert d.accepted and d.rejection is None


def test_tbt_slo_rejects_only_when_admission_checks_decode() -> None:
    busy = [decode("d0", batch=100, ctx=10_000)]  # TBT = 0.01 + 0.101 + 0.011 = 0.122 s
    early = sched("early", tbt=0.1).schedule(REQ, [prefill("A", 0.0, 0)], busy, 0, 0.0)
    assert rejected(early) == Rejection("tbt_slo", 2.5,
                                        "predicted TBT 122 ms exceeds the 100 ms SLO")
    assert early.predicted_tbt_s == pytest.approx(0.122)
    none = sched("none", tbt=0.1).schedule(REQ, [prefill("A", 0.0, 0)], busy, 0, 0.0)
    assert none.accepted and none.decode_id == "d0"


def test_full_decode_rejected_early_but_not_by_baseline() -> None:
    full = [decode("d0", batch=3, ctx=5_000, free_blocks=2)]
    early = sched("early").schedule(REQ, [prefill("A", 0.0, 0)], full, 0, 0.0)
    assert rejected(early) == FULL
    assert sched("none").schedule(REQ, [prefill("A", 0.0, 0)], full, 0, 0.0).accepted


def _full_now_free_later() -> DecodeInstanceState:
    # 6,000 tokens of capacity, all held by two requests that started decoding at t=0 and
    # (typical decode time 5 s) will have left when this request's prefill ends at t=9.
    return DecodeInstanceState("d0", batch_size=2, total_context_tokens=6000, free_blocks=0,
                               block_size=BLOCK, running=[DecodeSlot(0.0, 3000), DecodeSlot(0.0, 3000)])


def test_predicted_admits_when_decode_drains_before_prefill_ends() -> None:
    ps = [prefill("A", 8.0, 0)]  # TTFT = 9 s
    early = sched("early").schedule(REQ, ps, [_full_now_free_later()], 0, now=2.0)
    assert rejected(early) == FULL
    pred = sched("predicted").schedule(REQ, ps, [_full_now_free_later()], 0, now=2.0)
    assert pred.accepted and pred.decode_id == "d0"
    assert pred.predicted_tbt_s == pytest.approx(0.01 + 0.001 + 0.001)


def test_predicted_rejects_when_incoming_fills_decode() -> None:
    # Free now (5,000 tokens), but two requests finishing prefill at t=1 and t=3 will hold
    # 4,500 of them when this request's prefill ends at t=4.
    d = DecodeInstanceState("d0", 0, 0, free_blocks=50, block_size=BLOCK,
                            incoming=[DecodeSlot(1.0, 2500), DecodeSlot(3.0, 2000)])
    ps = [prefill("A", 3.0, 0)]
    assert sched("early").schedule(REQ, ps, [d], 0, now=0.0).accepted
    pred = sched("predicted").schedule(REQ, ps, [d], 0, now=0.0)
    assert rejected(pred) == FULL


def test_predicted_load_counts_joins_and_leaves() -> None:
    d = DecodeInstanceState("d0", 2, 700, free_blocks=10, block_size=BLOCK,
                            running=[DecodeSlot(0.0, 300), DecodeSlot(4.0, 400)],
                            incoming=[DecodeSlot(6.0, 50), DecodeSlot(9.0, 60)])
    # The paper's rule before any history: every decode lasts the typical 5 s.
    load = predicted_load(d, at_s=7.0, now_s=4.0, durations=DecodeDurations(prior_s=5.0))
    assert (load.batch_size, load.context_tokens, load.capacity_tokens) == (2, 450, 1700)


def test_predicted_load_weights_slots_by_their_survival() -> None:
    # History: decodes of 2, 4, 6 and 8 s. At now=10 a request that joined at 6 has run 4 s
    # (survivors: 6 and 8 s, 2 of 4); 3 s later it is still running with P(D > 7 | D > 4)
    # = 1/2. One incoming at 11 survives 2 s with P(D > 2) = 3/4 (D = 2 is not > 2).
    hist = DecodeDurations(prior_s=5.0, min_samples=4)
    for seconds in (2.0, 4.0, 6.0, 8.0):
        hist.observe(seconds)
    d = DecodeInstanceState("d0", 1, 100, free_blocks=10, block_size=BLOCK,
                            running=[DecodeSlot(6.0, 100)], incoming=[DecodeSlot(11.0, 40)])
    load = predicted_load(d, at_s=13.0, now_s=10.0, durations=hist)
    assert load.batch_size == pytest.approx(0.5 + 0.75)
    assert load.context_tokens == pytest.approx(50 + 30)
    # A slot whose own duration is known is counted exactly.
    d.incoming = [DecodeSlot(11.0, 40, decode_s=1.5)]
    assert predicted_load(d, 13.0, 10.0, hist).batch_size == pytest.approx(0.5)


def test_no_instances_rejected() -> None:
    d = sched("none").schedule(REQ, [], [decode("d0")], 0, 0.0)
    assert rejected(d) == Rejection("no_instances", 1.0, "no prefill or decode instance")


def test_max_batch_bounds_the_decode_instance() -> None:
    seats = DecodeInstanceState("d0", batch_size=2, total_context_tokens=10, free_blocks=1000,
                                block_size=BLOCK, max_batch=2)
    early = sched("early").schedule(REQ, [prefill("A", 0.0, 0)], [seats], 0, 0.0)
    assert rejected(early) == FULL
    # Predicted: both seats are free again when this prefill ends (typical decode time 5 s).
    seats.running = [DecodeSlot(0.0, 5), DecodeSlot(0.0, 5)]
    pred = sched("predicted").schedule(REQ, [prefill("A", 8.0, 0)], [seats], 0, now=0.0)
    assert pred.accepted


@pytest.mark.parametrize("observed_s, retry_s", [(12.0, 6.0), (1.0, 1.0)])
def test_decode_rejections_retry_after_half_the_observed_decode(observed_s: float,
                                                                retry_s: float) -> None:
    policy = sched("early", tbt=0.1)
    for _ in range(policy.decode_durations.min_samples):  # enough history to replace the prior
        policy.observe_decode(observed_s)
    busy = [decode("d0", batch=100, ctx=10_000)]
    d = policy.schedule(REQ, [prefill("A", 0.0, 0)], busy, 0, 0.0)
    assert rejected(d).retry_after_s == retry_s  # at least 1 s


@pytest.mark.parametrize("reason, retry", [("slo_violation", 1.0), ("ttft_slo", 0.0),
                                           ("tbt_slo", float("inf"))])
def test_impossible_rejections_cannot_be_built(reason: str, retry: float) -> None:
    with pytest.raises(ValueError):
        Rejection(reason, retry)


def test_a_requests_choices_join_the_batch_as_sequences() -> None:
    """n choices decode as n sequences, each attending to the prompt: the predicted TBT
    adds n to the batch and n prompts to the context, and a batch cap must seat all n."""
    busy = [decode("d0", batch=100, ctx=10_000)]
    four = RequestInfo("r", list(range(10)), prompt_tokens=1000, kv_tokens=1400, sequences=4)
    one = sched("early", tbt=1.0).schedule(REQ, [prefill("A", 0.0, 0)], busy, 0, 0.0)
    assert one.predicted_tbt_s == pytest.approx(0.01 + 0.101 + 0.011)
    d = sched("early", tbt=0.125).schedule(four, [prefill("A", 0.0, 0)], busy, 0, 0.0)
    assert d.predicted_tbt_s == pytest.approx(0.01 + 0.104 + 0.014)  # batch 104, 14k tokens
    assert rejected(d) == Rejection("tbt_slo", 2.5,
                                    "predicted TBT 128 ms exceeds the 125 ms SLO")
    capped = DecodeInstanceState("d0", 6, 0, 1000, BLOCK, max_batch=8)
    assert sched("early").schedule(REQ, [prefill("A", 0.0, 0)], [capped], 0, 0.0).accepted
    assert rejected(sched("early").schedule(four, [prefill("A", 0.0, 0)], [capped], 0,
                                            0.0)).reason == "decode_full"


def test_predicted_load_counts_each_slots_sequences() -> None:
    state = DecodeInstanceState("d0", 0, 0, 1000, BLOCK,
                                running=[DecodeSlot(0.0, 100, decode_s=50.0, sequences=3)],
                                incoming=[DecodeSlot(1.0, 200, decode_s=50.0)])
    load = predicted_load(state, at_s=2.0, now_s=0.0, durations=DecodeDurations(5.0))
    assert (load.batch_size, load.context_tokens) == (4.0, 300.0)
