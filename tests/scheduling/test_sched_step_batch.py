"""A decode instance that steps at most ``step_batch`` sequences serves a larger batch in
turns: the per-step cost is paid ceil(B / step_batch) times per token, and admission sees it."""
from __future__ import annotations

import pytest

from common.scheduling import (
    CostModel, DecodeCoefficients, DecodeInstanceState, DecodeSlot, PrefillCoefficients,
    RequestInfo, SchedulerConfig, current_load, make_scheduler, predicted_load,
)
from common.scheduling.decode_time import DecodeDurations
from tests_sched_helpers import BLOCK, cost, prefill

REQ = RequestInfo("r", block_keys=list(range(10)), prompt_tokens=1000, kv_tokens=1100)


def test_tbt_in_turns_exact() -> None:
    m = CostModel(PrefillCoefficients(), DecodeCoefficients(d0=0.5, d_batch=0.25, d_ctx=0.125),
                  10, 100.0)
    assert m.decode_tbt_seconds(4, 8) == 0.5 + 1.0 + 1.0
    assert m.decode_tbt_seconds(4, 8, step_batch=4) == 0.5 + 1.0 + 1.0  # fits: one step
    assert m.decode_tbt_seconds(5, 8, step_batch=4) == 2 * 0.5 + 1.25 + 1.0
    assert m.decode_tbt_seconds(9, 8, step_batch=4) == 3 * 0.5 + 2.25 + 1.0
    assert m.decode_tbt_seconds(4.5, 8, step_batch=4) == 2 * 0.5 + 1.125 + 1.0  # expected B


def _sched(admission: str, tbt: float):
    return make_scheduler("kvcache_centric", SchedulerConfig(
        ttft_slo_s=None, tbt_slo_s=tbt, admission=admission, block_size=BLOCK,
        expected_decode_s=5.0), cost())


def test_turns_raise_predicted_tbt_past_the_slo() -> None:
    # Helper cost: d0 = 10 ms, 1 ms per sequence, 1 us per context token. With the request:
    # B = 5, K = 2000. One step: 17 ms. Steps of 2 sequences: 3 turns, 37 ms.
    free = DecodeInstanceState("d0", batch_size=4, total_context_tokens=1000,
                               free_blocks=1000, block_size=BLOCK)
    ok = _sched("early", tbt=0.03).schedule(REQ, [prefill("A", 0.0, 0)], [free], 0, 0.0)
    assert ok.accepted and ok.predicted_tbt_s == pytest.approx(0.017)
    limited = DecodeInstanceState("d0", batch_size=4, total_context_tokens=1000,
                                  free_blocks=1000, block_size=BLOCK, step_batch=2)
    d = _sched("early", tbt=0.03).schedule(REQ, [prefill("A", 0.0, 0)], [limited], 0, 0.0)
    assert d.rejection is not None and d.rejection.reason == "tbt_slo"
    assert d.rejection.detail == "predicted TBT 37 ms exceeds the 30 ms SLO"
    assert d.predicted_tbt_s == pytest.approx(0.037)


def test_decode_choice_prefers_the_instance_without_turns() -> None:
    # d0: B = 5 in steps of 2 → 0.03 + 0.005 + 0.002 = 37 ms.
    # d1: B = 7 in one step  → 0.01 + 0.007 + 0.002 = 19 ms: chosen despite its larger batch.
    d0 = DecodeInstanceState("d0", 4, 1000, 1000, BLOCK, step_batch=2)
    d1 = DecodeInstanceState("d1", 6, 1000, 1000, BLOCK, step_batch=8)
    d = _sched("early", tbt=None).schedule(REQ, [prefill("A", 0.0, 0)], [d0, d1], 0, 0.0)
    assert d.decode_id == "d1" and d.predicted_tbt_s == pytest.approx(0.019)


def test_loads_carry_the_step_batch() -> None:
    state = DecodeInstanceState("d0", 3, 300, 10, BLOCK, step_batch=2,
                                running=[DecodeSlot(0.0, 100)] * 3)
    assert current_load(state).step_batch == 2
    load = predicted_load(state, at_s=1.0, now_s=0.0, durations=DecodeDurations(5.0))
    assert load.step_batch == 2
    # step_batch never rejects by itself (the worker takes turns); max_batch does.
    assert load.fits(100)
