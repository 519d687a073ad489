"""The predicted prefill queue of a worker: each waiting request's own prefill time, less
what the oldest has predictably computed already; and a colocated worker decodes what it
prefills."""
from __future__ import annotations

import time
from typing import Optional

import pytest

from common.config import ClusterConfig, SLOConfig
from common.protocol import SubmitRequest
from common.sampling_params import SamplingParams
from services.conductor.prefill_queue import queued_waits, shared_prefix
from services.conductor.service import Conductor
from services.conductor.tracker import Phase
from tests.conductor.test_conductor import RecordingMail, beat, worker


def submit(rid: str, n: int) -> SubmitRequest:
    return SubmitRequest(rid, list(range(n)), [], SamplingParams(max_tokens=8), time.time())


@pytest.fixture
def conductor() -> Conductor:
    cfg = ClusterConfig(scheduler="load_balance", slo=SLOConfig(ttft_s=1000, tbt_s=1000))
    c = Conductor(cfg, RecordingMail(), clock=lambda: 1000.0)  # type: ignore[arg-type]
    for role in ("prefill", "decode"):
        c.on_register(worker(role, 0))
        c.on_heartbeat(beat(role, 0))
    return c


def test_queue_is_the_sum_of_each_requests_prefill(conductor: Conductor) -> None:
    cost = conductor.placer.cost
    conductor.on_submit(submit("a", 300))
    conductor.on_submit(submit("b", 500))
    a, b = conductor.tracker.get("a"), conductor.tracker.get("b")
    assert a is not None and b is not None
    ca, cb = cost.prefill_seconds(300, 0), cost.prefill_seconds(500, 0)
    assert a.predicted_ttft_s == pytest.approx(ca)  # nothing queued before it
    # b waits for a, and both stretch by the share of the last 20 s that shorter prompts
    # (a) took: shortest first, more like a may come before b is done
    rho = cost.prefill_compute_seconds(300, 0) / 20
    assert b.predicted_ttft_s == pytest.approx((ca + cb) / (1 - rho))
    w = conductor.registry.get("prefill-0")
    assert w is not None
    placer, tracker = conductor.placer, conductor.tracker
    # At accept time nothing of "a" is done; half-way through it, half of it is.
    assert placer.queue_seconds(w, tracker, 1000.0) == pytest.approx(ca + cb)
    assert placer.queue_seconds(w, tracker, 1000.0 + ca / 2) == pytest.approx(ca / 2 + cb)
    # Late (a took longer than predicted): never less than the requests not yet begun.
    assert placer.queue_seconds(w, tracker, 1000.0 + 10 * ca) == pytest.approx(cb)
    # Once "a" decodes (its prefill worker released, as on PrefillDone) it no longer counts.
    tracker.set_phase(a, Phase.DECODING, 0)
    conductor.registry.release_prefill(a)
    assert placer.queue_seconds(w, tracker, 1000.0) == pytest.approx(cb)


def test_a_colocated_worker_decodes_what_it_prefills() -> None:
    cfg = ClusterConfig(scheduler="kvcache_centric", slo=SLOConfig(ttft_s=1000, tbt_s=1000))
    mail = RecordingMail()
    c = Conductor(cfg, mail, clock=lambda: 1000.0)  # type: ignore[arg-type]
    for i in (0, 1):
        c.on_register(worker("colocated", i))
        c.on_heartbeat(beat("colocated", i))
    assert c.ready()
    assert len(c.registry.by_role("prefill")) == len(c.registry.by_role("decode")) == 2
    for k in range(6):
        c.on_submit(submit(f"r{k}", 100 + 50 * k))
        t = c.tracker.get(f"r{k}")
        assert t is not None and t.prefill_id == t.decode_id


@pytest.mark.parametrize("order", ["arrival", "shortest"])
def test_a_shorter_prompt_waits_for_a_longer_one_only_in_arrival_order(order: str) -> None:
    """b (300 tokens) is placed behind a (500): in arrival order it waits for a; shortest
    first only for 1.5 steps of a's (256 tokens: the rest of the step a is in, half of
    one on average, and the step b joins, which a fills). 6 s later both have waited ``prefill_max_wait_s`` (5
    s): the worker computes them in arrival order, a predictably done, so d (300) waits
    for b either way."""
    now = [1000.0]
    cfg = ClusterConfig(scheduler="load_balance", slo=SLOConfig(ttft_s=1000, tbt_s=1000),
                        prefill_order=order, prefill_max_wait_s=5.0)
    c = Conductor(cfg, RecordingMail(), clock=lambda: now[0])  # type: ignore[arg-type]
    for role in ("prefill", "decode"):
        c.on_register(worker(role, 0))
        c.on_heartbeat(beat(role, 0))
    ca, cb = c.placer.cost.prefill_seconds(500, 0), c.placer.cost.prefill_seconds(300, 0)
    c.on_submit(submit("a", 500))
    now[0] += 0.001  # b arrives after a
    c.on_submit(submit("b", 300))
    now[0] += 6.0
    c.on_submit(submit("d", 300))
    b, d = c.tracker.get("b"), c.tracker.get("d")
    assert b is not None and d is not None
    want_b, want_d = ca + cb if order == "arrival" else ca * 384 / 500 + cb, cb + cb
    assert (b.predicted_ttft_s, d.predicted_ttft_s) == (pytest.approx(want_b, abs=0.01),
                                                        pytest.approx(want_d, abs=0.01))


@pytest.mark.parametrize("tokens, preempt, backlog_s, waits", [
    (100, 128, None, False),  # its step runs inside a's (services/prefill/preempt.py)
    (100, 128, 5.0, False),  # a has waited 1 ms, not 5 s
    (100, 0, None, True),  # preemption off: 1.5 steps of a's
    (300, 128, None, True),  # over the limit: as before
    (100, 128, 0.0005, True),  # a has waited 1 ms, past the backlog: no preemption
])
def test_a_prompt_that_preempts_waits_for_no_longer_one(tokens: int, preempt: int,
                                                        backlog_s: Optional[float],
                                                        waits: bool) -> None:
    now = [1000.0]
    cfg = ClusterConfig(scheduler="load_balance", slo=SLOConfig(ttft_s=1000, tbt_s=1000),
                        prefill_preempt_tokens=preempt, prefill_preempt_backlog_s=backlog_s)
    c = Conductor(cfg, RecordingMail(), clock=lambda: now[0])  # type: ignore[arg-type]
    for role in ("prefill", "decode"):
        c.on_register(worker(role, 0))
        c.on_heartbeat(beat(role, 0))
    ca, cb = c.placer.cost.prefill_seconds(500, 0), c.placer.cost.prefill_seconds(tokens, 0)
    c.on_submit(submit("a", 500))
    now[0] += 0.001
    c.on_submit(submit("b", tokens))
    b = c.tracker.get("b")
    assert b is not None
    assert b.predicted_ttft_s == pytest.approx(cb + (ca * 384 / 500 if waits else 0), abs=0.01)


def test_placements_are_remembered_for_twenty_seconds(conductor: Conductor) -> None:
    """What the conductor placed on a prefill worker lately is the ``recent`` of its state
    (what shorter arrivals stretch a longer prompt's prediction by), then forgotten."""
    cost = conductor.placer.cost
    conductor.on_submit(submit("a", 300))
    conductor.on_submit(submit("b", 500))
    w = conductor.registry.get("prefill-0")
    assert w is not None
    c = submit("c", 10)
    state = conductor.placer._prefill_state(w, conductor.tracker, 1000.0, c)
    assert state.recent.entries() == (
        (300, pytest.approx(cost.prefill_compute_seconds(300, 0))),
        (500, pytest.approx(cost.prefill_compute_seconds(500, 0))))
    assert not conductor.placer._prefill_state(w, conductor.tracker, 1020.0, c).recent


def test_shared_prefix_and_the_waits_of_queued_keys() -> None:
    """A queued prompt holds a prefix of a request's keys (keys chain); each key waits for
    the last queued prompt computing it."""
    keys = [f"k{i}" for i in range(7)]
    assert [shared_prefix(keys, frozenset(keys[:n] + ["x"])) for n in range(8)] == \
        list(range(8))
    assert shared_prefix(keys, frozenset()) == 0 and shared_prefix([], frozenset(keys)) == 0
    assert queued_waits(keys, []) == {}
    assert queued_waits(keys, [(2, 5.0), (4, 1.0), (4, 3.0), (1, 0.5)]) == {
        "k0": 5.0, "k1": 5.0, "k2": 3.0, "k3": 3.0}


def test_a_request_waits_for_the_queued_prompt_computing_its_prefix(
        conductor: Conductor) -> None:
    """Placement prices a prompt whose prefix a queued prompt computes as cached for that
    prompt's time: only its own keys are looked up in the queue (the queue's other keys
    are never listed)."""
    keys = [f"{i:032x}" for i in range(20)]
    conductor.on_submit(SubmitRequest("a", list(range(320)), keys, SamplingParams(
        max_tokens=8), time.time()))
    w = conductor.registry.get("prefill-0")
    assert w is not None and w.assigned
    b = SubmitRequest("b", list(range(192)), keys[:12], SamplingParams(max_tokens=8),
                      time.time())
    other = SubmitRequest("o", list(range(192)), [f"{i:032x}" for i in range(50, 62)],
                          SamplingParams(max_tokens=8), time.time())
    a = conductor.tracker.get("a")
    assert a is not None
    now = conductor.clock()
    index = conductor.placer._prefill_state(w, conductor.tracker, now, b).prefix_index
    assert set(index.queued) == set(keys[:12])  # b's keys only, all queued in a
    assert index.queued_within(keys[:12]) == pytest.approx(a.predicted_ttft_s, abs=0.05)
    assert conductor.placer._prefill_state(w, conductor.tracker, now,
                                           other).prefix_index.queued == {}
