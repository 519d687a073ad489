"""With several routers the conductor answers each request at the router that took it,
where its decode worker streams too, and tells every router the cluster's status."""
from __future__ import annotations

from dataclasses import replace

from common.config import ClusterConfig, SLOConfig
from common.protocol import (
    AbortRequest, BlocksReserved, RequestAccepted, RequestFailed, RequestRejected, ReserveBlocks,
)
from common.status_protocol import ClusterStatus
from services.conductor.service import Conductor
from tests.conductor.test_conductor import RecordingMail, beat, submit, worker

CONFIG = ClusterConfig(routers=3, base_port=21500, max_queue=1,
                       slo=SLOConfig(ttft_s=1000, tbt_s=1000))
R0, R2 = CONFIG.inbox("router", 0), CONFIG.inbox("router", 2)


def conductor() -> tuple[Conductor, RecordingMail]:
    mail = RecordingMail()
    c = Conductor(CONFIG, mail)  # type: ignore[arg-type]
    for role in ("prefill", "decode"):
        c.on_register(worker(role, 0))
        c.on_heartbeat(beat(role, 0))
    mail.take()
    return c, mail


def test_answers_and_tokens_go_to_the_router_that_took_the_request() -> None:
    c, mail = conductor()
    c.on_submit(replace(submit("r1"), router_inbox=R2))
    [(_, reserve)] = mail.take()
    assert isinstance(reserve, ReserveBlocks) and reserve.router_inbox == R2  # the tokens
    c.on_reserved(BlocksReserved("r1", "decode-0", [1, 2, 3]))
    assert [(a, type(m)) for a, m in mail.take()][0] == (R2, RequestAccepted)
    c.on_submit(replace(submit("r2"), router_inbox=R2))  # max_queue 1: refused
    assert [(a, type(m)) for a, m in mail.take()] == [(R2, RequestRejected)]
    c.on_failed(RequestFailed("r1", 500, "internal_error", "boom", fence=c.tracker.get(
        "r1").fence))
    assert [(a, type(m)) for a, m in mail.take() if isinstance(m, RequestFailed)] == \
        [(R2, RequestFailed)]


def test_a_router_the_cluster_does_not_have_is_answered_at_the_first() -> None:
    c, mail = conductor()
    for i, inbox in enumerate(("", "tcp://10.9.9.9:1")):
        c.on_submit(replace(submit(f"r{i}"), router_inbox=inbox))
        [(_, reserve)] = mail.take()
        assert isinstance(reserve, ReserveBlocks) and reserve.router_inbox == R0
        c.on_abort(AbortRequest(f"r{i}", "test"))  # max_queue 1: make room
        mail.take()


def test_every_router_hears_the_status() -> None:
    c, mail = conductor()
    c.sweep()
    assert sorted(a for a, m in mail.sent if isinstance(m, ClusterStatus)) == \
        sorted(CONFIG.inbox("router", i) for i in range(3))
