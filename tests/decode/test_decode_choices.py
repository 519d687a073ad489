"""The decode worker's n choices on a fake engine (tests/worker_fakes.py): they share the
prompt's full blocks, copy its partial one, end one by one, and a continuation counts its
resumed tokens (block size 4; token t is followed by t + 1 unless a test scripts
otherwise)."""
from __future__ import annotations

from common.engine.config import DecodeInput
from common.sampling_params import SampledToken
from common.protocol import (
    AbortRequest, BlocksReserved, KVReady, RequestFailed, TokenDelta, WorkerLoad,
)
from tests.decode.decode_helpers import F1, Make, decode, deltas, finished, make  # noqa: F401
from tests.worker_fakes import CONDUCTOR, EOS, clean, reserve

def test_n_choices_share_the_prompts_full_blocks_and_copy_its_partial_one(make: Make) -> None:
    """n=3, a 6-token prompt, max_tokens 3: 9 tokens need 3 blocks of 4. Choice 0 gets
    them; choices 1 and 2 share the prompt's one full block and own 2 each, the first a
    copy of the prompt's partial block: 3 + 2 + 2 = 7 blocks, not 9."""
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=3, n=3))
    assert rt.mail.sent == [(CONDUCTOR, BlocksReserved("a", "worker-0", [0, 1, 2], F1))]
    assert rt.engine.pool.num_used == 7
    kv = rt.engine.kv
    kv.data[1] = 5.0  # what the prefill wrote into the prompt's partial block
    worker.on_kv_ready(KVReady("a", [SampledToken(7), SampledToken(3), SampledToken(5)],
                               prompt_tokens=6, cached_tokens=0, fence=F1))
    tables = {key: s.blocks for key, s in worker.running.items()}
    assert tables == {("a", 0): [0, 1, 2], ("a", 1): [0, 3, 4], ("a", 2): [0, 5, 6]}
    assert [rt.engine.pool.ref_count(b) for b in range(7)] == [3, 1, 1, 1, 1, 1, 1]
    assert bool((kv.data[3] == 5.0).all()) and bool((kv.data[5] == 5.0).all())
    assert worker.load() == WorkerLoad(running=3, context_tokens=21)
    decode(worker, lambda: bool(finished(rt)))
    by_choice = {i: [(d.token_ids, d.finish_reason) for d in rt.mail.of(TokenDelta)
                     if d.index == i] for i in range(3)}
    assert by_choice == {0: [([7], None), ([8], None), ([9], "length")],
                         1: [([3], None), ([4], None), ([5], "length")],
                         2: [([5], None), ([6], None), ([7], "length")]}
    steps = [d for _, d in rt.engine.steps]
    assert steps[0] == [DecodeInput(7, 6, [0, 1, 2]), DecodeInput(3, 6, [0, 3, 4]),
                        DecodeInput(5, 6, [0, 5, 6])]
    assert finished(rt) == [("a", "length")]  # once, with the last choice
    clean(worker)


def test_a_prompt_ending_on_a_block_boundary_shares_every_prompt_block(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=8, max_tokens=2, n=2))  # 10: 3 blocks
    assert rt.engine.pool.num_used == 3 + 1
    worker.on_kv_ready(KVReady("a", [SampledToken(7), SampledToken(7)], 8, 0, F1))
    assert [s.blocks for s in worker.running.values()] == [[0, 1, 2], [0, 1, 3]]
    decode(worker, lambda: bool(finished(rt)))
    clean(worker)


def test_choices_end_one_by_one_and_an_abort_ends_them_all(make: Make) -> None:
    rt, worker = make()
    rt.engine.next_token = lambda t: EOS if t == 3 else t + 1  # choice 1 stops at once
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=20, n=2))  # 7 + 6 blocks
    worker.on_kv_ready(KVReady("a", [SampledToken(7), SampledToken(3)], 6, 0, F1))
    batch = list(worker.running.values())  # one step, by hand
    worker.advance(batch, rt.engine.decode_logits(
        [DecodeInput(s.last_token, s.position, s.blocks) for s in batch]), None)
    assert list(worker.running) == [("a", 0)] and worker.choices == {"a": 1}
    assert finished(rt) == [] and rt.engine.pool.num_used == 7  # choice 1 freed its 6
    worker.on_abort(AbortRequest("a"))
    decode(worker, lambda: bool(finished(rt)))
    assert finished(rt) == [("a", "abort")]
    clean(worker)


def test_first_tokens_that_do_not_match_n_fail_the_request_and_free_it(make: Make) -> None:
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=3, n=2))
    worker.on_kv_ready(KVReady("a", [SampledToken(7)], 6, 0, F1))
    [failed] = rt.mail.of(RequestFailed)
    assert (failed.status, failed.fence) == (500, F1) and not worker.running
    clean(worker)


def test_a_continuation_counts_its_resumed_tokens_as_generated(make: Make) -> None:
    """Prompt of 4 and the 2 tokens the client had (8, 9: "ij"), max_tokens 4: two more
    tokens, numbered 3 and 4 of the answer; the usage counts the original prompt; the
    stop string spanning the boundary ("jk") is found."""
    rt, worker = make()
    worker.on_reserve(reserve("a", prompt_tokens=6, max_tokens=4, resumed=(8, 9),
                              resumed_chars=2))
    assert rt.mail.of(BlocksReserved)[0].block_ids == [0, 1]  # 6 + 2 new tokens: 2 blocks
    worker.on_kv_ready(KVReady("a", [SampledToken(10)], 6, 0, F1))
    decode(worker, lambda: bool(finished(rt)))
    assert deltas(rt) == [([10], "k", None, 3), ([11], "l", "length", 4)]
    assert {d.prompt_tokens for d in rt.mail.of(TokenDelta)} == {4}
    clean(worker)
    rt, worker = make()
    worker.on_reserve(reserve("b", prompt_tokens=6, max_tokens=4, resumed=(8, 9),
                              resumed_chars=1, stop=("jk",)))  # "j" was held back
    worker.on_kv_ready(KVReady("b", [SampledToken(10)], 6, 0, F1))
    decode(worker, lambda: bool(finished(rt)))
    assert deltas(rt) == [([10], "", "stop", 3)]
    clean(worker)
