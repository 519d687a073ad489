"""The decode worker's policy on a fake engine (tests/worker_fakes.py): reservations, the
batch and its turns, stop conditions, aborts and deadlines, each ending with every block
free (block size 4; token t is followed by t + 1 unless a test scripts otherwise; token t
reads as the letter chr(ord("a") + t))."""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterator

import pytest

from common.engine.config import DecodeInput
from common.protocol import (
    AbortRequest, BlocksReserved, KVFailed, KVReady, RequestFailed, RequestFinished,
    ReserveFailed, TokenDelta, WorkerLoad,
)
from services.decode.service import DecodeWorker
from tests.worker_fakes import (
    CONDUCTOR, EOS, ROUTER_INBOX, FakeRuntime, Workers, reserve, run_until,
)

Make = Callable[..., tuple[FakeRuntime, DecodeWorker]]


@pytest.fixture
def make() -> Iterator[Make]:
    workers = Workers()
    yield lambda **kw: workers.build(DecodeWorker, "decode", **kw)
    workers.close()


def clean(worker: DecodeWorker) -> None:
    assert worker.idle()
    assert worker.idle_check.run()


def deltas(rt: FakeRuntime) -> list[tuple[list[int], str, object, int]]:
    return [(d.token_ids, d.text, d.finish_reason, d.completion_tokens)
            for d in rt.mail.of(TokenDelta, to=ROUTER_INBOX)]


def finished(rt: FakeRuntime) -> list[tuple[str, str]]:
    return [(m.request_id, m.finish_reason) for m in rt.mail.of(RequestFinished, to=CONDUCTOR)]


def decode(worker: DecodeWorker, done: Callable[[], bool]) -> None:
    asyncio.run(run_until(worker.step_loop(), done))


def test_reservations_cover_prompt_and_max_tokens_up_to_the_context(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=4))  # 10 tokens: 3 blocks
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=4))  # a repeat: ignored
    worker.on_reserve(reserve("b", prompt_tokens=250, max_tokens=20))  # 256 at most
    assert rt.mail.sent == [
        (CONDUCTOR, BlocksReserved("a", "worker-0", [0, 1, 2])),
        (CONDUCTOR, ReserveFailed("b", "worker-0", "needs 64 blocks, 13 free"))]
    assert worker.load() == WorkerLoad(queued=1)
    assert not worker.idle()
    worker.on_kv_failed(KVFailed("a", "prefill_kv_full"))
    assert finished(rt) == [("a", "kv_failed")]
    clean(worker)


def test_a_sequence_runs_to_max_tokens_and_frees_its_blocks(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=3))
    worker.on_kv_ready(KVReady("a", first_token=7, first_logprob=None, prompt_tokens=6,
                               cached_tokens=4))
    assert worker.load() == WorkerLoad(running=1, context_tokens=7)
    decode(worker, lambda: bool(finished(rt)))
    assert [d for _, d in rt.engine.steps] == [[DecodeInput(7, 6, [0, 1, 2])],
                                               [DecodeInput(8, 7, [0, 1, 2])]]
    assert deltas(rt) == [([7], "h", None, 1), ([8], "i", None, 2), ([9], "j", "length", 3)]
    assert rt.mail.of(TokenDelta)[-1].cached_tokens == 4
    assert finished(rt) == [("a", "length")]
    clean(worker)


@pytest.mark.parametrize("kw, script, want", [
    ({}, lambda t: EOS, [([7], "h", None, 1), ([], "", "stop", 2)]),
    ({"stop_token_ids": (8,)}, None, [([7], "h", None, 1), ([], "", "stop", 2)]),
    ({"ignore_eos": True}, lambda t: EOS,
     [([7], "h", None, 1), ([0], "a", None, 2), ([0], "a", None, 3), ([0], "a", "length", 4)]),
    ({"stop": ("ij",)}, None,  # text that could start the stop string is held back
     [([7], "", None, 1), ([8], "h", None, 2), ([9], "", "stop", 3)]),
])
def test_stop_conditions(make: Make, kw: dict, script: object, want: list) -> None:
    rt, worker = make()
    if script is not None:
        rt.engine.next_token = script  # type: ignore[assignment]
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=4, **kw))
    worker.on_kv_ready(KVReady("a", 7, None, 6, 0))
    decode(worker, lambda: bool(finished(rt)))
    assert deltas(rt) == want
    assert finished(rt) == [("a", want[-1][2])]
    clean(worker)


def test_beyond_max_batch_size_sequences_take_turns(make: Make) -> None:
    rt, worker = make(max_batch_size=2)
    for rid in "abc":  # 3 blocks each: a [0, 1, 2], b [3, 4, 5], c [6, 7, 8]
        worker.on_reserve(reserve(rid, prompt_tokens=6, max_tokens=4))
        worker.on_kv_ready(KVReady(rid, 7, None, 6, 0))
    decode(worker, lambda: len(finished(rt)) == 3)
    batches = [["abc"[d.block_table[0] // 3] for d in step] for _, step in rt.engine.steps]
    assert batches == [["a", "b"], ["c", "a"], ["b", "c"], ["a", "b"], ["c"]]
    assert finished(rt) == [("a", "length"), ("b", "length"), ("c", "length")]
    clean(worker)


@pytest.mark.parametrize("confirm, reason", [
    (KVFailed("a", "aborted"), "kv_failed"),
    (KVReady("a", 7, None, 6, 0), "abort"),  # the KV landed anyway: not started
])
def test_an_abort_keeps_reserved_blocks_until_the_prefill_stops_writing(
        make: Make, confirm: object, reason: str) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=4))
    worker.on_abort(AbortRequest("a"))
    worker.sweep()
    assert rt.engine.pool.num_used == 3 and not finished(rt)  # the prefill may still write
    worker.handlers[type(confirm)](confirm)
    assert finished(rt) == [("a", reason)]
    assert deltas(rt) == [] and not worker.running
    clean(worker)


def test_an_aborted_reservation_without_confirmation_is_freed_at_its_deadline(
        make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=4, deadline_s=0.05))
    worker.on_abort(AbortRequest("a"))
    time.sleep(0.06)
    worker.sweep()
    assert finished(rt) == [("a", "abort")]
    assert rt.mail.of(RequestFailed) == []  # the abort came from the conductor
    clean(worker)


def test_kv_that_never_comes_frees_the_blocks_at_the_deadline(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=4, deadline_s=0.05))
    worker.on_reserve(reserve("b", prompt_tokens=6, max_tokens=4))
    worker.sweep()
    assert finished(rt) == []
    time.sleep(0.06)
    worker.sweep()
    assert rt.mail.sent[2:] == [
        (CONDUCTOR, RequestFinished("a", "worker-0", "kv_timeout")),
        (CONDUCTOR, RequestFailed("a", 504, "timeout", "KV cache did not arrive in time"))]
    assert list(worker.reserved) == ["b"] and rt.engine.pool.num_used == 3
    worker.on_kv_failed(KVFailed("b", "kv_transfer_failed"))
    clean(worker)


def test_an_abort_of_a_running_sequence_ends_it_between_steps(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=10))
    worker.on_kv_ready(KVReady("a", 7, None, 6, 0))

    async def go() -> None:
        rt.engine.interrupt(asyncio.get_running_loop(), lambda: worker.on_abort(AbortRequest("a")))
        await run_until(worker.step_loop(), lambda: bool(finished(rt)))

    asyncio.run(go())
    assert deltas(rt) == [([7], "h", None, 1)]  # the step's token is not sent
    assert finished(rt) == [("a", "abort")]
    clean(worker)


def test_kv_for_an_unknown_request_is_ignored(make: Make) -> None:
    rt, worker = make()
    worker.on_kv_ready(KVReady("ghost", 7, None, 6, 0))
    worker.on_kv_failed(KVFailed("ghost", "aborted"))
    worker.on_abort(AbortRequest("ghost"))
    assert rt.mail.sent == [] and not worker.running
    clean(worker)
