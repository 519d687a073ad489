"""A short prompt's step inside a long one: the prefill worker's compute thread runs it at
the next layer boundary of the step it is computing (``LayerPreemption``).

A prefill step over a long prompt's chunk took ~0.5 s on one core of the 2-core box
(256 tokens after a few hundred cached). A prompt of a few tokens arriving during it
waited for the rest of it and then shared the next step, which the long prompt filled
again: its TTFT was most of a second for ~0.07 s of compute. Preempted instead, the long
step pauses after its current layer (~1/30 of it), the short prompt's step runs whole
(every layer, its KV streamed and its first token sampled as usual), and the long step
goes on from the layer it paused at: its hidden states and KV are its own, so nothing it
computes changes. The short step holds the long one up by its own time, which the token
limit (``prefill_preempt_tokens``) bounds.

Only one step waits at a time. If no long step reaches a layer boundary first (it ended,
or none runs), the short step runs as the compute thread's next job.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, Optional, TypeVar

T = TypeVar("T")


class LayerPreemption(Generic[T]):
    def __init__(self, compute: ThreadPoolExecutor) -> None:
        self.compute = compute  # the worker's compute thread: one step at a time
        self._lock = threading.Lock()
        self._pending: Optional[tuple[Callable[[], T], Future]] = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def submit(self, step: Callable[[], T]) -> "asyncio.Future[T]":
        """Run ``step`` on the compute thread at the next layer boundary of the step it
        computes (``at_boundary``), or next if none comes first; its result."""
        done: Future = Future()
        with self._lock:
            if self._pending is not None:
                raise RuntimeError("a preempting step is waiting already")
            self._pending = (step, done)
        self.compute.submit(self.at_boundary)  # no-op if a boundary took it
        return asyncio.wrap_future(done)

    def at_boundary(self) -> float:
        """On the compute thread, between two layers of a step (or between steps): run
        the waiting step, if any; the seconds it took (the paused step's own time
        excludes them)."""
        with self._lock:
            taken, self._pending = self._pending, None
        if taken is None:
            return 0.0
        step, done = taken
        if not done.set_running_or_notify_cancel():
            return 0.0
        started = time.perf_counter()
        try:
            done.set_result(step())
        except BaseException as exc:  # the caller's to report, as a step's error
            done.set_exception(exc)
        return time.perf_counter() - started
