"""A scripted conductor + decode worker for router tests, on a real Mailbox in a thread.

It binds ``config.inbox("conductor")``, records every message it receives, answers each
SubmitRequest by playing ``script(request)`` (a list of ``(delay_s, message)``) to the
router's inbox, and publishes ``status`` (if set; ``READY`` at first, as a live conductor
would) every ``status_interval_s``.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable, Optional

from common.config import ClusterConfig
from common.mailbox import Mailbox
from common.protocol import AbortRequest, RequestAccepted, SubmitRequest, TokenDelta
from common.status_protocol import ClusterStatus

Script = Callable[[SubmitRequest], list[tuple[float, Any]]]

WORDS = ["Hello", " world", "!"]
READY = ClusterStatus(True, [])


def accepted(req: SubmitRequest) -> RequestAccepted:
    return RequestAccepted(req.request_id, "prefill-0", "decode-0", 0.01)


def deltas(req: SubmitRequest, words: list[str], finish: str = "stop", cached: int = 0,
           delay: float = 0.0, logprobs: bool = False) -> list[tuple[float, Any]]:
    """One TokenDelta per word (token id 100+i), the last one with ``finish``."""
    out = []
    for i, word in enumerate(words):
        last = i == len(words) - 1
        out.append((delay, TokenDelta(
            request_id=req.request_id, token_ids=[100 + i], text=word,
            logprobs=[-0.5 - i] if logprobs else None,
            finish_reason=finish if last else None, prompt_tokens=len(req.token_ids),
            completion_tokens=i + 1, cached_tokens=cached)))
    return out


def default_script(req: SubmitRequest) -> list[tuple[float, Any]]:
    return [(0.0, accepted(req))] + deltas(req, WORDS, cached=16)


class FakeCluster:
    def __init__(self, config: ClusterConfig, status_interval_s: float = 0.1) -> None:
        self.config = config
        self.status_interval_s = status_interval_s
        self.script: Script = default_script
        self.status: Optional[ClusterStatus] = READY
        self.received: list[Any] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="fake-cluster", daemon=True)
        self._ready = threading.Event()
        self._stop: Optional[asyncio.Event] = None

    # ------------------------------------------------------------ test side
    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake cluster did not start")

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def submits(self) -> list[SubmitRequest]:
        return [m for m in list(self.received) if isinstance(m, SubmitRequest)]

    def wait_abort(self, request_id: str, timeout: float = 5.0) -> Optional[AbortRequest]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in list(self.received):
                if isinstance(m, AbortRequest) and m.request_id == request_id:
                    return m
            time.sleep(0.02)
        return None

    def aborts(self) -> list[AbortRequest]:
        return [m for m in list(self.received) if isinstance(m, AbortRequest)]

    # ------------------------------------------------------------ loop side
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self.mail = Mailbox(self.config.inbox("conductor"), "fake-conductor")
        tasks = [asyncio.create_task(self._recv()), asyncio.create_task(self._publish())]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.mail.close()

    async def _recv(self) -> None:
        while True:
            msg = await self.mail.recv()
            self.received.append(msg)
            if isinstance(msg, SubmitRequest):
                asyncio.create_task(self._play(self.script(msg)))

    async def _play(self, steps: list[tuple[float, Any]]) -> None:
        router = self.config.inbox("router")
        for delay, msg in steps:
            if delay:
                await asyncio.sleep(delay)
            self.mail.send(router, msg)

    async def _publish(self) -> None:
        router = self.config.inbox("router")
        while True:
            if self.status is not None:
                self.mail.send(router, self.status)
            await asyncio.sleep(self.status_interval_s)
