"""A queued prompt holds the prefix it was priced as reusing (services/prefill/queue.py):
exact holds on a real block pool (blocks of 4 tokens, tests/worker_fakes.py), then the
prefill worker keeping a queued prompt's prefix while the prompt ahead fills the pool."""
from __future__ import annotations

import asyncio
from dataclasses import replace

from common.kv.block_pool import BlockPool
from common.protocol import PrefillDone, RequestFailed
from services.prefill.queue import PromptQueue
from services.prefill.service import PrefillWorker
from tests.prefill.conftest import Make, clean
from tests.worker_fakes import FAKE_BLOCK, FakeRuntime, fake_keys, prefill_task, run_until

A = list(range(1, 11))  # 2 full blocks and a partial one


def cached(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Compute ``tokens`` into fresh blocks, publish the full ones and free them all."""
    blocks = pool.allocate(-(-len(tokens) // FAKE_BLOCK))
    keys = [bytes.fromhex(k) for k in fake_keys(tokens)]
    pool.cache_full_blocks(blocks, keys)
    pool.free(blocks)
    return blocks[:len(keys)]


def test_a_queued_prompt_holds_its_cached_prefix_until_it_leaves() -> None:
    pool = BlockPool(8)
    prefix = cached(pool, A)
    queue = PromptQueue(pool, FAKE_BLOCK)
    queue.append(prefill_task("b", A[:8] + [50, 51, 52]))
    queue.append(prefill_task("c", [60, 61, 62, 63, 64]))  # nothing cached: holds nothing
    assert [pool.ref_count(b) for b in prefix] == [1, 1] and queue.held_blocks == 2
    filler = pool.allocate(pool.num_free)  # the prompts ahead take every free block
    assert pool.peek_prefix([bytes.fromhex(k) for k in fake_keys(A)]) == 2
    pool.free(filler)
    assert [t.request_id for t in queue.drop(lambda t: t.request_id == "b")] == ["b"]
    assert queue.held_blocks == 0 and [t.request_id for t in queue] == ["c"]
    queue.drop(lambda t: True)
    pool.check_idle()


def test_an_admitted_prompt_holds_until_released_and_again_when_put_back() -> None:
    pool = BlockPool(8)
    prefix = cached(pool, A)
    queue = PromptQueue(pool, FAKE_BLOCK)
    queue.append(prefill_task("b", A[:8] + [50]), arrived=5.0)
    task, _ = queue.next([])
    assert queue.take(task) == 5.0
    assert not queue and queue.held_blocks == 2  # out for admission, still holding
    queue.release(task)
    queue.release(task)  # once only
    assert queue.held_blocks == 0 and pool.num_used == 0
    queue.append(task, 5.0)
    assert [pool.ref_count(b) for b in prefix] == [1, 1]
    queue.drop(lambda t: True)
    pool.check_idle()


def test_holds_count_distinct_blocks_within_the_cap() -> None:
    """b and c share A's 2 blocks (2 held); d's own 2 blocks would make 4 > 3: d holds
    nothing and reuses what is left when it is admitted."""
    pool = BlockPool(16)
    prefix, other = cached(pool, A), cached(pool, list(range(20, 29)))
    queue = PromptQueue(pool, FAKE_BLOCK, cap=3)
    for rid, tokens in (("b", A[:8] + [50]), ("c", A), ("d", list(range(20, 29)))):
        queue.append(prefill_task(rid, tokens))
    assert queue.held_blocks == 2
    assert [pool.ref_count(b) for b in prefix + other] == [2, 2, 0, 0]
    queue.drop(lambda t: t.request_id == "b")
    assert [pool.ref_count(b) for b in prefix] == [1, 1] and queue.held_blocks == 2
    queue.drop(lambda t: True)
    pool.check_idle()


def test_release_all_stops_holding_until_a_prompt_is_admitted() -> None:
    pool = BlockPool(8)
    cached(pool, A)
    queue = PromptQueue(pool, FAKE_BLOCK)
    queue.append(prefill_task("b", A[:8] + [50]))
    assert queue.release_all() and not queue.release_all()
    queue.append(prefill_task("c", A))
    assert queue.held_blocks == 0 and pool.num_used == 0
    queue.resume()
    queue.append(prefill_task("d", A))
    assert queue.held_blocks == 2
    queue.drop(lambda t: True)
    pool.check_idle()


def test_a_prompt_needing_no_prefix_holds_none() -> None:
    pool = BlockPool(8)
    cached(pool, A)
    queue = PromptQueue(pool, FAKE_BLOCK)
    task = prefill_task("b", A)  # every row's logits: computed whole
    task = replace(task, sampling=replace(task.sampling, prompt_logprobs=1))
    queue.append(task)
    assert queue.held_blocks == 0 and queue.next([]) is not None
    queue.drop(lambda t: True)
    pool.check_idle()


async def served(rt: FakeRuntime, worker: PrefillWorker, n: int) -> None:
    """Run the worker until ``n`` prompts have reported and it is idle."""
    await run_until(worker.serve(), lambda: len(rt.mail.of(PrefillDone)) == n and worker.idle())


def test_the_worker_keeps_a_queued_prompts_prefix_while_the_one_ahead_fills_the_pool(
        make: Make) -> None:
    """a and c are cached (a's blocks least recently freed); x, queued first, needs every
    never-used block and one cached one. b, queued behind it, was priced as reusing a's 8
    tokens: x evicts c's block instead of a's, and b reuses all 8."""
    rt, worker = make(num_blocks=10, budget=64, prefill_order="arrival")

    async def go() -> None:  # one event loop for all: the worker's Event binds to it
        for n, (rid, tokens) in enumerate((("a", A), ("c", list(range(100, 109))))):
            worker.on_task(prefill_task(rid, tokens))
            await served(rt, worker, n + 1)
        worker.on_task(prefill_task("x", list(range(200, 228))))  # 7 blocks: 6 never used
        worker.on_task(prefill_task("b", A[:8] + [50, 51, 52]))
        await served(rt, worker, 4)

    asyncio.run(go())
    done = {m.request_id: m for m in rt.mail.of(PrefillDone)}
    assert (done["x"].cached_tokens, done["b"].cached_tokens) == (0, 8)
    clean(worker)


def test_holds_give_way_when_the_oldest_prompt_needs_their_blocks(make: Make) -> None:
    """x needs all 8 blocks with nothing computing; b's hold on a's 2 blocks would fail it
    (prefill_kv_full). The holds are dropped instead: x computes, then b, without a."""
    rt, worker = make(num_blocks=8, budget=64, prefill_order="arrival")

    async def go() -> None:
        worker.on_task(prefill_task("a", A))
        await served(rt, worker, 1)
        worker.on_task(prefill_task("x", list(range(200, 232))))
        worker.on_task(prefill_task("b", A[:8] + [50, 51, 52]))
        assert worker.waiting.held_blocks == 2
        await served(rt, worker, 3)

    asyncio.run(go())
    assert not rt.mail.of(RequestFailed)
    done = {m.request_id: m for m in rt.mail.of(PrefillDone)}
    assert (done["x"].cached_tokens, done["b"].cached_tokens) == (0, 0)
    assert worker.waiting.holding  # x was admitted: holding again
    clean(worker)
