"""The prefill worker's side of fencing on fakes (tests/worker_fakes.py): tasks for another
incarnation or replayed are dropped, the queue is bounded, and KVFailed (which lets the
decode worker reuse its blocks) goes out only once no write of the stream can land, even
one whose caller gave up on it; one hung decode peer stalls only its own streams."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Callable

import pytest

from common.sampling_params import SampledToken
from common.protocol import AbortRequest, Fence, FenceQuery, KVFailed, KVReady, RequestFailed
from services.prefill.job import JobState
from services.prefill.lanes import Lanes
from tests.prefill.conftest import Make, clean
from tests.worker_fakes import (
    CONDUCTOR, DECODE_INBOX, EPOCH, fence_for, prefill_task,
    run_until,
)

async def until(done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_a_task_for_another_incarnation_or_a_replay_is_dropped(make: Make) -> None:
    rt, worker = make()
    worker.on_task(prefill_task("a", list(range(1, 11)), epoch=EPOCH - 1))
    assert not worker.waiting and worker.dropped == {"epoch": 1}
    worker.on_task(prefill_task("a", list(range(1, 11))))
    worker.on_task(prefill_task("a", list(range(1, 11)), fence=Fence(EPOCH, 9)))  # again
    assert [t.fence for t in worker.waiting] == [fence_for("a")]
    assert worker.dropped == {"epoch": 1, "duplicate": 1} and rt.mail.sent == []
    asyncio.run(run_until(worker.serve(), lambda: bool(rt.mail.of(KVReady)) and worker.idle()))
    assert rt.mail.of(KVReady) == [KVReady("a", [SampledToken(11)], 10, 0, fence_for("a"))]
    writes = len(rt.transfer.writes)
    worker.on_task(prefill_task("a", list(range(1, 11))))  # replayed after it was served
    assert not worker.waiting and worker.dropped == {"epoch": 1, "duplicate": 2}
    assert len(rt.transfer.writes) == writes
    clean(worker)


def test_the_queue_is_bounded_with_a_clear_error(make: Make) -> None:
    rt, worker = make()
    worker.max_waiting = 2
    for rid in "abc":
        worker.on_task(prefill_task(rid, list(range(1, 11))))
    assert [t.request_id for t in worker.waiting] == ["a", "b"]
    assert rt.mail.sent == [
        (DECODE_INBOX, KVFailed("c", "prefill_queue_full", fence_for("c"))),
        (CONDUCTOR, RequestFailed("c", 503, "prefill_queue_full",
                                  "2 prompts are queued on worker-0", fence=fence_for("c")))]
    worker.waiting.drop(lambda t: True)
    clean(worker)


def test_aborts_leave_no_state_behind(make: Make) -> None:
    """An abort of a queued task fails it at once (nothing was written); aborts of tasks
    the worker does not hold are ignored: no set grows with disconnects."""
    rt, worker = make()
    worker.on_task(prefill_task("a", list(range(1, 11))))
    for i in range(1000):
        worker.on_abort(AbortRequest(f"gone-{i}"))
    worker.on_abort(AbortRequest("a"))
    assert rt.mail.sent == [(DECODE_INBOX, KVFailed("a", "aborted", fence_for("a")))]
    assert vars(worker).keys().isdisjoint({"aborted"}) and not worker.waiting
    clean(worker)


def test_kv_failed_waits_for_a_running_write_to_land(make: Make) -> None:
    """The stream misses its deadline (1 s) while a write to a hung peer runs: no word to
    either side and no block freed until that write has returned."""
    rt, worker = make()
    rt.transfer.stall["fake-decode-0:1"] = gate = threading.Event()
    worker.on_task(prefill_task("a", list(range(1, 11)), deadline_s=0.2))

    async def go() -> None:
        serve = asyncio.ensure_future(worker.serve())
        await until(rt.transfer.started.is_set)
        await asyncio.sleep(1.5)  # past the stream's deadline
        # The write reads our blocks and lands in the decode worker's: nothing is said or
        # freed while it runs.
        assert rt.mail.sent == [] and rt.engine.pool.num_used == 3
        gate.set()
        await until(lambda: bool(rt.mail.sent) and worker.idle())
        serve.cancel()

    asyncio.run(go())
    assert rt.mail.kinds() == [(DECODE_INBOX, "KVFailed"), (CONDUCTOR, "RequestFailed")]
    assert rt.mail.of(KVFailed) == [KVFailed("a", "kv_transfer_failed", fence_for("a"))]
    # The running write finished before KVFailed; the one queued after it never started.
    assert [e[0] for e in rt.trace] == ["write", "send", "send"]
    clean(worker)


def test_kv_failed_waits_for_a_native_call_that_outlived_its_deadline(make: Make) -> None:
    """A write that missed its deadline failed the stream, but the native call still
    runs (the transfer agent reports it in flight): KVFailed waits for it too."""
    rt, worker = make()
    rt.transfer.fail = "transfer to fake-decode-0:1 missed its 30.0s deadline"
    rt.transfer.hung.append(native := Future())
    worker.on_task(prefill_task("a", list(range(1, 11))))

    async def go() -> None:
        serve = asyncio.ensure_future(worker.serve())
        await until(lambda: len(rt.transfer.trace) >= 2)  # both layers' writes failed
        await asyncio.sleep(0.3)
        assert rt.mail.sent == [] and rt.engine.pool.num_used == 3
        native.set_result(0)
        await until(lambda: bool(rt.mail.sent) and worker.idle())
        serve.cancel()

    asyncio.run(go())
    assert rt.mail.kinds() == [(DECODE_INBOX, "KVFailed"), (CONDUCTOR, "RequestFailed")]
    assert rt.mail.of(KVFailed) == [KVFailed("a", "kv_transfer_failed", fence_for("a"))]
    clean(worker)


def test_one_hung_decode_peer_does_not_stall_another(make: Make) -> None:
    rt, worker = make()
    rt.transfer.stall["fake-decode-0:1"] = gate = threading.Event()
    worker.on_task(prefill_task("a", list(range(1, 11)), decode_id="decode-0"))
    worker.on_task(prefill_task("b", list(range(20, 30)), decode_id="decode-1"))

    async def go() -> None:
        serve = asyncio.ensure_future(worker.serve())
        await until(lambda: bool(rt.mail.of(KVReady)))
        assert [m.request_id for m in rt.mail.of(KVReady)] == ["b"]  # a is still stuck
        assert len(worker.threads.peers) == 2
        gate.set()
        await until(lambda: len(rt.mail.of(KVReady)) == 2 and worker.idle())
        serve.cancel()

    asyncio.run(go())
    clean(worker)


def test_lanes_are_one_thread_per_peer_and_bounded() -> None:
    lanes = Lanes(limit=2)
    a, b = lanes.get("decode-0"), lanes.get("decode-1")
    assert lanes.get("decode-0") is a and a is not b
    ran = threading.Event()
    gate = threading.Event()
    b.submit(gate.wait, 5)
    queued = b.submit(ran.set)
    c = lanes.get("decode-2")  # decode-1 is the least recently used: shut down
    assert len(lanes) == 2 and c not in (a, b) and lanes.get("decode-0") is a
    gate.set()
    queued.result(5)  # work queued in a retired lane still runs
    assert ran.is_set() and lanes.get("decode-1") is not b
    lanes.close()
    with pytest.raises(ValueError):
        Lanes(limit=0)


def test_a_fence_query_is_answered_only_when_no_write_can_land(make: Make) -> None:
    """Never received → released at once, and the task arriving later is dropped; queued →
    dropped and released; writing → no answer until its writes settle (then KVFailed)."""
    rt, worker = make()
    worker.on_fence_query(FenceQuery("x", fence_for("x"), DECODE_INBOX))
    assert rt.mail.sent == [(DECODE_INBOX, KVFailed("x", "released", fence_for("x")))]
    worker.on_task(prefill_task("x", list(range(1, 11))))  # late: must never write
    assert not worker.waiting and worker.dropped == {"duplicate": 1}
    worker.on_task(prefill_task("q", list(range(1, 11))))
    worker.on_fence_query(FenceQuery("q", fence_for("q"), DECODE_INBOX))
    assert not worker.waiting and rt.mail.of(KVFailed)[-1] == KVFailed(
        "q", "released", fence_for("q"))
    rt.mail.sent.clear()
    rt.transfer.stall["fake-decode-0:1"] = gate = threading.Event()
    worker.on_task(prefill_task("a", list(range(1, 11)), deadline_s=0.2))

    async def go() -> None:
        serve = asyncio.ensure_future(worker.serve())
        await until(rt.transfer.started.is_set)
        worker.on_fence_query(FenceQuery("a", fence_for("a"), DECODE_INBOX))  # computing
        await asyncio.sleep(1.5)  # past the stream's deadline: settling
        assert [(j.task.fence, j.state) for j in worker.jobs] == [(fence_for("a"),
                                                                  JobState.ENDING)]
        worker.on_fence_query(FenceQuery("a", fence_for("a"), DECODE_INBOX))
        assert rt.mail.sent == []  # a write still runs: nothing may be said
        gate.set()
        await until(lambda: bool(rt.mail.sent) and worker.idle())
        serve.cancel()

    asyncio.run(go())
    assert rt.mail.of(KVFailed) == [KVFailed("a", "kv_transfer_failed", fence_for("a"))]
    assert not worker.jobs
    clean(worker)


def test_a_re_run_queues_behind_its_aborted_older_attempt(make: Make) -> None:
    """A decode worker lost before the first token: the conductor aborts the attempt this
    worker is computing and re-runs the request, here again (one prefill worker). The
    re-run's task, under its new fence, is a replay while the old attempt is live and
    queues once it is aborted; it hands over, and the old fence never gets a KVReady."""
    rt, worker = make(budget=16)
    tokens = list(range(1, 11))
    old, new = fence_for("a"), Fence(EPOCH, 99)
    worker.on_task(prefill_task("a", tokens))
    seen = []

    def mid_step() -> None:
        worker.on_task(prefill_task("a", tokens, fence=new))  # the old one is live
        dropped = dict(worker.dropped)
        worker.on_abort(AbortRequest("a", "prefill_lost", old))
        worker.on_task(prefill_task("a", tokens, fence=new))
        seen.append((dropped, [t.fence for t in worker.waiting]))

    async def go() -> None:
        rt.engine.interrupt(asyncio.get_running_loop(), mid_step)
        await run_until(worker.serve(), lambda: bool(rt.mail.of(KVReady)) and worker.idle())

    asyncio.run(go())
    assert seen == [({"duplicate": 1}, [new])]
    assert [m.fence for m in rt.mail.of(KVReady)] == [new]
    assert [m.fence for m in rt.mail.of(KVFailed)] == [old]
    clean(worker)
