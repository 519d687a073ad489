"""Decode batches beyond max_batch_size are served fairly: sequences take turns."""
from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from common.engine import Engine, EngineConfig
from common.config import ClusterConfig
from common.protocol import Fence, KVReady, ReserveBlocks, TokenDelta, TokenDeltas
from common.sampling_params import SampledToken, SamplingParams
from services.decode.service import DecodeWorker
from services.decode.turns import Turns
from tests.conductor.test_conductor import RecordingMail


def test_first_steps_exact() -> None:
    t = Turns()
    ids = [f"r{i}" for i in range(10)]
    steps = [t.next_batch(ids, 4) for _ in range(4)]
    assert steps == [["r0", "r1", "r2", "r3"], ["r4", "r5", "r6", "r7"],
                     ["r8", "r9", "r0", "r1"], ["r2", "r3", "r4", "r5"]]


def test_small_batches_keep_arrival_order() -> None:
    t = Turns()
    assert [t.next_batch(["a", "b", "c"], 4) for _ in range(3)] == [["a", "b", "c"]] * 3


@pytest.mark.parametrize("n, max_batch", [(10, 4), (7, 7), (9, 2), (64, 63), (5, 1)])
def test_no_sequence_waits_more_than_ceil_n_over_max(n: int, max_batch: int) -> None:
    t = Turns()
    ids = [f"r{i}" for i in range(n)]
    last = {rid: -1 for rid in ids}
    served = {rid: 0 for rid in ids}
    bound = math.ceil(n / max_batch)
    for step in range(5 * bound + 3):
        batch = t.next_batch(ids, max_batch)
        assert len(batch) == min(n, max_batch) and len(set(batch)) == len(batch)
        for rid in batch:
            assert step - last[rid] <= bound, (rid, step, last[rid])
            last[rid] = step
            served[rid] += 1
        # Every sequence gets a step before any gets two (more).
        assert max(served.values()) - min(served.values()) <= 1
    assert all(step - seen <= bound for seen in last.values())


def test_joins_queue_behind_and_leavers_drop_out() -> None:
    t = Turns()
    assert t.next_batch(["a", "b", "c"], 2) == ["a", "b"]
    # "d" joined and "b" finished: c was waiting, then a (served before d joined), then d.
    assert t.next_batch(["a", "c", "d"], 2) == ["c", "a"]
    assert t.next_batch(["a", "c", "d"], 2) == ["d", "c"]
    assert t.next_batch([], 2) == [] and len(t) == 0
    with pytest.raises(ValueError, match="max_batch must be positive"):
        t.next_batch(["a"], 0)


def test_decode_worker_serves_every_sequence_within_ceil_n_over_max_steps() -> None:
    """A real DecodeWorker on a real (tiny) engine: 5 sequences, batches of 2. Every
    sequence gets its second token within ceil(5/2) = 3 steps; the old first-2 rule would
    have left three of them waiting until the first two finished."""
    engine = Engine(EngineConfig(model="dummy-tiny", num_blocks=64, block_size=16,
                                 max_batch_size=2))
    mail = RecordingMail()
    rt = SimpleNamespace(engine=engine, mail=mail, conductor="conductor",
                         instance_id="decode-0", epoch=1, handlers={}, dropped={},
                         config=ClusterConfig())
    worker = DecodeWorker(rt)  # type: ignore[arg-type]
    stepped: list[list[int]] = []
    real_step = engine.decode_step

    def spy(inputs):  # noqa: ANN001, ANN202
        stepped.append([worker_ids[tuple(i.block_table)] for i in inputs])
        return real_step(inputs)

    engine.decode_step = spy  # type: ignore[method-assign]
    sampling = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(5):
        worker.on_reserve(ReserveBlocks(f"r{i}", 8, sampling, "router", time.time() + 60,
                                        epoch=1))
        worker.on_kv_ready(KVReady(f"r{i}", first=[SampledToken(3)],
                                   prompt_tokens=8, cached_tokens=0, fence=Fence(1, i + 1)))
    worker_ids = {tuple(s.blocks): int(key[0][1:]) for key, s in worker.running.items()}

    async def run_steps(n: int) -> None:
        task = asyncio.create_task(worker.step_loop())
        while len(stepped) < n:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run_steps(4))  # the 4th step begins only after the 3rd's tokens went out
    assert stepped[:3] == [[0, 1], [2, 3], [4, 0]]
    tokens = {f"r{i}": 0 for i in range(5)}
    for _, msg in mail.sent:  # a step's deltas go out as one TokenDeltas
        for delta in msg.deltas if isinstance(msg, TokenDeltas) else [msg]:
            if isinstance(delta, TokenDelta):
                tokens[delta.request_id] += len(delta.token_ids)
    assert all(n >= 2 for n in tokens.values()), tokens
    worker.compute.shutdown(wait=True)
