"""The order a prefill worker computes its prompts in (common/scheduling/prefill_order.py
``PromptOrder``, services/prefill/queue.py): the rank alone, the queue's next prompt by what its pool holds, and the
worker letting a short prompt that arrives during a long one's chunks into the next step."""
from __future__ import annotations

import asyncio

import pytest

from common.kv.block_pool import BlockPool
from common.protocol import PrefillDone
from common.scheduling.prefill_order import PromptOrder
from services.prefill.queue import PromptQueue
from tests.prefill.conftest import Make, chunks, clean
from tests.worker_fakes import FAKE_BLOCK, fake_keys, prefill_task, run_until


def test_rank_shortest_first_until_a_prompt_has_waited_max_wait() -> None:
    order = PromptOrder(shortest=True, max_wait_s=10.0)
    short, long_new, long_old = order.rank(5, 100.0, 105.0), order.rank(500, 99.0, 105.0), \
        order.rank(500, 95.0, 105.0)
    assert short < long_new  # fewer tokens first, whatever the arrival
    assert long_old < short  # waited 10 s: before every younger prompt
    assert order.rank(5, 100.0, 105.0) < order.rank(5, 101.0, 105.0)  # equal: older first
    fifo = PromptOrder(shortest=False, max_wait_s=10.0)
    assert fifo.rank(500, 99.0, 105.0) < fifo.rank(5, 100.0, 105.0)


def test_next_ranks_by_the_tokens_the_pool_does_not_hold() -> None:
    """b's 11 tokens are 8 cached: 3 to compute, fewer than c's 6 (none cached)."""
    pool = BlockPool(8)
    a = list(range(1, 11))
    blocks = pool.allocate(3)
    pool.cache_full_blocks(blocks, [bytes.fromhex(k) for k in fake_keys(a)])
    pool.free(blocks)
    queue = PromptQueue(pool, FAKE_BLOCK)
    queue.append(prefill_task("c", list(range(60, 66))), arrived=1.0)
    queue.append(prefill_task("b", a[:8] + [50, 51, 52]), arrived=2.0)
    task, rank = queue.next([], now=3.0)
    assert task.request_id == "b" and rank == (1, 3.0, 2.0)
    queue.drop(lambda t: True)
    pool.check_idle()


@pytest.mark.parametrize("order, max_wait_s, steps", [
    ("shortest", 15.0, [[(100, 0, 16)], [(20, 0, 4), (100, 16, 28)], [(100, 28, 40)]]),
    ("shortest", 1e-6, [[(100, 0, 16)], [(100, 16, 32)], [(100, 32, 40), (20, 0, 4)]]),
    ("arrival", 15.0, [[(100, 0, 16)], [(100, 16, 32)], [(100, 32, 40), (20, 0, 4)]]),
])
def test_a_short_prompt_joins_the_next_step_of_a_long_one(
        make: Make, order: str, max_wait_s: float, steps: list) -> None:
    """b (4 tokens) arrives after the first of a's (40) steps of 16: shortest first, it
    takes the head of the next step; in arrival order, or once a has waited max_wait_s,
    it waits until a's last chunk leaves room."""
    rt, worker = make(budget=16, prefill_order=order)
    worker.waiting.order = PromptOrder(order == "shortest", max_wait_s)

    async def go() -> None:
        worker.on_task(prefill_task("a", list(range(100, 140))))
        await worker.admit()
        await worker.step()
        worker.on_task(prefill_task("b", list(range(20, 24))))
        await run_until(worker.serve(),
                        lambda: len(rt.mail.of(PrefillDone)) == 2 and worker.idle())

    asyncio.run(go())
    assert [[c[:3] for c in step] for step in chunks(rt.engine)] == steps
    clean(worker)
