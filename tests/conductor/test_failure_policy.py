"""The conductor's failure policy per step, driven in-process with a recording mailbox:
a lost prefill worker re-runs what it had not handed over (once, unseen by the client)
and leaves what is decoding elsewhere alone; a lost decode worker fails its requests
with a clear error; reports of an older attempt, fence or incarnation change nothing."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from common.protocol import (
    KV_FAILED, AbortRequest, BlocksReserved, Fence, PrefillDone, PrefillTask, RegisterWorker,
    RequestAccepted, RequestFailed, RequestFinished, ReserveBlocks, WorkerGone, WorkerHeartbeat,
)
from common.status_protocol import PrefillSummary
from services.conductor.service import STAGE_DOWN_RERUNS, Conductor
from services.conductor.tracker import Phase
from tests.conductor.test_conductor import RecordingMail, beat, started, submit, worker

EPOCHS = {"prefill-0": 10, "prefill-1": 11, "decode-0": 20}
F0, F1 = Fence(20, 1), Fence(20, 2)


def reg(role: str, i: int, epoch: int = 0) -> RegisterWorker:
    name = f"{role}-{i}"
    return replace(worker(role, i), epoch=epoch or EPOCHS[name])


def heartbeat(role: str, i: int, epoch: int = 0) -> WorkerHeartbeat:
    return replace(beat(role, i), epoch=epoch or EPOCHS[f"{role}-{i}"])


@pytest.fixture
def conductor() -> tuple[Conductor, RecordingMail]:
    return started(8, [(reg(r, i), heartbeat(r, i))
                       for r, i in (("prefill", 0), ("prefill", 1), ("decode", 0))])


def prefilling(c: Conductor, mail: RecordingMail, rid: str = "r") -> PrefillTask:
    """Submit ``rid`` and reserve its blocks under F0: its PrefillTask."""
    c.on_submit(submit(rid))
    mail.take()
    c.on_reserved(BlocksReserved(rid, "decode-0", [1, 2, 3], F0))
    (_, accepted), (_, task) = mail.take()  # the router hears it accepted now
    assert isinstance(accepted, RequestAccepted) and isinstance(task, PrefillTask)
    return task


def silence(c: Conductor, *names: str) -> None:
    """Make ``names`` miss their heartbeats, then sweep."""
    now = time.monotonic()
    for w in c.registry.workers.values():
        w.last_seen = now - 60 if w.instance_id in names else now
    c.sweep()


def test_a_prefill_lost_before_the_first_token_reruns_the_request_once(conductor) -> None:
    c, mail = conductor
    task = prefilling(c, mail)
    first = c.tracker.get("r").prefill_id
    other = "prefill-1" if first == "prefill-0" else "prefill-0"
    assert (task.fence, task.prefill_epoch) == (F0, EPOCHS[first])
    silence(c, first)
    sent = mail.take()
    # The old reservation is given back (fenced), a new one asked for with the other
    # prefill worker as its writer; the client is told nothing.
    again = sent[1][1]
    assert sent == [
        ("tcp://w/decode0", AbortRequest("r", "prefill_lost", F0)),
        ("tcp://w/decode0", ReserveBlocks("r", 40, again.sampling, c.router_inbox,
                                          again.deadline, epoch=20, writer=other,
                                          writer_epoch=EPOCHS[other], attempt=1,
                                          writer_inbox="tcp://w/prefill1"))]
    t = c.tracker.get("r")
    assert (t.prefill_id, t.phase, t.attempt, t.fence) == (other, Phase.RESERVING, 1, None)
    assert c.metrics.reruns._value.get() == 1
    # The new reservation: the task goes to the other prefill worker under its fence.
    c.on_reserved(BlocksReserved("r", "decode-0", [4, 5, 6], F1, attempt=1))
    [(addr, rerun)] = [(a, m) for a, m in mail.take() if isinstance(m, PrefillTask)]
    assert addr == f"tcp://w/prefill{other[-1]}"
    assert (rerun.fence, rerun.decode_block_ids, rerun.prefill_epoch, rerun.store_loads) == (
        F1, [4, 5, 6], EPOCHS[other], True)  # a lost worker's re-run may load from the store
    # The old attempt's late reports change nothing.
    c.on_prefill_done(PrefillDone("r", first, 40, 0, 0, 0.1, 1000, 0.01, F0))
    c.on_finished(RequestFinished("r", "decode-0", "abort", F0))
    c.on_failed(RequestFailed("r", 504, "timeout", "late", fence=F0))
    assert mail.take() == [] and c.tracker.get("r").phase is Phase.PREFILLING
    # The re-run completes.
    c.on_prefill_done(PrefillDone("r", other, 40, 0, 0, 0.1, 1000, 0.01, F1))
    c.on_finished(RequestFinished("r", "decode-0", "stop", F1))
    assert c.tracker.requests == {}
    assert mail.take() == []
    # only the re-run's prefill is counted and told to the router (at the next sweep)
    assert c.prefilled == [PrefillSummary("r", 0.1, 0.0, 0.01, 1000)]
    assert c.metrics.transfer_bytes._value.get() == 1000
    assert all(not w.assigned for w in c.registry.workers.values())


def test_a_request_loses_its_prefill_worker_on_the_rerun_too(conductor) -> None:
    c, mail = conductor
    prefilling(c, mail)
    silence(c, c.tracker.get("r").prefill_id)
    mail.take()
    c.on_reserved(BlocksReserved("r", "decode-0", [4], F1, attempt=1))
    mail.take()
    silence(c, c.tracker.get("r").prefill_id)
    failed = [m for _, m in mail.take() if isinstance(m, RequestFailed)]
    assert [(m.status, m.error_type) for m in failed] == [(503, "worker_lost")]
    assert failed[0].message.startswith("prefill worker lost on the re-run too: prefill-")
    assert c.tracker.requests == {}


def test_a_failed_store_load_reruns_the_request_once(conductor) -> None:
    """A pipeline group fails a prompt whose store load failed (a lone worker computes the
    prefix itself): the cache cost that attempt, not the request, which runs again, unseen
    by the client; the same failure on the re-run reaches the client as it is."""
    c, mail = conductor
    assert prefilling(c, mail).store_loads
    first = c.tracker.get("r").prefill_id
    c.on_failed(RequestFailed("r", 503, "kv_load_failed", "layer-wise load failed at layer 3",
                              fence=F0))
    sent = mail.take()
    assert [type(m) for _, m in sent] == [AbortRequest, AbortRequest, ReserveBlocks]
    assert {addr for addr, m in sent if isinstance(m, AbortRequest)} == {
        "tcp://w/decode0", f"tcp://w/prefill{first[-1]}"}
    assert sent[-1][1].attempt == 1 and c.metrics.reruns._value.get() == 1
    assert c.tracker.get("r").phase is Phase.RESERVING
    c.on_reserved(BlocksReserved("r", "decode-0", [4, 5, 6], F1, attempt=1))
    [task] = [m for _, m in mail.take() if isinstance(m, PrefillTask)]
    assert not task.store_loads  # the re-run computes what it failed to load
    c.on_failed(RequestFailed("r", 503, "kv_load_failed", "again", fence=F1))
    failed = [m for _, m in mail.take() if isinstance(m, RequestFailed)]
    assert [(m.status, m.error_type, m.message) for m in failed] == [
        (503, "kv_load_failed", "again")]
    assert c.tracker.requests == {}
    assert all(not w.assigned for w in c.registry.workers.values())


def test_a_task_refused_by_a_group_head_whose_stage_died_reruns_elsewhere(conductor) -> None:
    """A head whose later stage died refuses tasks (``prefill_stage_down``, nothing
    computed) until it exits: the request re-runs once, on another instance, unseen by the
    client, and the head takes nothing more until its next heartbeat."""
    c, mail = conductor
    prefilling(c, mail)
    head = c.tracker.get("r").prefill_id
    c.on_failed(RequestFailed("r", 503, "prefill_stage_down",
                              f"a pipeline stage of {head} is not up", fence=F0))
    sent = [m for _, m in mail.take()]
    assert not any(isinstance(m, RequestFailed) for m in sent)
    assert isinstance(sent[-1], ReserveBlocks) and sent[-1].attempt == 1
    c.on_reserved(BlocksReserved("r", "decode-0", [4, 5, 6], F1, attempt=1))
    [address] = [a for a, m in mail.take() if isinstance(m, PrefillTask)]
    assert c.tracker.get("r").prefill_id != head and not address.endswith(head[-1])
    c.on_submit(submit("s"))  # placed elsewhere too, before the head's next beat
    c.on_reserved(BlocksReserved("s", "decode-0", [7], Fence(20, 3)))
    assert c.tracker.get("s").prefill_id != head
    c.on_heartbeat(heartbeat("prefill", int(head[-1])))  # its stages are back
    assert head in {w.instance_id for w in c.registry.by_role("prefill")}
    # refused again (a restarted head whose stages are not up yet): re-run again, up to
    # STAGE_DOWN_RERUNS attempts; past them the refusal reaches the client as it is
    for attempt in range(2, STAGE_DOWN_RERUNS + 1):
        fence = Fence(20, 10 + attempt)
        for i in (0, 1):  # both heads beat again: only the refusing one is held off
            c.on_heartbeat(heartbeat("prefill", i))
        c.on_failed(RequestFailed("r", 503, "prefill_stage_down", "again",
                                  fence=c.tracker.get("r").fence))
        assert not any(isinstance(m, RequestFailed) for _, m in mail.take())
        c.on_reserved(BlocksReserved("r", "decode-0", [8], fence, attempt=attempt))
        mail.take()
        assert c.tracker.get("r").attempt == attempt
    c.on_failed(RequestFailed("r", 503, "prefill_stage_down", "again",
                              fence=c.tracker.get("r").fence))
    failed = [m for _, m in mail.take() if isinstance(m, RequestFailed)]
    assert [(m.status, m.error_type, m.message) for m in failed] == [
        (503, "prefill_stage_down", "again")]


@pytest.mark.parametrize("kind", ["kv_load_failed", "kv_transfer_failed"])
def test_the_decode_workers_release_coming_before_the_prefills_failure_loses_nothing(
        conductor, kind) -> None:
    """A failing prefill sends KVFailed to the decode worker, then RequestFailed to the
    conductor; the decode worker's RequestFinished(kv_failed) can overtake the latter (two
    connections). It must not end the request: the failure still re-runs it or reaches the
    client. (Before, the request was dropped without a word: the client timed out.)"""
    c, mail = conductor
    prefilling(c, mail)
    c.on_finished(RequestFinished("r", "decode-0", KV_FAILED, F0))
    assert mail.take() == [] and c.tracker.get("r").phase is Phase.PREFILLING
    c.on_failed(RequestFailed("r", 503, kind, "it failed", fence=F0))
    sent = [m for _, m in mail.take()]
    if kind == "kv_load_failed":  # re-run once
        assert isinstance(sent[-1], ReserveBlocks) and c.tracker.get("r").attempt == 1
    else:
        failed = [m for m in sent if isinstance(m, RequestFailed)]
        assert [(m.status, m.error_type) for m in failed] == [(503, kind)]
        assert c.tracker.requests == {}
        assert all(not w.assigned for w in c.registry.workers.values())


def test_a_rerun_without_store_loads_is_priced_without_them(conductor) -> None:
    """The store holds the prompt's two full blocks: the first placement counts them as
    cached; the re-run after a failed load reads nothing from the store, and its placement
    counts every token as work (no instance holds them locally)."""
    c, mail = conductor
    c.placer.global_index.on_stored(["k0", "k1"])
    c.on_submit(submit("r", 40, ["k0", "k1"]))
    mail.take()
    assert c.tracker.get("r").prefill_tokens == 40 - 2 * 16
    c.on_reserved(BlocksReserved("r", "decode-0", [1, 2, 3], F0))
    mail.take()
    c.on_failed(RequestFailed("r", 503, "kv_load_failed", "lease lapsed", fence=F0))
    mail.take()
    t = c.tracker.get("r")
    assert (t.attempt, t.store_loads, t.prefill_tokens) == (1, False, 40)


def test_no_other_prefill_worker_fails_the_request_with_a_clear_error(conductor) -> None:
    """Where requests do not wait for a worker (``worker_wait_s`` 0)."""
    c, mail = conductor
    c.held.wait_s = 0
    prefilling(c, mail)
    silence(c, "prefill-0", "prefill-1")
    failed = [m for _, m in mail.take() if isinstance(m, RequestFailed)]
    assert [(m.status, m.error_type) for m in failed] == [(503, "worker_lost")]
    assert "no re-run possible: no_instances" in failed[0].message


def test_a_prefill_loss_leaves_requests_decoding_elsewhere_alone(conductor) -> None:
    c, mail = conductor
    prefilling(c, mail)
    first = c.tracker.get("r").prefill_id
    c.on_prefill_done(PrefillDone("r", first, 40, 0, 0, 0.1, 1000, 0.01, F0))
    mail.take()
    silence(c, first)  # dead, or only a false heartbeat timeout
    assert mail.take() == []
    assert c.tracker.get("r").phase is Phase.DECODING
    c.on_finished(RequestFinished("r", "decode-0", "stop", F0))
    assert c.tracker.requests == {} and c.metrics.finished.labels(reason="stop")._value.get() == 1


def test_a_decode_loss_mid_stream_fails_as_resumable(conductor) -> None:
    """The router goes on with a continuation (services/router/resume.py)."""
    c, mail = conductor
    prefilling(c, mail)
    c.on_prefill_done(PrefillDone("r", c.tracker.get("r").prefill_id, 40, 0, 0, 0.1,
                                  1000, 0.01, F0))
    mail.take()
    silence(c, "decode-0")
    failed = [m for _, m in mail.take() if isinstance(m, RequestFailed)]
    assert failed == [RequestFailed("r", 503, "worker_lost", "decode worker lost mid-stream: "
                                    "decode-0 stopped responding", resumable=True)]


def test_a_decode_loss_while_reserving_reruns_and_during_prefill_resumes(conductor) -> None:
    """Reserving: nothing reached the client, the request is placed again, unseen (here
    no decode worker is left: it waits for one). Prefilling: the decode worker may have
    streamed tokens already (it starts on the prefill's KVReady), so the router, which
    knows, goes on from them (resumable)."""
    c, mail = conductor
    c.on_submit(submit("a"))
    prefilling(c, mail, "b")
    mail.take()
    silence(c, "decode-0")
    failed = [m for _, m in mail.take() if isinstance(m, RequestFailed)]
    assert failed == [RequestFailed("b", 503, "worker_lost", "decode worker lost during its "
                                    "prefill: decode-0 stopped responding", resumable=True)]
    assert list(c.held.requests) == ["a"] and c.held.requests["a"].attempt == 1


def test_a_restarted_worker_is_announced_and_its_old_incarnation_fenced(conductor) -> None:
    c, mail = conductor
    c.on_register(reg("prefill", 0))  # the periodic registration: nothing new
    assert mail.take() == []
    c.on_register(reg("prefill", 0, epoch=30))  # restarted
    assert mail.take() == [("tcp://w/decode0", WorkerGone("prefill-0", 30))]
    c.on_register(reg("prefill", 0, epoch=10))  # a late one of the dead incarnation
    assert c.registry.get("prefill-0").info.epoch == 30 and mail.take() == []
    assert not c.registry.heartbeat(heartbeat("prefill", 0, epoch=10))  # its beat too
    assert c.registry.heartbeat(heartbeat("prefill", 0, epoch=30))
    # A decode worker new here learns of every worker it may hold quarantines for.
    c.on_register(reg("decode", 0, epoch=21))
    sent = mail.take()
    gone = {(a, m) for a, m in sent if isinstance(m, WorkerGone)}
    assert gone == {("tcp://w/decode0", WorkerGone(w, e)) for w, e in (
        ("decode-0", 21), ("prefill-0", 30), ("prefill-1", 11))}


def test_a_late_reservation_of_an_older_attempt_is_given_back_alone(conductor) -> None:
    c, mail = conductor
    c.on_submit(submit("r"))
    mail.take()
    silence(c, c.tracker.get("r").prefill_id)  # lost while reserving: re-run
    mail.take()
    c.on_reserved(BlocksReserved("r", "decode-0", [1], F0, attempt=0))  # the first ask's
    assert mail.take() == [("tcp://w/decode0", AbortRequest("r", "stale", F0))]
    assert c.tracker.get("r").phase is Phase.RESERVING


@pytest.fixture
def lone() -> tuple[Conductor, RecordingMail]:
    """One prefill and one decode worker: a lost prefill leaves no other."""
    return started(8, [(reg(r, 0), heartbeat(r, 0)) for r in ("prefill", "decode")])


def test_a_lost_lone_prefill_worker_s_requests_wait_for_its_restart(lone) -> None:
    c, mail = lone
    prefilling(c, mail)
    silence(c, "prefill-0")
    assert mail.take() == [("tcp://w/decode0", AbortRequest("r", "prefill_lost", F0))]
    # nobody told: it waits
    assert list(c.held.requests) == ["r"] and c.tracker.requests == {}
    c.sweep()
    assert mail.take() == []
    c.on_register(reg("prefill", 0, epoch=12))  # the supervisor's restart
    sent = [m for _, m in mail.take() if not isinstance(m, WorkerGone)]
    assert [(type(m), m.writer, m.writer_epoch, m.attempt) for m in sent] == [
        (ReserveBlocks, "prefill-0", 12, 1)]  # accepted again once reserved (the router
    # keeps the first acceptance)
    assert c.held.requests == {} and c.tracker.get("r").phase is Phase.RESERVING
    assert c.metrics.reruns._value.get() == 1


def test_a_request_waits_at_most_worker_wait_s(lone) -> None:
    c, mail = lone
    prefilling(c, mail)
    silence(c, "prefill-0")
    mail.take()
    c.held.requests["r"].until = time.monotonic() - 0.1  # its wait is over
    c.sweep()
    [failed] = [m for _, m in mail.take() if isinstance(m, RequestFailed)]
    assert (failed.status, failed.error_type) == (503, "worker_unavailable")
    assert "came back within 30 s" in failed.message and c.held.requests == {}


def test_a_request_sent_while_no_worker_lives_waits_or_is_aborted() -> None:
    c, mail = started(8, [])
    c.on_submit(submit("a"))
    c.on_submit(submit("b"))
    assert mail.take() == [] and list(c.held.requests) == ["a", "b"]
    c.on_abort(AbortRequest("b", "client gone"))  # the client left while it waited
    for r in ("prefill", "decode"):
        c.on_register(reg(r, 0))
        c.on_heartbeat(heartbeat(r, 0))
    sent = [type(m) for _, m in mail.take() if not isinstance(m, WorkerGone)]
    assert sent == [ReserveBlocks] and c.held.requests == {}
    assert list(c.tracker.requests) == ["a"]


def test_the_prefill_worker_is_told_of_a_stored_prefix_with_the_reservation(conductor) -> None:
    """The store holds two of the prompt's blocks that no prefill worker does: with the
    ReserveBlocks, its prefill worker gets a PrefetchLoads (it asks the store meanwhile);
    not for a prompt the store holds nothing of, nor for the re-run without store loads."""
    from common.protocol import PrefetchLoads

    c, mail = conductor
    c.placer.global_index.on_stored(["k0", "k1"])
    c.on_submit(submit("r", 40, ["k0", "k1"]))
    sent = mail.take()
    kinds = [type(m).__name__ for _, m in sent]
    assert kinds[-2:] == ["ReserveBlocks", "PrefetchLoads"]
    address, hint = sent[-1]
    assert hint == PrefetchLoads("r", ["k0", "k1"])
    assert address == c.registry.get(c.tracker.get("r").prefill_id).info.inbox
    c.on_submit(submit("s", 40, ["k2", "k3"]))
    assert not any(isinstance(m, PrefetchLoads) for _, m in mail.take())
    c.on_reserved(BlocksReserved("r", "decode-0", [1, 2, 3], F0))
    mail.take()
    c.on_failed(RequestFailed("r", 503, "kv_load_failed", "lease lapsed", fence=F0))
    assert not any(isinstance(m, PrefetchLoads) for _, m in mail.take())
