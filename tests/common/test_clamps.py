"""Sender-chosen deadlines and periods are clamped by their receiver to its own limits
(common/security.py: ``clamp_deadline``, ``clamp_interval``): a peer cannot hold a decode
worker's blocks, a prefill or colocated worker's queue slot, or a store node's copier past
the receiver's configured maximum, nor make a node beat in a busy loop."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from types import MethodType, SimpleNamespace
from typing import Iterator

import pytest

from common.config import StoreConfig
from common.security import clamp_deadline, clamp_interval
from common.store import protocol as p
from services.colocated.service import ColocatedWorker
from services.decode.service import DecodeWorker
from services.prefill.service import PrefillWorker
from services.store_node.server import MIN_BEAT_S, NodeServer
from tests.worker_fakes import Workers, fence_of, prefill_task, reserve

FOREVER_S = 1e9  # what a hostile sender asks for
KV_WAIT_S = 60.0  # ClusterConfig().kv_wait_timeout_s, the workers' limit


@pytest.fixture
def workers() -> Iterator[Workers]:
    made = Workers()
    yield made
    made.close()


def test_clamp_deadline_and_interval() -> None:
    assert clamp_deadline(1e12, 60.0, now=1000.0) == 1060.0
    assert clamp_deadline(1010.0, 60.0, now=1000.0) == 1010.0  # a nearer one stays
    assert clamp_deadline(900.0, 60.0, now=1000.0) == 900.0  # a past one stays past
    assert [clamp_interval(v, 0.05, 10.0) for v in (0.0, -1.0, 0.5, 1e9)] == [
        0.05, 0.05, 0.5, 10.0]


def test_decode_reservation_deadline_is_clamped(workers: Workers) -> None:
    _, worker = workers.build(DecodeWorker, "decode")
    before = time.time()
    worker.on_reserve(reserve("far", prompt_tokens=4, deadline_s=FOREVER_S))
    worker.on_reserve(reserve("near", prompt_tokens=4, deadline_s=5.0))
    far, near = worker.reserved["far"].deadline, worker.reserved["near"].deadline
    assert before + KV_WAIT_S <= far <= time.time() + KV_WAIT_S
    assert near < before + 6.0  # the sender's own, shorter deadline is kept


def test_prefill_task_deadline_is_clamped(workers: Workers) -> None:
    _, worker = workers.build(PrefillWorker, "prefill")
    before = time.time()
    worker.on_task(prefill_task("far", list(range(1, 9)), deadline_s=FOREVER_S))
    worker.on_task(prefill_task("near", list(range(1, 9)), deadline_s=5.0))
    far, near = (t.deadline for t in worker.waiting)
    assert before + KV_WAIT_S <= far <= time.time() + KV_WAIT_S
    assert near < before + 6.0


def test_colocated_task_deadline_is_clamped(workers: Workers) -> None:
    rt, worker = workers.build(ColocatedWorker, "colocated")

    async def admit() -> float:
        worker.on_reserve(reserve("far", prompt_tokens=8, deadline_s=FOREVER_S))
        worker.on_task(prefill_task("far", list(range(1, 9)), deadline_s=FOREVER_S,
                                    fence=fence_of(rt, "far")))
        while not worker.prefilling:
            await asyncio.sleep(0.01)
        return worker.prefilling[0].task.deadline

    before = time.time()
    deadline = asyncio.run(asyncio.wait_for(admit(), 5))
    assert before + KV_WAIT_S <= deadline <= time.time() + KV_WAIT_S
    assert worker.prefilling[0].reservation.deadline <= time.time() + KV_WAIT_S


@pytest.fixture
def node() -> Iterator[SimpleNamespace]:
    """What NodeServer's handlers read, without a segment or a transfer engine."""
    ns = SimpleNamespace(store=StoreConfig(), last_ack=0.0, heartbeat_s=0.5,
                         copier=ThreadPoolExecutor(1))
    ns._beat = MethodType(NodeServer._beat, ns)
    yield ns
    ns.copier.shutdown()


@pytest.mark.parametrize("asked,beat", [(0.0, MIN_BEAT_S), (0.001, MIN_BEAT_S), (0.5, 0.5),
                                        (1e9, StoreConfig().register_deadline_s)])
def test_store_node_heartbeat_period_is_clamped(node: SimpleNamespace, asked: float,
                                                beat: float) -> None:
    assert NodeServer.on_ack(node, p.NodeAck(True, asked)) is None
    assert node.heartbeat_s == beat


@pytest.mark.parametrize("asked,limit", [(1e9, StoreConfig().policy.put_timeout_s / 2),
                                         (1.0, 1.0), (-5.0, 0.0)])
def test_store_node_replicate_start_window_is_clamped(node: SimpleNamespace, asked: float,
                                                      limit: float) -> None:
    starts: list[float] = []

    async def command() -> float:
        node._replicate = lambda msg, start_by: starts.append(start_by)
        node._done = lambda msg, fut: None
        t0 = time.monotonic()
        await NodeServer.on_command(node, p.NodeCommandMsg(
            "replicate", "k", 0, 16, source={"node_id": "n"}, start_within_s=asked))
        while not starts:
            await asyncio.sleep(0.01)
        return starts[0] - t0

    window = asyncio.run(command())
    assert limit <= window < limit + 0.5
