"""Each policy on hand-built situations, with exact expected choices.

Cost model used throughout: prefill = 1 ms per new token; a block is 100 tokens of
1,000 bytes each, bandwidth 10 MB/s, so fetching one block costs 10 ms.
"""
from __future__ import annotations

import random

import pytest

from common.scheduling import RequestInfo, SchedulerConfig, make_scheduler
from tests_sched_helpers import BLOCK, cost, decode, prefill


def config(**kw) -> SchedulerConfig:
    base = dict(kvcache_balancing_threshold=3.0, ttft_slo_s=None, tbt_slo_s=None,
                admission="none", block_size=BLOCK)
    base.update(kw)
    return SchedulerConfig(**base)


REQ = RequestInfo("r1", block_keys=list(range(10)), prompt_tokens=1000, kv_tokens=1100)


def run(name: str, prefills, decodes=None, global_len: int = 0, **kw):
    sched = make_scheduler(name, config(**kw), cost())
    return sched.schedule(REQ, prefills, decodes or [decode("d0")], global_len, now=0.0)


# --- Algorithm 1 and the threshold --------------------------------------------------------
def test_threshold_exceeded_partial_holder_fetches_best_prefix() -> None:
    # A holds 8 blocks but is queued 0.5 s; B holds 2 and is free. best/B = 4 > 3: B fetches 6.
    ps = [prefill("A", 0.5, 8), prefill("B", 0.0, 2)]
    d = run("kvcache_centric", ps, global_len=8, kvcache_balancing_threshold=3.0)
    assert (d.prefill_id, d.prefix_blocks_local, d.prefix_blocks_to_fetch) == ("B", 2, 6)
    assert d.predicted_ttft_s == pytest.approx(0.06 + 0.2)


def test_threshold_not_exceeded_uses_local_prefix_only() -> None:
    # Threshold 5 > 4: B may not fetch (0.8 s), so A wins with 0.5 + 0.2 = 0.7 s.
    ps = [prefill("A", 0.5, 8), prefill("B", 0.0, 2)]
    d = run("kvcache_centric", ps, global_len=8, kvcache_balancing_threshold=5.0)
    assert (d.prefill_id, d.prefix_blocks_local, d.prefix_blocks_to_fetch) == ("A", 8, 0)
    assert d.predicted_ttft_s == pytest.approx(0.7)


def test_busy_holder_vs_free_empty_instance() -> None:
    # A holds all 8 shared blocks and is busy 2 s; C holds nothing and is free.
    ps = [prefill("A", 2.0, 8), prefill("C", 0.0, 0)]
    kv = run("kvcache_centric", ps, global_len=8)
    assert (kv.prefill_id, kv.prefix_blocks_local, kv.prefix_blocks_to_fetch) == ("C", 0, 8)
    assert kv.predicted_ttft_s == pytest.approx(0.08 + 0.2)
    local = run("local_cache_aware", ps, global_len=8)
    assert (local.prefill_id, local.prefix_blocks_to_fetch) == ("C", 0)
    assert local.predicted_ttft_s == pytest.approx(1.0)


def test_slightly_busy_holder_wins_for_local_cache_aware() -> None:
    ps = [prefill("A", 0.5, 8), prefill("C", 0.0, 0)]
    local = run("local_cache_aware", ps, global_len=8)
    assert (local.prefill_id, local.prefix_blocks_local) == ("A", 8)
    kv = run("kvcache_centric", ps, global_len=8)  # C fetches: 0.28 s < 0.7 s
    assert (kv.prefill_id, kv.prefix_blocks_to_fetch) == ("C", 8)


def test_prefix_only_in_global_pool_is_fetched() -> None:
    ps = [prefill("A", 0.0, 0), prefill("B", 0.1, 0)]
    d = run("kvcache_centric", ps, global_len=9)
    assert (d.prefill_id, d.prefix_blocks_local, d.prefix_blocks_to_fetch) == ("A", 0, 9)


def test_holder_itself_fetches_nothing() -> None:
    d = run("kvcache_centric", [prefill("A", 0.0, 8), prefill("B", 0.0, 0)], global_len=8)
    assert (d.prefill_id, d.prefix_blocks_local, d.prefix_blocks_to_fetch) == ("A", 8, 0)


# --- baselines ----------------------------------------------------------------------------
def test_load_balance_picks_least_queue_ignoring_cache() -> None:
    d = run("load_balance", [prefill("A", 0.5, 8), prefill("B", 0.2, 0), prefill("C", 0.3, 2)])
    assert (d.prefill_id, d.prefix_blocks_local, d.prefix_blocks_to_fetch) == ("B", 0, 0)
    assert d.predicted_ttft_s == pytest.approx(0.2 + 1.0)


def test_round_robin_cycles_in_order() -> None:
    sched = make_scheduler("round_robin", config(), cost())
    ps = [prefill("A", 9.0, 0), prefill("B", 0.0, 0), prefill("C", 0.0, 0)]
    got = [sched.schedule(REQ, ps, [decode("d0")], 0, 0.0).prefill_id for _ in range(4)]
    assert got == ["A", "B", "C", "A"]


def test_random_is_seeded_and_uniform_over_instances() -> None:
    sched = make_scheduler("random", config(seed=7), cost())
    ps = [prefill(f"P{i}", 0.0, 0) for i in range(4)]
    got = [sched.schedule(REQ, ps, [decode("d0")], 0, 0.0).prefill_id for _ in range(6)]
    rng = random.Random(7)
    assert got == [f"P{rng.randrange(4)}" for _ in range(6)]


def test_unknown_scheduler_name() -> None:
    with pytest.raises(ValueError):
        make_scheduler("fastest", config(), cost())


# --- decode choice ------------------------------------------------------------------------
def test_decode_lowest_predicted_tbt() -> None:
    ds = [decode("d0", batch=10, ctx=50_000), decode("d1", batch=12, ctx=1_000),
          decode("d2", batch=10, ctx=50_000)]
    d = run("load_balance", [prefill("A", 0.0, 0)], ds)
    assert d.decode_id == "d1"
    assert d.predicted_tbt_s == pytest.approx(0.01 + 0.013 + 0.002)


def test_decode_skips_instance_without_room_when_admitting() -> None:
    ds = [decode("d0", free_blocks=5), decode("d1", batch=50, ctx=90_000, free_blocks=20)]
    d = run("load_balance", [prefill("A", 0.0, 0)], ds, admission="early")
    assert d.decode_id == "d1"  # d0 is faster but cannot hold 1,100 tokens
