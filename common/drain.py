"""Graceful drain: the first phase of a SIGTERM stop, one per process.

A service with work in flight tells the process's drain how to see that it is done
(``current().until(idle)``). On SIGTERM the bootstrap (common/service.py) calls ``begin``:
``active`` turns true at once — a worker says so in its heartbeats, so the conductor
places nothing new on it; the router answers new requests 503 — and once every ``idle()``
holds, or ``timeout_s`` has passed, each ``leave`` runs (a worker tells the conductor it
is going, so what it still holds fails or re-runs at once with a clear error) and the main
task is cancelled: ``run`` unwinds as on any stop.
A process that registered nothing stops at once, as does any process on SIGINT or on a
second SIGTERM.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

log = logging.getLogger("crescent.drain")

POLL_S = 0.05
# Outboxes close with linger 0 (common/mailbox.py): the last messages of the drain (a
# stream's final token) need a moment in ZeroMQ's I/O thread before the sockets go.
FLUSH_S = 0.2


class Drain:
    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self.active = False
        self._waiters: list[asyncio.Future] = []  # heartbeats sleeping (``sleep``)
        self._idle: list[Callable[[], bool]] = []
        self._leave: list[Callable[[], None]] = []
        self._task: Optional[asyncio.Task] = None

    def until(self, idle: Callable[[], bool],
              leave: Optional[Callable[[], None]] = None) -> None:
        """Drain until ``idle()``; then (or when time is up) ``leave()``."""
        self._idle.append(idle)
        if leave is not None:
            self._leave.append(leave)

    def idle(self) -> bool:
        return all(idle() for idle in self._idle)

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, waking early when the drain begins (a heartbeat says so)."""
        if self.active:
            await asyncio.sleep(seconds)
            return
        woken = asyncio.get_running_loop().create_future()
        self._waiters.append(woken)
        try:
            await asyncio.wait_for(woken, seconds)
        except TimeoutError:
            pass
        finally:
            self._waiters.remove(woken)

    def begin(self, main: asyncio.Task) -> None:
        """SIGTERM: start draining, then cancel ``main``; a second call cancels at once."""
        if self.active or not self._idle:
            main.cancel()
            return
        self.active = True
        for woken in self._waiters:
            if not woken.done():
                woken.set_result(None)
        log.info("SIGTERM: draining (up to %g s), taking no new work", self.timeout_s)
        self._task = asyncio.get_running_loop().create_task(self._finish(main))

    async def _finish(self, main: asyncio.Task) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not self.idle():
            if loop.time() - start >= self.timeout_s:
                log.warning("drain: still busy after %g s; leaving anyway", self.timeout_s)
                break
            await asyncio.sleep(POLL_S)
        else:
            log.info("drain: idle after %.2f s", loop.time() - start)
        for leave in self._leave:
            try:
                leave()
            except Exception:  # noqa: BLE001 - the stop must go on
                log.exception("drain: leaving failed")
        await asyncio.sleep(FLUSH_S)
        main.cancel()


_current = Drain()


def current() -> Drain:
    """This process's drain (the bootstrap installs a fresh one with the config's timeout)."""
    return _current


def install(timeout_s: float) -> Drain:
    global _current
    _current = Drain(timeout_s)
    return _current
