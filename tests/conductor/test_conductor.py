"""The conductor's request state machine, driven in-process with a recording mailbox."""
from __future__ import annotations

import time
from typing import Any

import pytest

from common.config import ClusterConfig, SLOConfig
from common.kv.events import KVEvents
from common.protocol import (
    AbortRequest, BlocksReserved, PrefillDone, PrefillTask, RegisterWorker, RequestAccepted,
    RequestFailed, RequestFinished, ReserveBlocks, ReserveFailed, RequestRejected,
    SubmitRequest, WorkerHeartbeat, WorkerLoad,
)
from common.status_protocol import ClusterStatus
from common.sampling_params import SamplingParams
from common.scheduling import Rejection
from services.conductor.service import Conductor


class RecordingMail:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def send(self, address: str, msg: Any) -> bool:
        self.sent.append((address, msg))
        return True

    def take(self) -> list[tuple[str, Any]]:
        out, self.sent = self.sent, []
        return [(a, m) for a, m in out if not isinstance(m, ClusterStatus)]


def worker(role: str, i: int) -> RegisterWorker:
    return RegisterWorker(f"{role}-{i}", role, f"tcp://w/{role}{i}", f"h:{i}", 4096, 1024,
                          32, 100, 16)


def beat(role: str, i: int, free: int = 100, stored: list[str] | None = None) -> WorkerHeartbeat:
    """A first heartbeat: ``stored`` are events 1..n."""
    events = KVEvents(1, "s" * len(stored or []), list(stored or []))
    return WorkerHeartbeat(f"{role}-{i}", role, WorkerLoad(), free, 100 - free, 100,
                           events, len(events))


def submit(rid: str, n: int = 40, keys: list[str] | None = None) -> SubmitRequest:
    return SubmitRequest(rid, list(range(n)), keys or [], SamplingParams(max_tokens=8), time.time())


def started(max_queue: int, workers: list[tuple[RegisterWorker, WorkerHeartbeat]]
            ) -> tuple[Conductor, RecordingMail]:
    """A conductor (cache-aware, SLOs out of reach) that has heard from ``workers``."""
    cfg = ClusterConfig(scheduler="kvcache_centric", max_queue=max_queue,
                        slo=SLOConfig(ttft_s=1000, tbt_s=1000))
    mail = RecordingMail()
    c = Conductor(cfg, mail)  # type: ignore[arg-type]
    for registration, heartbeat in workers:
        c.on_register(registration)
        c.on_heartbeat(heartbeat)
    mail.take()  # WorkerGone announcements of the registrations
    return c, mail


@pytest.fixture
def conductor() -> tuple[Conductor, RecordingMail]:
    return started(2, [(worker(r, i), beat(r, i))
                       for r, i in (("prefill", 0), ("prefill", 1), ("decode", 0))])


def test_no_workers_is_503_where_requests_do_not_wait_for_one() -> None:
    mail = RecordingMail()
    c = Conductor(ClusterConfig(worker_wait_s=0), mail)  # type: ignore[arg-type]
    c.on_submit(submit("r"))
    [(addr, msg)] = mail.take()
    assert isinstance(msg, RequestFailed) and msg.status == 503


def test_happy_path_reserve_prefill_finish(conductor) -> None:
    c, mail = conductor
    c.on_submit(submit("r1"))
    sent = mail.take()
    assert [type(m) for _, m in sent] == [ReserveBlocks]
    assert sent[0][0] == "tcp://w/decode0"
    c.on_reserved(BlocksReserved("r1", "decode-0", [5, 6, 7]))
    # accepted once its blocks are reserved: a failed reservation is a plain 429
    (_, accepted), (addr, task) = mail.take()
    assert isinstance(accepted, RequestAccepted)
    assert (accepted.request_id, accepted.decode_id) == ("r1", "decode-0")
    assert isinstance(task, PrefillTask) and task.decode_block_ids == [5, 6, 7]
    assert task.decode_session == "h:0" and task.decode_kv_base == 4096
    c.on_prefill_done(PrefillDone("r1", task.decode_id, 40, 0, 0, 0.1, 1000, 0.01))
    c.on_finished(RequestFinished("r1", "decode-0", "stop"))
    assert c.tracker.requests == {}
    assert all(not w.assigned for w in c.registry.workers.values())


def test_prefill_done_after_finish_still_counts(conductor) -> None:
    """A one-token answer's RequestFinished can overtake its PrefillDone: the prefill's
    measurements still reach /metrics and the calibration, and nothing is resurrected."""
    c, mail = conductor
    c.on_submit(submit("r1"))
    c.on_reserved(BlocksReserved("r1", "decode-0", [5, 6, 7]))
    [(_, task)] = [(a, m) for a, m in mail.take() if isinstance(m, PrefillTask)]
    prefill_id = c.tracker.get("r1").prefill_id
    c.on_finished(RequestFinished("r1", "decode-0", "length", fence=task.fence))
    seen = len(c.placer.calibrator.computed)
    c.on_prefill_done(PrefillDone("r1", prefill_id, 40, 16, 16, 0.1, 1000, 0.01,
                                  task.fence, wait_s=0.02))
    assert c.tracker.requests == {}
    assert c.metrics.prompt_tokens._value.get() == 40
    assert c.metrics.global_hit_tokens._value.get() == 16
    assert c.metrics.prefill_transfer_wait.labels(prefill_id)._sum.get() == 0.02
    assert len(c.placer.calibrator.computed) == seen + 1


def test_cache_aware_placement_prefers_holder_of_prefix(conductor) -> None:
    c, mail = conductor
    keys = [f"{i:032x}" for i in range(2)]
    c.on_heartbeat(beat("prefill", 1, stored=keys))
    c.on_submit(submit("r", n=40, keys=keys))
    assert c.tracker.get("r").prefill_id == "prefill-1"


def test_queue_full_is_a_rejection(conductor) -> None:
    c, mail = conductor
    for rid in ("a", "b", "c"):
        c.on_submit(submit(rid))
    rejected = [m for _, m in mail.take() if isinstance(m, RequestRejected)]
    assert rejected == [RequestRejected("c", Rejection(
        "queue_full", 1.0, "2 requests are waiting for prefill"))]
    assert c.metrics.rejected.labels(reason="queue_full")._value.get() == 1


def test_reserve_failure_is_429_without_abort(conductor) -> None:
    """Before any RequestAccepted: the router answers a plain 429, not a stream whose
    200 is followed by an error event (AIPerf counted one such as a request without
    content, issue 29's replay at 2 req/s)."""
    c, mail = conductor
    c.on_submit(submit("r"))
    assert not any(isinstance(m, RequestAccepted) for _, m in mail.take())
    c.on_reserve_failed(ReserveFailed("r", "decode-0", "full"))
    [(addr, msg)] = mail.take()
    assert isinstance(msg, RequestFailed) and msg.status == 429
    assert c.tracker.requests == {}


def test_abort_reaches_both_workers(conductor) -> None:
    c, mail = conductor
    c.on_submit(submit("r"))
    c.on_reserved(BlocksReserved("r", "decode-0", [1]))
    prefill = next(m.decode_id for _, m in mail.take() if isinstance(m, PrefillTask))
    assert prefill == "decode-0"
    c.on_abort(AbortRequest("r", "client disconnected"))
    targets = sorted(a for a, m in mail.take() if isinstance(m, AbortRequest))
    assert len(targets) == 2 and "tcp://w/decode0" in targets


def test_late_reservation_after_abort_is_given_back(conductor) -> None:
    c, mail = conductor
    c.on_submit(submit("r"))
    c.on_abort(AbortRequest("r"))
    mail.take()
    c.on_reserved(BlocksReserved("r", "decode-0", [1, 2]))
    assert [(a, type(m)) for a, m in mail.take()] == [("tcp://w/decode0", AbortRequest)]


def test_dead_worker_s_requests_wait_for_another(conductor) -> None:
    """Reserving on it (nothing computed yet): re-run, here on a decode worker to come."""
    c, mail = conductor
    c.on_submit(submit("r"))
    mail.take()
    now = time.monotonic()
    for w in c.registry.workers.values():
        w.last_seen = now if w.instance_id != "decode-0" else now - 60
    c.sweep()
    sent = mail.take()
    assert not [m for a, m in sent if isinstance(m, RequestFailed)]
    assert "decode-0" not in c.registry.workers
    # no decode worker left
    assert c.tracker.requests == {} and list(c.held.requests) == ["r"]


def test_reregistration_keeps_state(conductor) -> None:
    c, _ = conductor
    c.on_heartbeat(beat("prefill", 0, stored=["aa"]))
    c.on_register(worker("prefill", 0))
    assert c.registry.get("prefill-0").cached_keys == {"aa"}
