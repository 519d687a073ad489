"""Which prompt chunks a colocated step computes within its token budget."""
from __future__ import annotations

from common.protocol import Fence, PrefillTask
from common.sampling_params import SamplingParams
from common.engine.batching import plan_chunks
from services.colocated.service import Prefilling
from services.decode.sequence import Reservation


def job(rid: str, n: int, done: int = 0, aborted: bool = False) -> Prefilling:
    task = PrefillTask(request_id=rid, token_ids=list(range(n)), block_keys=[],
                       sampling=SamplingParams(max_tokens=1), decode_id="c",
                       decode_inbox="tcp://c", decode_session="h:1", decode_kv_base=0,
                       decode_block_ids=[], deadline=0.0)
    r = Reservation(rid, [], n, None, "tcp://r", 0.0, Fence(1, 1))  # type: ignore[arg-type]
    return Prefilling(task=task, reservation=r, keys=[], prompt_len=n, done=done,
                      cached_tokens=done, global_tokens=0, stored_from=0, aborted=aborted)


def test_oldest_first_and_the_last_one_is_chunked() -> None:
    a, b, c = job("a", 100, done=40), job("b", 50), job("c", 80)
    assert [(p.task.request_id, n) for p, n in plan_chunks([a, b, c], 128)] == [
        ("a", 60), ("b", 50), ("c", 18)]


def test_aborted_and_finished_prompts_take_no_budget() -> None:
    a, b, c = job("a", 30, aborted=True), job("b", 20, done=20), job("c", 200)
    assert [(p.task.request_id, n) for p, n in plan_chunks([a, b, c], 64)] == [("c", 64)]


def test_no_budget_no_chunks() -> None:
    assert plan_chunks([job("a", 10)], 0) == []
    assert plan_chunks([job("a", 10)], -3) == []


def test_the_step_after_continues_where_this_one_ends() -> None:
    a, b, c = job("a", 300), job("b", 40), job("c", 500)
    this = plan_chunks([a, b, c], 256)
    assert [(p.task.request_id, n) for p, n in this] == [("a", 256)]
    after = plan_chunks([a, b, c], 256, this)
    assert [(p.task.request_id, n) for p, n in after] == [("a", 44), ("b", 40), ("c", 172)]
    assert a.remaining == 300  # a prediction: nothing moved
    assert plan_chunks([a], 256, plan_chunks([a], 300)) == []
