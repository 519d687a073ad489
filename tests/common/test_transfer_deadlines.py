"""Deadlines of the transfer wrapper (common/transfer.py) around a native engine that
hangs: the caller's wait is bounded, the hung call stays in flight until it returns, and
its peer fails fast meanwhile while other peers are served."""
from __future__ import annotations

import asyncio
import gc
import threading
from dataclasses import replace
from typing import Iterator

import pytest

from common.transfer import TransferAgent, TransferConfig, TransferError

HUNG, OTHER = "10.0.0.1:1", "10.0.0.2:1"


class HangingEngine:
    """The native calls the wrapper makes: those to ``HUNG`` wait for ``release``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.fail_after_release = False
        self.calls: list[str] = []

    def _call(self, target: str) -> int:
        self.calls.append(target)
        if target == HUNG and not self.release.wait(10):
            raise RuntimeError("test never released the hung call")
        return -1 if target == HUNG and self.fail_after_release else 0

    def batch_transfer_sync_write(self, target: str, *_: object) -> int:
        return self._call(target)

    def batch_transfer_sync_read(self, target: str, *_: object) -> int:
        return self._call(target)


@pytest.fixture
def agent() -> Iterator[tuple[TransferAgent, HangingEngine]]:
    a = TransferAgent(TransferConfig(call_timeout_s=0.2))
    real, fake = a._engine, HangingEngine()
    a._engine = fake
    # one synchronous native call per write (the path off TCP), which the fake can hang
    a.config = replace(a.config, protocol="rdma")
    yield a, fake
    fake.release.set()
    a._engine = real
    a.close()


def test_a_hung_write_is_bounded_stays_in_flight_and_marks_its_peer(agent) -> None:
    a, engine = agent
    with pytest.raises(TransferError, match="missed its 0.2s deadline"):
        a.write(HUNG, [1], [2], [8])
    [native] = a.in_flight(HUNG)
    assert not native.done() and a.in_flight(OTHER) == [] and a.in_flight() == [native]
    with pytest.raises(TransferError, match="marked bad"):  # at once, not after 0.2 s
        a.write(HUNG, [1], [2], [8])
    assert a.write(OTHER, [1], [2], [8]) == 8  # another peer is served meanwhile
    assert engine.calls == [HUNG, OTHER]
    engine.release.set()
    native.result(5)
    assert a.in_flight() == []
    assert a.write(HUNG, [1], [2], [8]) == 8  # its call returned: usable again


def test_a_timed_out_async_read_is_still_in_flight(agent) -> None:
    a, engine = agent

    async def go() -> None:
        with pytest.raises(TransferError, match="missed its 0.1s deadline"):
            await a.read_async(HUNG, [1], [2], [8], timeout=0.1)
        [native] = a.in_flight()
        assert not native.done()
        engine.release.set()
        await asyncio.wrap_future(native)
        assert a.in_flight() == []
        assert await a.read_async(HUNG, [1], [2], [8], timeout=1) == 8

    asyncio.run(go())


def test_a_timed_out_call_that_fails_later_leaves_no_unretrieved_error(agent) -> None:
    """Nobody awaits a call past its deadline; its late failure must not surface as
    asyncio's "Future exception was never retrieved" in the worker's log."""
    a, engine = agent
    engine.fail_after_release = True
    unhandled: list[dict] = []

    async def go() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unhandled.append(ctx))
        with pytest.raises(TransferError, match="missed its 0.1s deadline"):
            await a.write_async(HUNG, [1], [2], [8], timeout=0.1)
        [native] = a.in_flight()
        engine.release.set()
        with pytest.raises(TransferError, match="rc=-1"):
            await asyncio.wrap_future(native)
        del native
        await asyncio.sleep(0.05)  # the wrapper's asyncio future settles on the loop
        gc.collect()

    asyncio.run(go())
    assert unhandled == []
