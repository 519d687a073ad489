"""Requests waiting for a worker: kept only where waiting is on, oldest first, and each
removed exactly once, by placement (pop) or when its wait is over (expired)."""
from __future__ import annotations

import time

from common.sampling_params import SamplingParams
from common.protocol import SubmitRequest
from services.conductor.held import HeldRequests


def req(rid: str) -> SubmitRequest:
    return SubmitRequest(rid, [1, 2, 3], [], SamplingParams(max_tokens=4), time.time())


def test_waiting_off_holds_nothing() -> None:
    held = HeldRequests(wait_s=0)
    assert not held.hold(req("a")) and len(held) == 0


def test_oldest_first_and_each_leaves_once() -> None:
    held = HeldRequests(wait_s=30)
    assert held.hold(req("a")) and held.hold(req("b"), attempt=1, accepted_at=5.0,
                                             store_loads=False)
    assert [h.req.request_id for h in held.oldest_first()] == ["a", "b"]
    b = held.requests["b"]
    assert (b.attempt, b.accepted_at, b.store_loads) == (1, 5.0, False)
    held.requests["a"].until = 100.0
    assert held.expired(now=99.0) == []
    assert [h.req.request_id for h in held.expired(now=100.5)] == ["a"]
    assert held.expired(now=100.5) == [] and list(held.requests) == ["b"]
    assert held.pop("b") is b and held.pop("b") is None and len(held) == 0
