"""The colocated worker on a fake engine (tests/worker_fakes.py): a request's reservation,
its prompt's chunks and decode steps in one engine, prefix reuse, and an abort mid-step,
each ending with every block free (block size 4)."""
from __future__ import annotations

import asyncio
from typing import Callable, Iterator

import pytest

from common.protocol import (
    AbortRequest, BlocksReserved, Fence, PrefillDone, RequestFailed, RequestFinished,
    TokenDelta,
)
from services.colocated.service import ColocatedWorker
from tests.worker_fakes import (
    EPOCH, BrokenGrammars, FakeEngine, FakeRuntime, fence_of, prefill_task, reserve, run_until,
    workers_of,
)

Make = Callable[[], tuple[FakeRuntime, ColocatedWorker]]
PROMPT = list(range(1, 11))


@pytest.fixture
def make() -> Iterator[Make]:
    yield from workers_of(ColocatedWorker, "colocated")


def steps(engine: FakeEngine) -> list[tuple[list, list]]:
    """Each step as ([(start, end, block table) per chunk], [(token, position) per decode])."""
    return [([(c.start, c.end, c.block_table) for c in cs], [(d.token_id, d.position) for d in ds])
            for cs, ds in engine.steps]


def finished(rt: FakeRuntime) -> list[tuple[str, str]]:
    return [(m.request_id, m.finish_reason) for m in rt.mail.of(RequestFinished)]


async def request(rt: FakeRuntime, worker: ColocatedWorker, rid: str, tokens: list[int]) -> None:
    """Reserve, send the prompt, and step until the request is finished."""
    worker.on_reserve(reserve(rid, prompt_tokens=len(tokens), max_tokens=3))
    await request_task(rt, worker, rid, tokens)


async def request_task(rt: FakeRuntime, worker: ColocatedWorker, rid: str,
                       tokens: list[int] = PROMPT) -> None:
    """Send the prompt of a reserved request and step until it is finished."""
    worker.on_task(prefill_task(rid, tokens, fence=fence_of(rt, rid)))
    assert not worker.idle()
    await run_until(worker.step_loop(), lambda: rid in dict(finished(rt)) and worker.idle())


def test_a_request_prefills_decodes_and_frees_its_blocks(make: Make) -> None:
    rt, worker = make()
    asyncio.run(request(rt, worker, "a", PROMPT))
    assert rt.mail.of(BlocksReserved) == [BlocksReserved("a", "worker-0", [0, 1, 2, 3],
                                                                Fence(EPOCH, 1))]
    assert steps(rt.engine) == [([(0, 10, [0, 1, 2, 3])], []), ([], [(11, 10)]),
                                ([], [(12, 11)])]
    done = rt.mail.of(PrefillDone)[0]
    assert (done.prompt_tokens, done.cached_tokens, done.global_hit_tokens) == (10, 0, 0)
    assert [(d.token_ids, d.finish_reason) for d in rt.mail.of(TokenDelta)] == [
        ([11], None), ([12], None), ([13], "length")]
    assert finished(rt) == [("a", "length")]
    assert worker.idle_check.run()


def test_a_cached_prefix_replaces_the_head_of_the_reservation(make: Make) -> None:
    rt, worker = make()

    async def go() -> None:
        await request(rt, worker, "a", PROMPT)
        await request(rt, worker, "b", PROMPT[:8] + [50, 51])

    asyncio.run(go())
    # b reserved [4, 5, 6, 7]; a's cached blocks 0 and 1 stand in for 4 and 5.
    assert rt.mail.of(BlocksReserved)[1].block_ids == [4, 5, 6, 7]
    assert steps(rt.engine)[3] == ([(8, 10, [0, 1, 6, 7])], [])
    assert rt.mail.of(PrefillDone)[1].cached_tokens == 8
    assert worker.idle_check.run()


def test_an_abort_during_a_prefill_step_frees_the_blocks_after_it(make: Make) -> None:
    rt, worker = make()

    async def go() -> None:
        rt.engine.interrupt(asyncio.get_running_loop(), lambda: worker.on_abort(AbortRequest("a")))
        worker.on_reserve(reserve("a", prompt_tokens=10, max_tokens=3))
        worker.on_task(prefill_task("a", PROMPT, fence=fence_of(rt, "a")))
        await run_until(worker.step_loop(), lambda: bool(finished(rt)) and worker.idle())

    asyncio.run(go())
    assert finished(rt) == [("a", "abort")]
    assert rt.mail.of(PrefillDone) == [] and rt.mail.of(TokenDelta) == []
    assert len(rt.engine.steps) == 1
    assert worker.idle_check.run()


def test_a_task_for_another_incarnation_or_reservation_is_dropped(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=10, max_tokens=3))
    live = fence_of(rt, "a")
    worker.on_task(prefill_task("a", PROMPT, fence=live, epoch=EPOCH + 1))
    worker.on_task(prefill_task("a", PROMPT, fence=Fence(EPOCH, live.generation + 1)))
    worker.on_task(prefill_task("b", PROMPT, fence=live))  # no reservation for b
    assert worker.dropped == {"PrefillTask": 3} and not worker.prefilling
    assert list(worker.reserved) == ["a"]
    asyncio.run(request_task(rt, worker, "a"))
    assert finished(rt) == [("a", "length")] and worker.idle_check.run()


def test_a_grammar_this_worker_cannot_compile_fails_the_request_alone(make: Make) -> None:
    """The first token is sampled under the request's grammar: one this worker cannot
    compile fails that request (400, blocks freed) and the step loop goes on."""
    rt, worker = make()

    worker.grammars = BrokenGrammars()  # type: ignore[assignment]

    async def go() -> None:
        worker.on_reserve(reserve("a", prompt_tokens=10, max_tokens=3,
                                  response_format='{"type":"json_object"}'))
        worker.on_task(prefill_task("a", PROMPT, fence=fence_of(rt, "a")))
        await request(rt, worker, "b", list(range(20, 30)))

    asyncio.run(go())
    [failed] = rt.mail.of(RequestFailed)
    assert (failed.request_id, failed.status) == ("a", 400)
    assert finished(rt) == [("b", "length")] and worker.idle_check.run()
