"""What the decode worker's tests share (tests/worker_fakes.py holds the fakes): the
worker factory fixture, the first reservation's fence, and what the worker sent."""
from __future__ import annotations

import asyncio
from typing import Callable, Iterator

import pytest

from common.protocol import Fence, RequestFinished, TokenDelta
from services.decode.service import DecodeWorker
from tests.worker_fakes import CONDUCTOR, EPOCH, ROUTER_INBOX, FakeRuntime, run_until, workers_of

F1 = Fence(EPOCH, 1)  # the first reservation's fence

Make = Callable[..., tuple[FakeRuntime, DecodeWorker]]


@pytest.fixture
def make() -> Iterator[Make]:
    yield from workers_of(DecodeWorker, "decode")


def deltas(rt: FakeRuntime) -> list[tuple[list[int], str, object, int]]:
    return [(d.token_ids, d.text, d.finish_reason, d.completion_tokens)
            for d in rt.mail.of(TokenDelta, to=ROUTER_INBOX)]


def finished(rt: FakeRuntime) -> list[tuple[str, str]]:
    return [(m.request_id, m.finish_reason) for m in rt.mail.of(RequestFinished, to=CONDUCTOR)]


def decode(worker: DecodeWorker, done: Callable[[], bool]) -> None:
    asyncio.run(run_until(worker.step_loop(), done))
