"""The prefill worker's policy on a fake engine and transfer agent (tests/worker_fakes.py):
admission, chunks within the token budget, prefix reuse, and every way a prompt fails,
each leaving the pool with no block referenced (block size 4, 2 layers: a layer of a
block is 64 bytes, a whole block 128)."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from typing import Callable, Optional

import pytest

from common.engine.errors import EngineInputError
from common.idle_check import IdleCheck
from common.sampling_params import SampledToken
from common.protocol import (
    AbortRequest, KVFailed, KVReady, PrefillDone, RequestFailed, WorkerLoad,
)
from services.prefill.service import PrefillWorker
from tests.worker_fakes import (
    CONDUCTOR, DECODE_INBOX, BrokenGrammars, fence_for, prefill_task, run_until,
)

from tests.prefill.conftest import Make, chunks, clean

LAYER, BLOCK = 64, 128


def serve(worker: PrefillWorker, done: Callable[[], bool]) -> None:
    asyncio.run(run_until(worker.serve(), done))


def test_batch_invariant_chunks_end_at_block_boundaries(make: Make) -> None:
    """With batch_invariant a prompt's chunks end at multiples of ``chunk_align()`` (the
    config's 16-token blocks) or at its end, where the engine cuts its attention parts
    too: d behind a takes the last boundary that fits (80 of the 86 tokens left)."""
    a, d = [1] + list(range(2, 11)), list(range(50, 200))
    rt, worker = make(num_blocks=48, budget=96, batch_invariant=True)
    assert rt.config.chunk_align() == 16
    for rid, tokens in (("a", a), ("d", d)):
        worker.on_task(prefill_task(rid, tokens))
    serve(worker, lambda: len(rt.mail.of(PrefillDone)) == 2 and worker.idle())
    table = list(range(3, 41))
    assert chunks(rt.engine) == [[(1, 0, 10, [0, 1, 2]), (50, 0, 80, table)],
                                 [(50, 80, 150, table)]]
    clean(worker)


@pytest.mark.parametrize("order, first_step", [
    ("arrival", [(1, 0, 10, [0, 1, 2]), (20, 0, 4, [3]), (30, 0, 2, [4, 5, 6])]),
    ("shortest", [(20, 0, 4, [0]), (1, 0, 10, [1, 2, 3]), (30, 0, 2, [4, 5, 6])]),
])
def test_prompts_batch_in_order_within_the_token_budget(make: Make, order: str,
                                                        first_step: list) -> None:
    """In arrival order a, b, c; shortest first b (4 tokens), then a and c (10 each: the
    older first). The rest of c takes the second step either way."""
    rt, worker = make(budget=16, prefill_order=order)
    a, b, c = [1] + list(range(2, 11)), list(range(20, 24)), list(range(30, 40))
    for rid, tokens in (("a", a), ("b", b), ("c", c)):
        worker.on_task(prefill_task(rid, tokens))
    assert worker.load() == WorkerLoad(queued=3, queued_tokens=24)
    serve(worker, lambda: len(rt.mail.of(PrefillDone)) == 3 and worker.idle())
    assert chunks(rt.engine) == [first_step, [(30, 2, 10, [4, 5, 6])]]
    ready = {m.request_id: m for m in rt.mail.of(KVReady, to=DECODE_INBOX)}
    assert ready == {"a": KVReady("a", [SampledToken(11)], 10, 0, fence_for("a")), "b": KVReady("b", [SampledToken(24)], 4, 0, fence_for("b")),
                     "c": KVReady("c", [SampledToken(40)], 10, 0, fence_for("c"))}
    done = {m.request_id: m for m in rt.mail.of(PrefillDone, to=CONDUCTOR)}
    # Each chunk streams the blocks it wrote, per layer: c's block 0 in both of its chunks.
    assert {r: (d.prompt_tokens, d.cached_tokens, d.transfer_bytes) for r, d in done.items()} \
        == {"a": (10, 0, 3 * 2 * LAYER), "b": (4, 0, 2 * LAYER), "c": (10, 0, 4 * 2 * LAYER)}
    assert worker.load() == WorkerLoad()
    assert rt.engine.pool.num_cached == 5  # full blocks: 2 of a, 1 of b, 2 of c
    clean(worker)


def test_a_cached_prefix_is_reused_and_sent_whole(make: Make) -> None:
    rt, worker = make(budget=16)
    first = list(range(1, 11))

    async def go() -> None:  # one event loop for both: the worker's Event binds to it
        worker.on_task(prefill_task("a", first))
        await run_until(worker.serve(), lambda: bool(rt.mail.of(PrefillDone)) and worker.idle())
        worker.on_task(prefill_task("b", first[:8] + [50, 51, 52]))
        await run_until(worker.serve(),
                        lambda: len(rt.mail.of(PrefillDone)) == 2 and worker.idle())

    asyncio.run(go())
    assert chunks(rt.engine)[1] == [(1, 8, 11, [0, 1, 3])]
    assert rt.mail.of(KVReady)[1] == KVReady("b", [SampledToken(53)], 11, 8, fence_for("b"))
    done = rt.mail.of(PrefillDone)[1]
    assert (done.cached_tokens, done.global_hit_tokens) == (8, 0)
    assert done.transfer_bytes == 2 * BLOCK + 2 * LAYER  # the prefix whole, then block 2
    clean(worker)


@pytest.mark.parametrize("order", ["arrival", "shortest"])
def test_a_prefix_being_computed_here_is_waited_for_not_computed_twice(
        make: Make, order: str) -> None:
    """b shares a's first 8 tokens (2 blocks) and arrives while a computes: it starts once
    a published them and computes its own tail only. c, behind b, is not held up by b's
    wait, in either order."""
    rt, worker = make(budget=64, prefill_order=order)
    first = list(range(1, 11))
    for rid, tokens in (("a", first), ("b", first[:8] + [50, 51, 52]),
                        ("c", list(range(60, 72)))):
        worker.on_task(prefill_task(rid, tokens))
    serve(worker, lambda: len(rt.mail.of(PrefillDone)) == 3 and worker.idle())
    assert chunks(rt.engine) == [[(1, 0, 10, [0, 1, 2]), (60, 0, 12, [3, 4, 5])],
                                 [(1, 8, 11, [0, 1, 6])]]
    done = {m.request_id: m for m in rt.mail.of(PrefillDone)}
    assert (done["b"].cached_tokens, done["c"].cached_tokens) == (8, 0)
    clean(worker)


def test_a_prompt_waits_for_kv_memory_held_by_a_running_one(make: Make) -> None:
    rt, worker = make(num_blocks=8, budget=64, prefill_order="arrival")
    worker.on_task(prefill_task("a", list(range(1, 21))))  # 5 blocks
    worker.on_task(prefill_task("b", list(range(30, 46))))  # 4 blocks: 3 free
    serve(worker, lambda: len(rt.mail.of(PrefillDone)) == 2 and worker.idle())
    # b starts once a has handed over: the 3 never-used blocks, then a's tail.
    assert chunks(rt.engine) == [[(1, 0, 20, [0, 1, 2, 3, 4])], [(30, 0, 16, [5, 6, 7, 4])]]
    clean(worker)


def test_kv_memory_full_with_nothing_running_fails_the_prompt(make: Make) -> None:
    rt, worker = make(num_blocks=4)
    held = rt.engine.pool.allocate(3)
    worker.on_task(prefill_task("a", list(range(1, 9))))
    asyncio.run(worker.admit())
    assert rt.mail.sent == [
        (DECODE_INBOX, KVFailed("a", "prefill_kv_full", fence_for("a"))),
        (CONDUCTOR, RequestFailed("a", 503, "prefill_kv_full", "prefill KV memory is full",
                                   fence=fence_for("a")))]
    rt.engine.pool.free(held)
    clean(worker)


@pytest.mark.parametrize("case, status, kind, message", [
    ("aborted", 499, "aborted", None),
    ("late", 504, "timeout", "deadline passed while queued"),
    ("too_long", 400, "invalid_request_error", "prompt of 65 tokens; 1 to 64 fit"),
    ("few_decode_blocks", 500, "internal_error",
     "decode reserved fewer blocks than the prompt needs"),
])
def test_a_prompt_failing_before_its_first_step(make: Make, case: str, status: int, kind: str,
                                                message: Optional[str]) -> None:
    rt, worker = make()
    tokens = list(range(1, 66 if case == "too_long" else 11))
    task = prefill_task("a", tokens, deadline_s=-1 if case == "late" else 30,
                        decode_blocks=[100, 101] if case == "few_decode_blocks" else None)
    worker.on_task(task)
    if case == "aborted":
        worker.on_abort(AbortRequest("a"))
    asyncio.run(worker.admit())
    want = [(DECODE_INBOX, KVFailed("a", kind, fence_for("a")))]
    if message is not None:  # an abort is the conductor's own news
        want.append((CONDUCTOR, RequestFailed("a", status, kind, message, fence=fence_for("a"))))
    assert rt.mail.sent == want
    assert rt.engine.steps == [] and not worker.waiting
    clean(worker)


def test_a_failed_kv_stream_frees_the_blocks_and_fails_the_request(make: Make) -> None:
    rt, worker = make()
    rt.transfer.fail = "link down"
    worker.on_task(prefill_task("a", list(range(1, 11))))
    serve(worker, lambda: bool(rt.mail.sent) and worker.idle())
    assert rt.mail.sent == [
        (DECODE_INBOX, KVFailed("a", "kv_transfer_failed", fence_for("a"))),
        (CONDUCTOR, RequestFailed("a", 503, "kv_transfer_failed", "link down", fence=fence_for("a")))]
    clean(worker)


def test_a_kv_stream_past_the_deadline_frees_blocks_after_its_write_lands(make: Make) -> None:
    rt, worker = make()
    rt.transfer.hold_s = 0.6  # two layers: 1.2 s, the stream is given 1 s
    worker.on_task(prefill_task("a", list(range(1, 11)), deadline_s=0.2))
    serve(worker, lambda: bool(rt.mail.sent) and worker.idle())
    assert rt.mail.kinds() == [(DECODE_INBOX, "KVFailed"), (CONDUCTOR, "RequestFailed")]
    failed = rt.mail.of(RequestFailed)[0]
    assert (failed.status, failed.error_type) == (503, "kv_transfer_failed")
    assert "missed its 1.0s deadline" in failed.message
    # The write in flight read our blocks: they were freed only after it landed.
    assert [e[0] for e in rt.trace] == ["write", "write", "send", "send"]
    clean(worker)


def test_a_prompt_past_its_deadline_between_steps_is_dropped(make: Make) -> None:
    rt, worker = make(budget=4)
    rt.engine.gate = gate = threading.Event()
    worker.on_task(prefill_task("a", list(range(1, 13)), deadline_s=0.2))
    threading.Timer(0.4, gate.set).start()  # the first step ends after the deadline
    serve(worker, lambda: bool(rt.mail.sent) and worker.idle())
    assert rt.mail.sent == [
        (DECODE_INBOX, KVFailed("a", "timeout", fence_for("a"))),
        (CONDUCTOR, RequestFailed("a", 504, "timeout", "prefill missed its deadline",
                                   fence=fence_for("a")))]
    assert len(rt.engine.steps) == 1
    clean(worker)


def test_an_abort_during_a_step_drops_the_prompt_after_it(make: Make) -> None:
    rt, worker = make(budget=16)
    worker.on_task(prefill_task("a", list(range(1, 11))))

    async def go() -> None:
        rt.engine.interrupt(asyncio.get_running_loop(), lambda: worker.on_abort(AbortRequest("a")))
        await run_until(worker.serve(), lambda: bool(rt.mail.sent) and worker.idle())

    asyncio.run(go())
    # Its last chunk ran, but it is not handed over; nothing was streamed after the abort.
    assert rt.mail.sent == [(DECODE_INBOX, KVFailed("a", "aborted", fence_for("a")))]
    assert rt.transfer.writes == []
    clean(worker)


def test_an_engine_error_fails_the_step_prompts_and_keeps_serving(make: Make) -> None:
    rt, worker = make(budget=16)
    rt.engine.fail = EngineInputError("bad block table")
    worker.on_task(prefill_task("a", list(range(1, 11))))

    async def go() -> None:
        await run_until(worker.serve(), lambda: bool(rt.mail.of(KVFailed)) and worker.idle())
        assert rt.mail.sent == [
            (CONDUCTOR, RequestFailed("a", 500, "internal_error",
                                      "prefill failed: bad block table", fence=fence_for("a"))),
            (DECODE_INBOX, KVFailed("a", "aborted", fence_for("a")))]
        worker.on_task(prefill_task("b", list(range(1, 11))))
        await run_until(worker.serve(), lambda: bool(rt.mail.of(PrefillDone)) and worker.idle())

    asyncio.run(go())
    assert rt.mail.of(KVReady) == [KVReady("b", [SampledToken(11)], 10, 0, fence_for("b"))]
    clean(worker)


def test_a_bug_in_a_prompts_ending_fails_it_instead_of_losing_it(make: Make) -> None:
    """An exception in the task that ends a prompt (a bug) is logged and fails the
    request with a 500; before, it vanished with the task and the client waited."""
    rt, worker = make(budget=16)

    def broken(stream) -> None:
        raise RuntimeError("boom")

    worker.kv_paths.done = broken
    worker.on_task(prefill_task("a", list(range(1, 11))))
    serve(worker, lambda: bool(rt.mail.of(RequestFailed)) and not worker._settling)
    [failed] = rt.mail.of(RequestFailed, to=CONDUCTOR)
    assert (failed.status, failed.error_type) == (500, "internal_error")
    assert "boom" in failed.message
    assert rt.mail.of(KVFailed, to=DECODE_INBOX) and not rt.mail.of(KVReady)


def test_idle_check_watches_only_while_idle(make: Make) -> None:
    rt, worker = make()
    worker.idle_check = check = IdleCheck(rt.engine.pool.check_idle, "KV block pool",
                                              interval_s=0.01, strict=True)
    worker.on_task(prefill_task("a", list(range(1, 11))))

    async def go() -> None:
        watch = asyncio.create_task(check.watch(worker.idle))
        await asyncio.sleep(0.05)
        assert check.checks == 0  # a task is queued: no check
        await run_until(worker.serve(), lambda: bool(rt.mail.of(PrefillDone)) and worker.idle())
        started = time.monotonic()
        while check.checks == 0 and time.monotonic() - started < 2:
            await asyncio.sleep(0.01)
        watch.cancel()

    asyncio.run(go())
    assert check.checks > 0 and check.violations == 0


def test_a_grammar_this_worker_cannot_compile_fails_the_request_alone(make: Make) -> None:
    """The first token is sampled under the request's grammar; one this worker cannot
    compile fails the request with a 400 (blocks freed, the decode side told), and the
    next prompt is served."""
    rt, worker = make()

    worker.grammars = BrokenGrammars()  # type: ignore[assignment]
    task = prefill_task("a", list(range(1, 11)))
    worker.on_task(replace(task, sampling=replace(task.sampling,
                                                  response_format='{"type":"json_object"}')))
    worker.on_task(prefill_task("b", list(range(20, 30))))
    serve(worker, lambda: len(rt.mail.sent) >= 3 and worker.idle())
    failed = rt.mail.of(RequestFailed, to=CONDUCTOR)
    assert [(f.request_id, f.status, f.error_type) for f in failed] == [
        ("a", 400, "invalid_request_error")] and "response_format" in failed[0].message
    assert KVFailed("a", "invalid_request_error", fence_for("a")) in rt.mail.of(KVFailed)
    assert [m.request_id for m in rt.mail.of(KVReady)] == ["b"]
    clean(worker)
