"""The block pool's invariants, checked while its worker is idle.

A worker with nothing queued, running or in flight holds no block: every block is free
(plain or evictable) and the pool's own invariants hold (``BlockPool.check_integrity``).
A violation is a leak or a double free in the worker's bookkeeping, found at the first
idle moment instead of as a full pool hours later. The check walks every block, so it runs
only when the worker is idle, sampled once per ``interval_s`` (``watch``), apart from its
steps: under load it costs nothing and the step loops are untouched. A violation is logged
as an error and counted; ``strict`` (tests) raises it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from common.kv.block_pool import BlockPool

log = logging.getLogger(__name__)

IDLE_CHECK_INTERVAL_S = 10.0


class IdleCheck:
    def __init__(self, pool: BlockPool, interval_s: float = IDLE_CHECK_INTERVAL_S,
                 strict: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.pool = pool
        self.interval_s = interval_s
        self.strict = strict
        self.clock = clock
        self.checks = 0
        self.violations = 0
        self._last: Optional[float] = None

    def run(self) -> bool:
        """Check now unless a check ran less than ``interval_s`` ago; True if it ran.
        Call only when the worker is idle: any referenced block counts as leaked."""
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            return False
        self._last = now
        self.checks += 1
        try:
            self.pool.check_integrity()
            if self.pool.num_used:
                raise AssertionError(f"{self.pool.num_used} of {self.pool.num_blocks} blocks "
                                     "still referenced with nothing queued or running")
        except AssertionError as exc:
            self.violations += 1
            log.error("KV block pool integrity violated (violation %d): %s",
                      self.violations, exc)
            if self.strict:
                raise
        return True

    async def watch(self, idle: Callable[[], bool]) -> None:
        """Forever: every ``interval_s``, check if the worker says it is ``idle()``."""
        while True:
            await asyncio.sleep(self.interval_s)
            if idle():
                self.run()
