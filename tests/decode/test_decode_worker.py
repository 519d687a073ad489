"""The decode worker's policy on a fake engine (tests/worker_fakes.py): reservations, the
batch and its turns, stop conditions, aborts and deadlines, fencing (KV admitted only
under the live fence of a live reservation; blocks a writer may still write stay out of
the pool), grammars, each ending with every block free (block size 4; token t is followed
by t + 1 unless a test scripts otherwise; token t reads as the letter chr(ord("a") + t)).
n choices: test_decode_choices.py."""
from __future__ import annotations

import asyncio
import time

import pytest

from common.engine.config import DecodeInput
from common.sampling_params import SampledToken, SamplingParams
from common.protocol import (
    AbortRequest, BlocksReserved, Fence, FenceQuery, KVFailed, KVReady, RequestFailed,
    RequestFinished, ReserveFailed, TokenDelta, WorkerGone, WorkerLoad,
)
from tests.decode.decode_helpers import F1, Make, decode, deltas, finished, make  # noqa: F401
from tests.worker_fakes import (
    CONDUCTOR, EOS, EPOCH, BrokenGrammars, clean, fence_of, reserve, run_until,
)


def test_reservations_cover_prompt_and_max_tokens_up_to_the_context(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=4))  # 10 tokens: 3 blocks
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=4))  # a repeat: ignored
    worker.on_reserve(reserve("b", prompt_tokens=250, max_tokens=20))  # 256 at most
    assert rt.mail.sent == [
        (CONDUCTOR, BlocksReserved("a", "worker-0", [0, 1, 2], F1)),
        (CONDUCTOR, ReserveFailed("b", "worker-0", "needs 64 blocks, 13 free"))]
    assert worker.load() == WorkerLoad(queued=1)
    assert not worker.idle()
    worker.on_kv_failed(KVFailed("a", "prefill_kv_full", F1))
    assert finished(rt) == [("a", "kv_failed")]
    clean(worker)


def test_a_sequence_runs_to_max_tokens_and_frees_its_blocks(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=3))
    worker.on_kv_ready(KVReady("a", first=[SampledToken(7)], prompt_tokens=6,
                               cached_tokens=4, fence=F1))
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
    ({"stop": ("hx",)}, lambda t: EOS,  # at the end, held-back text is no stop string
     [([7], "", None, 1), ([], "h", "stop", 2)]),
])
def test_stop_conditions(make: Make, kw: dict, script: object, want: list) -> None:
    rt, worker = make()
    if script is not None:
        rt.engine.next_token = script  # type: ignore[assignment]
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=4, **kw))
    worker.on_kv_ready(KVReady("a", [SampledToken(7)], 6, 0, F1))
    decode(worker, lambda: bool(finished(rt)))
    assert deltas(rt) == want
    assert finished(rt) == [("a", want[-1][2])]
    clean(worker)


def test_beyond_max_batch_size_sequences_take_turns(make: Make) -> None:
    rt, worker = make(max_batch_size=2)
    for rid in "abc":  # 3 blocks each: a [0, 1, 2], b [3, 4, 5], c [6, 7, 8]
        worker.on_reserve(reserve(rid, prompt_tokens=6, max_tokens=4))
        worker.on_kv_ready(KVReady(rid, [SampledToken(7)], 6, 0, fence_of(rt, rid)))
    decode(worker, lambda: len(finished(rt)) == 3)
    batches = [["abc"[d.block_table[0] // 3] for d in step] for _, step in rt.engine.steps]
    assert batches == [["a", "b"], ["c", "a"], ["b", "c"], ["a", "b"], ["c"]]
    assert finished(rt) == [("a", "length"), ("b", "length"), ("c", "length")]
    clean(worker)


@pytest.mark.parametrize("confirm", [
    KVFailed("a", "aborted", F1),
    KVReady("a", [SampledToken(7)], 6, 0, F1),  # the KV landed anyway: not started
])
def test_an_abort_keeps_reserved_blocks_until_the_prefill_stops_writing(
        make: Make, confirm: object) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=4, deadline_s=0.0))
    worker.on_abort(AbortRequest("a"))
    worker.sweep()  # past the reservation's deadline: still held
    assert rt.engine.pool.num_used == 3 and not finished(rt)  # the prefill may still write
    worker.handlers[type(confirm)](confirm)
    assert rt.mail.sent[1:] == [(CONDUCTOR, RequestFinished("a", "worker-0", "abort", F1))]
    assert deltas(rt) == [] and not worker.running
    clean(worker)


def test_kv_is_admitted_only_under_the_live_fence(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=2))
    for fence in (Fence(EPOCH, 2), Fence(EPOCH + 1, 1), Fence()):  # not this reservation
        worker.on_kv_ready(KVReady("a", [SampledToken(7)], 6, 0, fence))
        worker.on_kv_failed(KVFailed("a", "aborted", fence))
    worker.on_kv_ready(KVReady("b", [SampledToken(7)], 6, 0, F1))  # the right fence, another request
    assert worker.dropped == {"KVReady": 4, "KVFailed": 3}
    assert list(worker.reserved) == ["a"] and not worker.running and deltas(rt) == []
    worker.on_kv_ready(KVReady("a", [SampledToken(7)], 6, 0, F1))
    decode(worker, lambda: bool(finished(rt)))
    assert deltas(rt) == [([7], "h", None, 1), ([8], "i", "length", 2)]
    assert rt.mail.of(RequestFinished) == [RequestFinished("a", "worker-0", "length", F1)]
    clean(worker)


def test_a_reservation_for_another_incarnation_is_dropped(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, epoch=EPOCH - 1))
    assert rt.mail.sent == [] and worker.dropped == {"ReserveBlocks": 1}
    clean(worker)


def test_an_old_generation_frees_only_its_own_blocks_never_the_new_ones(make: Make) -> None:
    """A re-run: the request's first reservation is aborted (its writer may be alive) and
    it reserves again; the first writer's late KVReady frees the old blocks and nothing
    else, and the new reservation runs on its own blocks under its own fence."""
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=2))  # [0, 1]
    worker.on_abort(AbortRequest("a", "prefill_lost"))
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=2, writer="prefill-1"))
    f2 = Fence(EPOCH, 2)
    assert rt.mail.of(BlocksReserved)[1] == BlocksReserved("a", "worker-0", [2, 3], f2)
    worker.on_kv_ready(KVReady("a", [SampledToken(9)], 6, 0, F1))  # the first writer, late
    assert rt.mail.of(RequestFinished) == [RequestFinished("a", "worker-0", "abort", F1)]
    assert worker.reserved["a"].blocks == [2, 3] and not worker.running
    assert rt.engine.pool.num_used == 2
    worker.on_kv_ready(KVReady("a", [SampledToken(9)], 6, 0, F1))  # replayed once more: stale now
    assert worker.dropped == {"KVReady": 1}
    worker.on_kv_ready(KVReady("a", [SampledToken(7)], 6, 0, f2))
    decode(worker, lambda: len(finished(rt)) == 2)
    assert [d.block_table for _, ds in rt.engine.steps for d in ds] == [[2, 3]]
    assert deltas(rt) == [([7], "h", None, 1), ([8], "i", "length", 2)]
    assert rt.mail.of(RequestFinished)[1] == RequestFinished("a", "worker-0", "length", f2)
    clean(worker)


def test_a_quarantine_ends_when_its_writer_incarnation_is_gone(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, writer="prefill-0", writer_epoch=1))
    worker.on_reserve(reserve("b", prompt_tokens=6, writer="prefill-1", writer_epoch=5))
    worker.on_abort(AbortRequest("a"))
    worker.on_abort(AbortRequest("b"))
    worker.on_worker_gone(WorkerGone("prefill-0", live_epoch=1))  # that one still lives
    worker.on_worker_gone(WorkerGone("prefill-2", live_epoch=9))  # not a writer here
    assert finished(rt) == [] and rt.engine.pool.num_used == 6
    worker.on_worker_gone(WorkerGone("prefill-0", live_epoch=2))  # restarted: 1 is dead
    assert finished(rt) == [("a", "abort")] and sorted(worker.quarantine) == [2]
    worker.on_kv_failed(KVFailed("b", "aborted", Fence(EPOCH, 2)))
    clean(worker)


def test_a_quarantined_reservation_asks_its_writer_every_second(make: Make) -> None:
    """The writer may never have received its task (e.g. the conductor that sent it
    died): asking it ends the quarantine in about a second, not at the last resort."""
    rt, worker = make()
    writer = "tcp://127.0.0.1:9"
    worker.on_reserve(reserve("a", prompt_tokens=6, writer_inbox=writer))
    worker.on_reserve(reserve("b", prompt_tokens=6, writer_inbox=writer))
    worker.on_abort(AbortRequest("a"))
    worker.sweep()
    worker.sweep()  # asked once a second, not once a sweep
    query = FenceQuery("a", F1, rt.inbox_address)
    assert [(to, m) for to, m in rt.mail.sent if isinstance(m, FenceQuery)] == [(writer, query)]
    worker.quarantine[F1.generation].next_query = 0.0
    worker.sweep()
    assert rt.mail.of(FenceQuery) == [query, query]  # no answer yet: asked again
    worker.on_kv_failed(KVFailed("a", "released", F1))  # the writer's word
    assert finished(rt) == [("a", "abort")] and not worker.quarantine
    worker.on_abort(AbortRequest("b"))
    worker.on_kv_failed(KVFailed("b", "aborted", Fence(EPOCH, 2)))
    clean(worker)


def test_the_last_resort_frees_a_quarantine_nobody_answers(make: Make) -> None:
    rt, worker = make()
    worker.quarantine_s = 0.05
    worker.on_reserve(reserve("a", prompt_tokens=6))
    worker.on_abort(AbortRequest("a"))
    worker.sweep()
    assert finished(rt) == []
    time.sleep(0.06)
    worker.sweep()
    assert finished(rt) == [("a", "abort")] and worker.dropped == {"quarantine_expired": 1}
    assert rt.mail.of(RequestFailed) == []  # the abort came from the conductor
    clean(worker)


def test_kv_that_never_comes_fails_the_request_and_holds_the_blocks(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=4, deadline_s=0.05))
    worker.on_reserve(reserve("b", prompt_tokens=6, max_tokens=4))
    worker.sweep()
    assert rt.mail.sent[2:] == []
    time.sleep(0.06)
    worker.sweep()
    # The writer may be alive, only slow: the blocks wait for its word.
    assert rt.mail.sent[2:] == [(CONDUCTOR, RequestFailed(
        "a", 504, "timeout", "KV cache did not arrive in time", fence=F1))]
    assert list(worker.reserved) == ["b"] and rt.engine.pool.num_used == 6
    worker.on_kv_failed(KVFailed("a", "aborted", F1))
    worker.on_kv_failed(KVFailed("b", "kv_transfer_failed", Fence(EPOCH, 2)))
    assert finished(rt) == [("a", "abort"), ("b", "kv_failed")]
    clean(worker)


def test_an_abort_of_a_running_sequence_ends_it_between_steps(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=10))
    worker.on_kv_ready(KVReady("a", [SampledToken(7)], 6, 0, F1))

    async def go() -> None:
        rt.engine.interrupt(asyncio.get_running_loop(), lambda: worker.on_abort(AbortRequest("a")))
        await run_until(worker.step_loop(), lambda: bool(finished(rt)))

    asyncio.run(go())
    assert deltas(rt) == [([7], "h", None, 1)]  # the step's token is not sent
    assert finished(rt) == [("a", "abort")]
    clean(worker)


def test_kv_for_an_unknown_request_is_ignored(make: Make) -> None:
    rt, worker = make()
    worker.on_kv_ready(KVReady("ghost", [SampledToken(7)], 6, 0, F1))
    worker.on_kv_failed(KVFailed("ghost", "aborted", F1))
    worker.on_abort(AbortRequest("ghost"))
    assert rt.mail.sent == [] and not worker.running
    assert worker.dropped == {"KVReady": 1, "KVFailed": 1}
    clean(worker)


def test_drops_are_counted_on_the_runtime_for_heartbeats(make: Make) -> None:
    from types import SimpleNamespace

    from common.worker import drop_counts

    rt, worker = make()
    worker.on_kv_ready(KVReady("ghost", [SampledToken(1)], 6, 0, Fence(EPOCH, 99)))
    assert worker.dropped is rt.dropped and rt.dropped == {"KVReady": 1}
    outboxes = SimpleNamespace(dropped={"tcp://a": 2, "tcp://b": 1})
    assert drop_counts(rt.dropped, outboxes) == {"KVReady": 1, "outbox_full": 3}
    clean(worker)


def test_a_grammar_this_worker_cannot_compile_fails_the_request_alone(make: Make) -> None:
    """The router compiled the schema, this worker cannot: the request fails with a 400
    naming response_format and its blocks are free; the worker goes on serving."""
    rt, worker = make()

    worker.grammars = BrokenGrammars()  # type: ignore[assignment]
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=3,
                              response_format='{"type":"json_object"}'))
    worker.on_kv_ready(KVReady("a", first=[SampledToken(7)], prompt_tokens=6,
                               cached_tokens=0, fence=F1))
    [failed] = rt.mail.of(RequestFailed, to=CONDUCTOR)
    assert (failed.request_id, failed.status, failed.fence) == ("a", 400, F1)
    assert "response_format" in failed.message and deltas(rt) == []
    clean(worker)


def test_kv_ready_waits_for_its_grammar_with_the_loop_free(make: Make) -> None:
    """A KVReady whose grammar is still compiling starts the request once it compiled,
    not on the event loop meanwhile (a compile of seconds would stop the heartbeats); the
    reservation stays live until then."""
    import asyncio

    class Compiling(BrokenGrammars):
        def __init__(self) -> None:
            self.done = asyncio.Event()

        def is_ready(self, params: SamplingParams) -> bool:
            return self.done.is_set()

        async def ready(self, params: SamplingParams) -> None:
            await self.done.wait()

        def matcher(self, params: SamplingParams) -> None:
            return None  # compiled, unconstrained here

    rt, worker = make()

    async def go() -> None:
        worker.grammars = grammars = Compiling()  # type: ignore[assignment]
        worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=3,
                                  response_format='{"type":"json_object"}'))
        worker.on_kv_ready(KVReady("a", first=[SampledToken(7)], prompt_tokens=6,
                                   cached_tokens=0, fence=F1))
        await asyncio.sleep(0.01)
        assert deltas(rt) == [] and "a" in worker.reserved  # still compiling
        grammars.done.set()
        await asyncio.sleep(0.01)
        assert [d[0] for d in deltas(rt)] == [[7]] and "a" not in worker.reserved

    asyncio.run(go())
    decode(worker, lambda: bool(finished(rt)))
    assert finished(rt) == [("a", "length")]
    clean(worker)
