"""A short prompt's step inside a long one (services/prefill/preempt.py): the compute
thread's layer boundaries, and the prefill worker on fakes (tests/worker_fakes.py: block
size 4, 2 layers) running a short prompt's step between two layers of a long one's."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import pytest

from common.engine.config import PrefillChunk
from common.protocol import KVReady, PrefillDone
from common.sampling_params import SampledToken
from services.prefill.preempt import LayerPreemption
from tests.prefill.conftest import Make, chunks, clean
from tests.worker_fakes import CONDUCTOR, DECODE_INBOX, fence_for, prefill_task, run_until

LONG, SHORT = list(range(1, 13)), [40, 41, 42]


@pytest.fixture
def compute() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(1)
    yield pool
    pool.shutdown()


def long_step(preempt: LayerPreemption, order: list[str], started: threading.Event,
              posted: threading.Event, layers: int = 3) -> float:
    """A step of ``layers`` layers that runs what waits at each boundary; layer 0 waits
    until a preempting step is posted."""
    paused = 0.0
    started.set()
    for layer in range(layers):
        if layer == 0:
            assert posted.wait(5)
        order.append(f"long {layer}")
        paused += preempt.at_boundary()
    return paused


def test_a_step_posted_during_another_runs_at_its_next_layer_boundary(
        compute: ThreadPoolExecutor) -> None:
    preempt: LayerPreemption = LayerPreemption(compute)
    order: list[str] = []
    started, posted = threading.Event(), threading.Event()

    def short() -> str:
        time.sleep(0.02)
        order.append("short")
        return "first token"

    async def go() -> tuple[float, str]:
        long = asyncio.get_running_loop().run_in_executor(
            compute, long_step, preempt, order, started, posted)
        await asyncio.to_thread(started.wait, 5)
        result = preempt.submit(short)
        posted.set()
        return await long, await result

    paused, result = asyncio.run(go())
    assert order == ["long 0", "short", "long 1", "long 2"]
    assert result == "first token"
    assert 0.02 <= paused < 1.0  # what the long step excludes from its own time
    assert not preempt.pending


def test_with_no_step_computing_it_runs_next(compute: ThreadPoolExecutor) -> None:
    preempt: LayerPreemption = LayerPreemption(compute)

    async def go() -> str:
        return await preempt.submit(lambda: threading.current_thread().name)

    assert asyncio.run(go()).startswith("ThreadPoolExecutor")
    assert preempt.at_boundary() == 0.0  # taken: nothing waits


def test_its_error_reaches_the_caller_and_the_long_step_goes_on(
        compute: ThreadPoolExecutor) -> None:
    preempt: LayerPreemption = LayerPreemption(compute)
    order: list[str] = []
    started, posted = threading.Event(), threading.Event()

    def broken() -> None:
        raise ValueError("bad chunk")

    async def go() -> None:
        long = asyncio.get_running_loop().run_in_executor(
            compute, long_step, preempt, order, started, posted)
        await asyncio.to_thread(started.wait, 5)
        result = preempt.submit(broken)
        with pytest.raises(RuntimeError, match="waiting already"):
            preempt.submit(broken)
        posted.set()
        await long
        with pytest.raises(ValueError, match="bad chunk"):
            await result

    asyncio.run(go())
    assert order == ["long 0", "long 1", "long 2"]


# ---------------------------------------------------------------- the prefill worker
def layered(make: Make, **config: object):
    """A worker whose engine records (first token of each chunk, layer) as it computes;
    the first step's layer 0 waits until the short prompt's step is posted (if one is)."""
    rt, worker = make(num_blocks=16, budget=16, **config)
    layers: list[tuple[tuple[int, ...], int]] = []
    first_step = threading.Event()

    def compute_layer(cs: Sequence[PrefillChunk], layer: int) -> None:
        if not first_step.is_set():
            first_step.set()
            deadline = time.monotonic() + 0.5
            while not worker.steps.preempt.pending and time.monotonic() < deadline:
                time.sleep(0.001)
        layers.append((tuple(c.token_ids[0] for c in cs), layer))

    rt.engine.compute_layer = compute_layer
    return rt, worker, layers


def serve_with_arrival(rt, worker, done) -> None:
    """Serve; the short prompt arrives once the first step (the long prompt's) is under
    way."""
    async def go() -> None:
        rt.engine.interrupt(asyncio.get_running_loop(),
                            lambda: worker.on_task(prefill_task("s", SHORT)))
        await run_until(worker.serve(), done)
    asyncio.run(go())


def test_a_short_prompt_arriving_mid_step_runs_between_two_of_its_layers(make: Make) -> None:
    rt, worker, layers = layered(make)
    worker.on_task(prefill_task("l", LONG))
    serve_with_arrival(rt, worker, lambda: len(rt.mail.of(PrefillDone)) == 2 and worker.idle())
    # the long prompt's one step (12 tokens within the budget of 16) pauses after layer 0
    assert layers == [((1,), 0), ((40,), 0), ((40,), 1), ((1,), 1)]
    assert chunks(rt.engine) == [[(1, 0, 12, [0, 1, 2])], [(40, 0, 3, [3])]]
    ready = [m.request_id for m in rt.mail.of(KVReady, to=DECODE_INBOX)]
    assert ready == ["s", "l"]  # the short one is handed over first
    assert rt.mail.of(KVReady, to=DECODE_INBOX)[0] == KVReady(
        "s", [SampledToken(43)], 3, 0, fence_for("s"))
    done = {m.request_id: m.prompt_tokens for m in rt.mail.of(PrefillDone, to=CONDUCTOR)}
    assert done == {"s": 3, "l": 12}
    clean(worker)


@pytest.mark.parametrize("config, why", [
    ({"prefill_preempt_tokens": 0}, "preemption off"),
    ({"prefill_preempt_tokens": 2}, "the short prompt is over the limit"),
    ({"prefill_max_wait_s": 1e-6}, "the long prompt has waited its longest: not paused"),
])
def test_otherwise_it_waits_for_the_step(make: Make, config: dict, why: str) -> None:
    rt, worker, layers = layered(make, **config)
    worker.on_task(prefill_task("l", LONG))
    serve_with_arrival(rt, worker, lambda: len(rt.mail.of(PrefillDone)) == 2 and worker.idle())
    assert layers == [((1,), 0), ((1,), 1), ((40,), 0), ((40,), 1)], why
    assert [m.request_id for m in rt.mail.of(KVReady, to=DECODE_INBOX)] == ["l", "s"]
    clean(worker)
