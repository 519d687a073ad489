"""The control path after a restart: an unknown heartbeat gets a ReRegister, a new
incarnation replaces the old entry (its requests fail through the lost-worker hook), and a
draining worker is given no new work."""
from __future__ import annotations

from dataclasses import replace

from common.protocol import (ReRegister, RequestFailed, ReserveBlocks,
                             WorkerLeaving)
from services.conductor.service import Conductor
from tests.conductor.test_conductor import RecordingMail, beat, conductor, submit, worker

__all__ = ["conductor"]  # the fixture


def test_unknown_heartbeat_is_asked_to_register(conductor: tuple[Conductor, RecordingMail],
                                                ) -> None:
    c, mail = conductor
    c.on_heartbeat(replace(beat("decode", 7), inbox="tcp://w/decode7"))
    assert mail.take() == [("tcp://w/decode7", ReRegister("decode-7"))]
    c.on_heartbeat(beat("decode", 8))  # no inbox to answer to: nothing sent
    assert mail.take() == []
    c.on_heartbeat(replace(beat("decode", 0), inbox="tcp://w/decode0"))  # known: no ask
    assert mail.take() == []


def test_a_new_incarnation_replaces_the_old_and_reruns_its_requests(
        conductor: tuple[Conductor, RecordingMail]) -> None:
    c, mail = conductor
    c.on_submit(submit("r"))  # reserving on decode-0
    mail.take()
    c.on_register(worker("decode", 0))  # the periodic registration: nothing changes
    assert mail.take() == [] and "r" in c.tracker.requests
    old = c.registry.get("decode-0")
    c.on_register(replace(worker("decode", 0), transfer_session="h:restarted", epoch=5))
    sent = [m for _, m in mail.take()]
    assert not [m for m in sent if isinstance(m, RequestFailed)]  # before its first token
    [again] = [m for m in sent if isinstance(m, ReserveBlocks)]
    assert (again.request_id, again.epoch, again.attempt) == ("r", 5, 1)  # the new one's
    new = c.registry.get("decode-0")
    assert new is not old and new.info.transfer_session == "h:restarted"
    assert set(new.assigned) == {"r"} and c.tracker.get("r").attempt == 1


def test_a_draining_worker_is_given_no_new_work(
        conductor: tuple[Conductor, RecordingMail]) -> None:
    c, mail = conductor
    c.on_heartbeat(replace(beat("prefill", 0), draining=True))
    assert [w.instance_id for w in c.registry.by_role("prefill")] == ["prefill-1"]
    c.on_submit(submit("a"))
    mail.take()
    assert c.tracker.get("a").prefill_id == "prefill-1"
    c.on_heartbeat(replace(beat("decode", 0), draining=True))
    assert not c.ready()
    c.on_submit(submit("b"))  # waits for a decode worker that takes work
    assert mail.take() == [] and list(c.held.requests) == ["b"]
    c.on_heartbeat(beat("decode", 0))  # drained and back (or SIGTERM withdrawn)
    c.sweep()  # the next sweep places it
    assert [type(m) for _, m in mail.take()] == [ReserveBlocks]
    assert c.tracker.get("b").decode_id == "decode-0"


def test_a_leaving_worker_is_removed_at_once(conductor: tuple[Conductor, RecordingMail],
                                             ) -> None:
    c, mail = conductor
    c.on_submit(submit("r"))  # reserving on decode-0
    mail.take()
    c.on_leaving(WorkerLeaving("decode-0", epoch=99))  # not this incarnation: kept
    assert c.registry.get("decode-0") is not None and mail.take() == []
    c.on_leaving(WorkerLeaving("decode-0"))
    assert c.registry.get("decode-0") is None and not c.ready()
    assert not [m for _, m in mail.take() if isinstance(m, RequestFailed)]
    # before its first token: waits for a decode worker
    assert list(c.held.requests) == ["r"]


def test_what_workers_drop_is_served_as_metrics(
        conductor: tuple[Conductor, RecordingMail]) -> None:
    """Workers have no HTTP endpoint: their drop counters and quarantine ride heartbeats."""
    from prometheus_client import generate_latest

    from common.protocol import WorkerLoad

    c, _ = conductor
    c.on_heartbeat(replace(beat("decode", 0), dropped={"KVReady": 2, "outbox_full": 1},
                           load=WorkerLoad(quarantined=3)))
    c.on_heartbeat(replace(beat("decode", 9), dropped={"KVReady": 50}))  # unknown: ignored
    text = generate_latest(c.metrics.registry).decode()
    assert 'crescent_worker_dropped{instance="decode-0",reason="KVReady"} 2.0' in text
    assert 'crescent_worker_dropped{instance="decode-0",reason="outbox_full"} 1.0' in text
    assert 'crescent_worker_quarantined{instance="decode-0"} 3.0' in text
    assert "decode-9" not in text
