"""The SIGTERM drain (common/drain.py): wait for in-flight work, then stop; bounded."""
from __future__ import annotations

import asyncio

import pytest

from common.drain import FLUSH_S, Drain


async def serve(drain: Drain) -> tuple[asyncio.Task, list[str]]:
    """A main task that runs until cancelled; what it saw goes in the list."""
    seen: list[str] = []

    async def main() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    task = asyncio.get_running_loop().create_task(main())
    await asyncio.sleep(0)
    return task, seen


def test_nothing_registered_stops_at_once() -> None:
    async def go() -> list[str]:
        drain = Drain(5.0)
        task, seen = await serve(drain)
        drain.begin(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen + [str(drain.active)]

    assert asyncio.run(go()) == ["cancelled", "False"]


def test_stops_once_idle_and_wakes_a_sleeping_heartbeat() -> None:
    async def go() -> tuple[float, float, bool]:
        loop = asyncio.get_running_loop()
        busy = [True]
        drain = Drain(5.0)
        drain.until(lambda: not busy[0], lambda: busy.append("left"))
        task, _ = await serve(drain)
        beat = loop.create_task(drain.sleep(30))  # a heartbeat between beats
        await asyncio.sleep(0)
        start = loop.time()
        drain.begin(task)
        await beat  # woken at once, to say "draining"
        woke = loop.time() - start
        assert drain.active and not task.done()
        await asyncio.sleep(0.3)
        assert not task.done()  # still busy: still serving
        busy[0] = False
        with pytest.raises(asyncio.CancelledError):
            await task
        assert busy == [False, "left"]
        return woke, loop.time() - start, drain.active

    woke, stopped, active = asyncio.run(go())
    assert woke < 0.05 and 0.3 + FLUSH_S <= stopped < 0.3 + FLUSH_S + 0.2 and active


def test_time_up_leaves_anyway_then_stops() -> None:
    async def go() -> tuple[list[str], float]:
        loop = asyncio.get_running_loop()
        ended: list[str] = []
        drain = Drain(0.2)
        drain.until(lambda: False, lambda: ended.append("left"))
        task, _ = await serve(drain)
        start = loop.time()
        drain.begin(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        return ended, loop.time() - start

    ended, took = asyncio.run(go())
    assert ended == ["left"] and 0.2 + FLUSH_S <= took < 0.2 + FLUSH_S + 0.2


def test_a_second_sigterm_stops_at_once() -> None:
    async def go() -> bool:
        drain = Drain(30.0)
        drain.until(lambda: False)
        task, _ = await serve(drain)
        drain.begin(task)
        await asyncio.sleep(0.05)
        drain.begin(task)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 1.0)
        return True

    assert asyncio.run(go())
